"""Decode TPOT of the engine on Llama-3-8B shapes (random bf16 weights) against the roofline and transformers.

    python bench/bench_decode.py            # on the GPU; writes $OUT/bench_decode.json, prints a table last
    python bench/bench_decode.py --dry-run  # on the CPU: the same code paths on the tiny model, a few steps
    python bench/bench_decode.py --only lora  # the batched-LoRA section alone

Roofline of one decode step = (weight bytes read + KV bytes read) / copy bandwidth measured in this run, where
the weights read are every weight but the embedding table (a step gathers only B rows of it; the figure with
it is kept as `roofline_all_weights_ms`). TPOT is the median `engine.step()` latency (scheduling, graph
replay, sampling, the token read-back) after warm-up; `replay_ms` is the CUDA graph alone. Target
(docs/design.md): TPOT <= 1.25x roofline for batch 1-64. Rows "default" run the engine's decode forward (GEMV
projection kernels, EngineConfig.decode_gemv); rows "no_gemv" the same engine with the model's own forward
(cuBLAS); `gemv_kernel` (bench/decode_kernels.py) times each projection alone against cuBLAS. Sequences are
primed at the given context without a prefill (decode time does not depend on the cached values); one real
prefill + decode is checked against the model's own no-cache greedy output in the `sanity` section.

`lora` (batched LoRA, bench/decode_lora.py): engines with 4 adapter slots of rank 16 on all seven
projections: rows "lora_base", "lora_1", "lora_mix4" ("split" kernels before each projection),
"lora_1_gemv", "lora_mix4_gemv" (the default "gemv": inside its launches) and "*_gemv_split" (the same with
the norms after o and down split by columns), batch 1-64, with their TPOT ratios to lora_base against the
targets (issue 22: 1.10 for one adapter, 1.15 for four), and the LoRA delta kernels timed alone. `--only
lora` runs just that section (and the copy bandwidth the rooflines need).

`gemv_by_share` (bench/gemv_by_share.py; `--only gemv_by_share`, ~1 min): batch 1's projections of one layer
on green contexts of 16-132 SMs, with FMAs and with the tensor-core tiles, and the share from which the FMAs
are no slower (what `decode_linear.FMA_MIN_SMS` should be).

`gemv_rows` (bench/gemv_rows.py; `--only gemv_rows`, ~1 min): one layer's projections at 64-256 rows (mixed
steps' token buckets) on the GEMV and on cuBLAS, by share, and the rows up to which the GEMV is no slower
(what `engine_config.MAX_GEMV_ROWS` should be).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harli_train from this checkout
import common  # noqa: E402
import decode_lora  # noqa: E402
import gemv_by_share  # noqa: E402
import gemv_rows  # noqa: E402
from decode_kernels import attention_kernel, gemv_kernel, linears_only_ms  # noqa: E402

TARGET = 1.25


def copy_bandwidth(device, nbytes: int) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted, as in the probes)."""
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    common.sync_device(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        y.copy_(x)
        common.sync_device(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / common.median(times)


def green_stream(num_sms: int):
    """A stream on a green context of >= num_sms SMs (cuda.bindings, as probes/probe_split.py); returns
    (torch stream, SMs actually granted, handles to keep alive)."""
    import torch
    from cuda.bindings import driver as cu

    def ck(r):
        if r[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(str(r[0]))
        return r[1:] if len(r) > 2 else (r[1] if len(r) == 2 else None)

    ck(cu.cuInit(0))
    dev = ck(cu.cuDeviceGet(torch.cuda.current_device()))
    sm_all = ck(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    res, _, _rem = ck(cu.cuDevSmResourceSplitByCount(1, sm_all, 0, num_sms))
    group = res[0] if isinstance(res, (list, tuple)) else res
    desc = ck(cu.cuDevResourceGenerateDesc([group], 1))
    gctx = ck(cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    stream = ck(cu.cuGreenCtxStreamCreate(gctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
    return torch.cuda.ExternalStream(int(stream)), group.sm.smCount, (gctx, stream)


def prime(engine, batch: int, ctx: int, max_tokens: int, slots: tuple[int, ...] = (0,)):
    """`batch` running sequences with `ctx - 1` tokens cached, so the next steps are all decode steps;
    request i runs on adapter slot `slots[i % len(slots)]`."""
    from harli_train.engine import SamplingParams, SequenceStatus

    sched, bm = engine.scheduler, engine.block_manager
    for i in range(batch):
        engine.add_request(
            [(7 * i + j) % 200 for j in range(ctx)],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            lora_slot=slots[i % len(slots)],
        )
    while sched.waiting:
        seq = sched.waiting.popleft()
        bm.allocate(seq, ctx)
        seq.num_computed, seq.status = ctx - 1, SequenceStatus.RUNNING
        sched.running.append(seq)


def drain(engine) -> None:
    engine.abort_all()  # also settles a step launched ahead


def measure_tpot(
    engine, batch: int, ctx: int, steps: int, warmup: int, partition: str, slots: tuple[int, ...] = (0,)
) -> dict:
    import torch

    prime(engine, batch, ctx, warmup + steps + 2, slots)
    lat = []
    for i in range(warmup + steps):
        r = engine.step(partition)
        assert r.kind == "decode" and r.num_seqs == batch, (r.kind, r.num_seqs)
        if i >= warmup:
            lat.append(r.latency_s * 1e3)
    out = {"tpot_ms": common.median(lat), "tpot_p90_ms": sorted(lat)[int(0.9 * (len(lat) - 1))]}
    graphs = engine.runner.graphs
    if graphs is not None:
        # The graph alone, replayed back to back on its stream: step time minus host work.
        graph = graphs.graphs[(partition, graphs.bucket(batch), any(slots))]
        stream = engine.runner.partitions[partition].stream
        with torch.cuda.stream(stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                graph.replay()
            end.record()
        end.synchronize()
        out["replay_ms"] = start.elapsed_time(end) / steps
    drain(engine)
    return out


def set_decode_gemv(engine, on: bool, saved: dict) -> None:
    """Switch the engine's decode forward (GEMV kernels) on or off and recapture its partitions' graphs."""

    from harli_train.kernels.launch_config import sm_budget

    runner = engine.runner
    if "fwd" not in saved:
        saved["fwd"] = runner.decode_forward
    fwd = saved["fwd"] if on else None
    runner.decode_forward = fwd
    if runner.graphs is not None:
        runner.graphs.decode_forward = fwd
        for key, part in runner.partitions.items():
            with sm_budget(part.num_sms):
                runner.graphs.capture(key, part.stream, part.num_sms)


def sanity(engine, model, device, prompt_len: int, tokens: int) -> dict:
    """A real prefill + greedy decode through the engine against the model's no-cache greedy loop."""
    import torch

    from harli_train.engine import SamplingParams

    prompts = [[(13 * i + 5 * j) % 1000 + 1 for j in range(prompt_len + 9 * i)] for i in range(4)]
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    prefill = [s for s in engine.metrics.steps[-tokens - 2 :] if s.kind == "prefill"]
    agree = []
    with torch.inference_mode():
        for p, s in zip(prompts, seqs, strict=True):
            ids = list(p)
            for _ in range(tokens):
                h = model(torch.tensor([ids], device=device))
                ids.append(int(model.logits(h[:, -1]).argmax()))
            ref = ids[len(p) :]
            # Greedy paths diverge after the first bf16 near-tie; count the agreeing prefix.
            pairs = zip(ref, s.completion_token_ids, strict=True)
            n = next((i for i, (a, b) in enumerate(pairs) if a != b), tokens)
            agree.append(n)
    return {
        "agreeing_prefix": agree,
        "tokens": tokens,
        "wall_s": wall,
        "prefill_ms": [round(s.latency_ms, 3) for s in prefill],
    }


def hf_decode(mc, batch: int, ctx: int, steps: int, device) -> dict:
    """transformers' LlamaForCausalLM decode loop (DynamicCache, sdpa, eager: how a user runs it)."""
    import torch
    from transformers import LlamaForCausalLM

    cfg = common.hf_llama_config(mc)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        torch.set_default_dtype(dtype)
        model = LlamaForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    out = {}
    with torch.inference_mode():
        for b in [batch] if isinstance(batch, int) else batch:
            ids = torch.randint(0, min(1000, mc.vocab_size), (b, ctx), device=device)
            res = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            pkv, tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
            lat = []
            for _ in range(steps):
                common.sync_device(device)
                t0 = time.perf_counter()
                res = model(input_ids=tok, past_key_values=pkv, use_cache=True)
                pkv, tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
                common.sync_device(device)
                lat.append((time.perf_counter() - t0) * 1e3)
            out[b] = common.median(lat[1:])
            del pkv, res
    del model
    return out


class Bench:
    """One run: results, the table rows, and `section` which records a failing section and carries on."""

    def __init__(self, dry: bool, steps: int):
        self.dry = dry
        self.steps, self.warmup = (3, 1) if dry else (steps, 4)
        self.ctx = 32 if dry else 1024
        self.batches = [1, 4] if dry else [1, 8, 32, 64, 128, 256]
        self.extra = [(4, 16), (4, 48)] if dry else [(8, 512), (64, 512), (8, 2048), (64, 2048)]
        self.sm_parts = [] if dry else [48, 64]
        self.res: dict = {"env": common.environment(), "dry_run": dry, "target_ratio": TARGET, "errors": {}}
        self.rows: list[list] = []

    def section(self, key, fn):
        try:
            self.res[key] = fn()
        except Exception as e:  # one failing section must not cost the others
            self.res["errors"][key] = f"{type(e).__name__}: {e}"
            traceback.print_exc()

    def roofline_ms(self, batch: int, ctx: int, all_weights: bool = False) -> float:
        weights = self.res["weight_bytes_all" if all_weights else "weight_bytes_read"]
        bw = self.res.get("copy_TBps", float("nan")) * 1e12
        return (weights + batch * ctx * self.res["kv_bytes_per_token"]) / bw * 1e3

    def sweep(
        self, engine, partition: str, points, label: str | None = None, slots: tuple[int, ...] = (0,)
    ) -> dict:
        out = {}
        for b, c in points:
            m = measure_tpot(engine, b, c, self.steps, self.warmup, partition, slots)
            m["roofline_ms"] = self.roofline_ms(b, c)
            m["roofline_all_weights_ms"] = self.roofline_ms(b, c, all_weights=True)
            m["ratio"] = m["tpot_ms"] / m["roofline_ms"]
            out[f"b{b}_ctx{c}"] = m
            verdict = "ok" if m["ratio"] <= TARGET else "MISS" if b <= 64 else "-"
            replay = m.get("replay_ms", float("nan"))
            self.rows.append(
                [label or partition, b, c, m["tpot_ms"], replay, m["roofline_ms"], m["ratio"], verdict]
            )
            print(label or partition, b, c, {k: round(v, 3) for k, v in m.items()}, flush=True)
        return out

    def load_model(self, device):
        """The benchmarked model (random weights: Llama-3-8B in bf16, or the tiny preset in a dry run); records
        the byte counts the rooflines use."""
        import torch

        from harli_train.model import load_model

        name = "tiny" if self.dry else "llama-8b"
        self.res["model"] = name
        model = load_model(name, torch.float32 if self.dry else torch.bfloat16, device)
        embed = model.model.embed_tokens.weight
        self.res["weight_bytes_all"] = sum(p.numel() * p.element_size() for p in model.parameters())
        self.res["weight_bytes_read"] = self.res["weight_bytes_all"] - embed.numel() * embed.element_size()
        mc = model.config
        self.res["kv_bytes_per_token"] = (
            2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * embed.element_size()
        )
        return model

    def engine_sections(self, device) -> None:
        """Everything that needs our model and engine; they are freed when this returns."""
        from harli_train.engine import DecodeEngine, EngineConfig

        model = self.load_model(device)
        mc = model.config
        max_len = max([self.ctx] + [c for _, c in self.extra]) + self.warmup + self.steps + 16
        cfg = EngineConfig(
            max_num_seqs=max(self.batches),
            max_model_len=max_len,
            max_num_batched_tokens=8192,
            graph_batch_sizes=tuple(self.batches),
            gpu_memory_utilization=0.6,
            num_kv_blocks=256 if self.dry else None,
        )
        t0 = time.perf_counter()
        engine = DecodeEngine(model, cfg)
        self.res["engine"] = {
            "setup_s": time.perf_counter() - t0,
            "kv_blocks": engine.storage.num_blocks,
            "graphs": engine.runner.use_graphs,
            "overlap": engine.overlap,
        }
        points = [(b, self.ctx) for b in self.batches] + self.extra
        self.res["engine"]["decode_gemv"] = engine.runner.decode_forward is not None
        self.section("tpot_full", lambda: self.sweep(engine, "default", points))
        # The same engine with the model's own forward (cuBLAS projections), batch 1-64: on vs off.
        saved: dict = {}
        small = [(b, self.ctx) for b in self.batches if b <= 64]

        def cublas_sweep():
            set_decode_gemv(engine, False, saved)
            try:
                return self.sweep(engine, "default", small, label="no_gemv")
            finally:
                set_decode_gemv(engine, True, saved)

        self.section("tpot_no_gemv", cublas_sweep)

        def serial_sweep():  # host work not overlapped: each step's tokens are read before the next launch
            was, engine.overlap = engine.overlap, False
            points = [(b, self.ctx) for b in self.batches if b in (1, 8, 64)]
            try:
                return self.sweep(engine, "default", points, label="no_overlap")
            finally:
                engine.overlap = was

        self.section("tpot_no_overlap", serial_sweep)

        def o_gemv_sweep():  # o_proj at 64 rows through the GEMV instead of cuBLAS (the A/B of that rule)
            from harli_train.engine import decode_forward

            was = decode_forward.CUBLAS_SQUARE_ROWS
            decode_forward.CUBLAS_SQUARE_ROWS = 1 << 30
            set_decode_gemv(engine, True, saved)
            points = [(b, c) for b, c in [(64, 512), (64, self.ctx)] if b in self.batches]
            try:
                return self.sweep(engine, "default", points, label="o_gemv")
            finally:
                decode_forward.CUBLAS_SQUARE_ROWS = was
                set_decode_gemv(engine, True, saved)

        self.section("tpot_o_gemv", o_gemv_sweep)
        self.section("linears_only_ms", lambda: {b: linears_only_ms(model, b, device) for b in (1, 64)})
        self.section("gemv_kernel", lambda: gemv_kernel(mc, device, [1, 4] if self.dry else [1, 16, 64]))
        att_points = (
            [(1, 32), (4, 48)] if self.dry else [(1, 1024), (8, 1024), (64, 1024), (256, 1024), (64, 2048)]
        )
        self.section("attention_kernel", lambda: attention_kernel(mc, device, att_points))
        keep_alive = []

        def green(n):
            stream, got, handles = green_stream(n)
            keep_alive.append(handles)
            engine.add_partition(f"sm{got}", stream, got)
            points = [(b, self.ctx) for b in self.batches if b <= 64]
            return {"sms": got, **self.sweep(engine, f"sm{got}", points)}

        for n in self.sm_parts:
            self.section(f"tpot_sm{n}", lambda n=n: green(n))
        prompt_len, tokens = (16, 4) if self.dry else (200, 16)
        self.section("sanity", lambda: sanity(engine, model, device, prompt_len, tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, a few steps")
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per point")
    ap.add_argument(
        "--only",
        choices=["lora", "gemv_by_share", "gemv_rows"],
        help="run one section (and the copy bandwidth) only",
    )
    args = ap.parse_args()

    import torch

    from harli_train.model import model_config

    dry = args.dry_run or not torch.cuda.is_available()
    if dry:
        torch.set_num_threads(1)  # tiny ops: threads only contend
    device = torch.device("cpu" if dry else "cuda")
    bench = Bench(dry, args.steps)
    bench.section("copy_TBps", lambda: copy_bandwidth(device, (64 << 20) if dry else (2 << 30)) / 1e12)
    if args.only is None:
        bench.section("engine_run", lambda: bench.engine_sections(device))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    mc = model_config("tiny" if dry else "llama-8b")
    if args.only in (None, "lora"):
        bench.section("lora", lambda: decode_lora.lora_sections(bench, device))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.only in (None, "gemv_by_share"):
        bench.section("gemv_by_share", lambda: gemv_by_share.gemv_by_share(mc, device, green_stream))
    if args.only in (None, "gemv_rows"):
        bench.section("gemv_rows", lambda: gemv_rows.gemv_rows(mc, device, green_stream))
    if args.only is None:
        bench.section(
            "transformers_tpot_ms",
            lambda: hf_decode(mc, [1, 4] if dry else [1, 64], bench.ctx, 4 if dry else 6, device),
        )
    res, ctx = bench.res, bench.ctx
    for b, t in (res.get("transformers_tpot_ms") or {}).items():
        roof = bench.roofline_ms(b, ctx)
        bench.rows.append(["transformers", b, ctx, t, float("nan"), roof, t / roof, "-"])

    path = common.write_json("bench_decode.json", res)
    print(
        f"\nresults: {path}   copy bandwidth {res.get('copy_TBps', float('nan')):.2f} TB/s   "
        f"target TPOT <= {TARGET}x roofline for batch 1-64"
    )
    if res.get("linears_only_ms"):
        lin = res["linears_only_ms"]
        print(
            f"weight GEMMs alone (cuBLAS, one graph): batch 1 {lin[1]:.3f} ms, batch 64 {lin[64]:.3f} ms "
            f"(roofline {bench.roofline_ms(1, 0):.3f} ms for the weights)"
        )
    if res.get("gemv_kernel"):
        bw = res.get("copy_TBps", float("nan")) * 1e3
        print(f"decode projections alone (GB/s over weight bytes; copy bandwidth {bw:.0f} GB/s):")
        for key, r in res["gemv_kernel"].items():
            dot = f", dot variant {r['gemv_dot_GBps']:.0f}" if "gemv_dot_GBps" in r else ""
            print(
                f"  {key:14s} {r['MB']:8.1f} MB  gemv {r['gemv_us']:8.1f} us {r['gemv_GBps']:6.0f} GB/s "
                f"({r['gemv_GBps'] / bw:.0%}){dot}   cublas {r['cublas_us']:8.1f} us {r['cublas_GBps']:6.0f} "
                f"GB/s ({r['cublas_GBps'] / bw:.0%})  {r.get('config', '')}"
            )
            if "sweep_best" in r:
                print(f"  {'':14s} best of the sweep: {r['sweep_best'][0]} {r['sweep_best'][1]:.1f} us")
    if res.get("attention_kernel"):
        bw = res.get("copy_TBps", float("nan")) * 1e3
        print(
            "paged decode kernel alone: "
            + ", ".join(
                f"{k} {v['us']:.0f} us {v['GBps']:.0f} GB/s ({v['GBps'] / bw:.0%} of copy)"
                for k, v in res["attention_kernel"].items()
            )
        )
    if res.get("lora"):
        decode_lora.print_summary(res["lora"])
    if res.get("gemv_by_share"):
        gemv_by_share.print_summary(res["gemv_by_share"])
    if res.get("gemv_rows"):
        gemv_rows.print_summary(res["gemv_rows"])
    if res["errors"]:
        print("errors:", ", ".join(res["errors"]))
    header = ["where", "batch", "ctx", "tpot_ms", "replay_ms", "roofline_ms", "ratio", "<=1.25x"]
    print(common.table(bench.rows, header))


if __name__ == "__main__":
    main()
