"""Probe: where the saved-tensor arena's graph replays depart from the same micro-steps run eagerly.

One micro-batch of packed rows (the tiny preset in bf16, a rank-8 adapter away from zero) through one
`ShapeGraphs`: its micro-steps run eagerly (the arena filling its slots), then captured and replayed, each
followed by a snapshot of what it wrote (the chunk's arena slots after a forward, the boundary tensors, the
boundary gradients and the adapter gradients after a backward, the loss sum). Each line names the first
quantities that differ from the eager pass's. Then the adapter's masters move (as an optimizer step moves
them) and both run again: replays must follow. ``--no-arena``: the same without the arena (no slots).
``--side-stream``: the replays run on a side stream (a trainer rung's case). ``--two-sets``: two sets of
graphs, A (a side stream, grids for 32 SMs) and B (another, grids for the whole GPU); the forwards replay
on A, the loss and backwards on B (the trainer's SMs moved mid-micro-batch), each set captured before any
replay (as the co-location warm-up does). ``--plain``: one document a row.

    PYTHONPATH=$PWD python bench/probe_arena.py [--no-arena] [--side-stream] [--two-sets] [--plain]
"""

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harli_train import kernels  # noqa: E402
from harli_train.model import load_model  # noqa: E402
from harli_train.saved_tensors import stays_in_place  # noqa: E402
from harli_train.train.batch_buffers import BatchBuffers  # noqa: E402
from harli_train.train.shape_graphs import set_key  # noqa: E402
from harli_train.train.step import chunk_bounds  # noqa: E402
from harli_train.train.step_graphs import StepGraphs  # noqa: E402


def batch(seed: int, b: int, t: int, two_docs: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (b, t), generator=g)
    doc = (torch.arange(t) >= t // 3).long().repeat(b, 1) * int(two_docs)
    positions = torch.arange(t).repeat(b, 1) - doc * (t // 3)
    return {"input_ids": ids, "labels": ids.clone(), "positions": positions, "doc_ids": doc}


def snapshot(shape, name: str, names: list[str]) -> dict[str, torch.Tensor]:
    """What micro-step ``name`` just wrote: a forward its output boundary and its chunk's arena slots, the
    loss the last boundary's gradients and the loss sum, a backward its input boundary's gradients and its
    chunk's adapter gradients."""
    out: dict[str, torch.Tensor] = {}
    if name == "loss":
        last = len(shape.bounds)
        out = {f"gh[{last}]": shape.gh[last], f"gr[{last}]": shape.gr[last], "loss": shape.loss_sum}
    else:
        chunk = int(name[3:])
        if name.startswith("fwd"):
            out = {f"h[{chunk + 1}]": shape.h[chunk + 1], f"r[{chunk + 1}]": shape.r[chunk + 1]}
            if shape.arena is not None:
                for (c, i), slot in shape.arena.slots.items():
                    if c == chunk and slot.is_floating_point():
                        out[f"slot {(c, i)} {tuple(slot.shape)} {slot.dtype} {str(slot.device)}"] = slot
        else:
            if chunk > 0:
                out = {f"gh[{chunk}]": shape.gh[chunk], f"gr[{chunk}]": shape.gr[chunk]}
            offset = sum(len(ps) for ps in shape.params[:chunk])
            for j, g in enumerate(shape.grads[chunk]):
                out[f"grad {names[offset + j]}"] = g
    return {k: v.detach().float().clone() for k, v in out.items()}


def diff(a: dict, b: dict) -> list[str]:
    """The quantities of snapshot ``a`` that differ from ``b``'s (relative error > 1e-2, or non-finite)."""
    bad = []
    for label, x in a.items():
        y = b[label]
        if x.numel() == 0:
            continue
        fx, fy = torch.isfinite(x), torch.isfinite(y)
        if not torch.equal(fx, fy) or not torch.equal(x[~fx], y[~fy]):  # an additive mask's -inf stays
            bad.append(f"{label} non-finite at other places ({int((fx != fy).sum())} of {x.numel()})")
            continue
        x, y = x[fx], y[fy]
        err = float(torch.linalg.vector_norm(x - y) / torch.linalg.vector_norm(y).clamp_min(1e-30))
        if err > 1e-2:
            bad.append(f"{label} off {err:.3g}")
    return bad


def main() -> None:
    args = set(sys.argv[1:])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m = load_model("tiny", dtype, device, seed=1)
    m.add_lora(8, 16.0, 0.0, seed=2)
    with torch.no_grad():
        for p in m.lora_parameters():
            p.normal_(0, 0.05)
    m.train()
    params = list(m.lora_parameters())
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if device == "cuda"
        else (lambda: torch.autocast("cpu", enabled=False))
    )
    bounds = chunk_bounds(m.config.num_layers, 1)
    graphs = StepGraphs(params, arena="--no-arena" not in args)
    b = batch(1, 4, 256, "--plain" not in args)
    targets = 4 * 255
    run = graphs.step(m, bounds, autocast, BatchBuffers(device), targets)
    run.load(b)
    shape = run.shape
    # the names of the grads in the shape's order
    by_id = {id(p): n for n, p in m.named_parameters()}
    names = [by_id[id(p)] for ps in shape.params for p in ps]
    stream = torch.cuda.Stream() if (device == "cuda" and "--side-stream" in args) else None

    def fresh():
        torch._foreach_zero_([g for gs in shape.grads for g in gs])
        shape.loss_sum.zero_()
        shape.targets.fill_(float(targets))

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def eager() -> list[tuple[str, dict]]:
        fresh()
        snaps = []
        for name, fn in shape.order():
            fn()
            sync()
            snaps.append((name, snapshot(shape, name, names)))
        return snaps

    two = "--two-sets" in args
    streams = [torch.cuda.Stream(), torch.cuda.Stream()] if device == "cuda" and two else [None, None]
    budgets = [32, kernels.num_sms()] if two else [kernels.num_sms()] * 2

    def on(i: int):
        """Set i's stream and SM budget."""
        stack = contextlib.ExitStack()
        stack.enter_context(kernels.sm_budget(budgets[i]))
        if streams[i] is not None:
            stack.enter_context(torch.cuda.stream(streams[i]))
        return stack

    def replay(graph_sets) -> list[tuple[str, dict]]:
        fresh()
        snaps = []
        for name, _ in shape.order():
            which = 0 if name.startswith("fwd") else 1
            with on(which):
                graph_sets[which][name].replay()
            sync()
            snaps.append((name, snapshot(shape, name, names)))
        return snaps

    passes: list[list[tuple]] = []  # per pass over the last chunk's forward: what each pack saw
    watched = len(bounds) - 1
    if shape.arena is not None:
        arena_type = type(shape.arena)
        original_pack, original_chunk = arena_type._pack, arena_type.chunk

        def chunk_recording(self, chunk):
            if chunk == watched:
                passes.append([])
            return original_chunk(self, chunk)

        def pack_recording(self, t):
            if self._chunk == watched:
                seen = self._seen.get(id(t))
                dup = seen is not None and seen[0]() is t and seen[1] == t._version
                where = "dup" if dup else ("stays" if stays_in_place(t, self.exclude) else f"#{self._next}")
                fn = type(t.grad_fn).__name__ if t.grad_fn is not None else "-"
                passes[-1].append((where, tuple(t.shape), str(t.dtype)[6:], fn, tuple(t.stride())))
            return original_pack(self, t)

        arena_type._pack, arena_type.chunk = pack_recording, chunk_recording

    ctx = torch.cuda.stream(stream) if stream is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        for round_ in range(2):
            want = eager()
            if round_ == 0:
                graph_sets = []
                for i in range(2):
                    with on(i):
                        graph_sets.append(shape.set_for(set_key()))
                sync()
            for rep in range(2):
                got = replay(graph_sets)
                first = None
                for (name, g), (_, w) in zip(got, want, strict=True):
                    bad = diff(g, w)
                    if bad:
                        first = (
                            f"{name}: " + "; ".join(bad[:6]) + (f" (+{len(bad) - 6})" if len(bad) > 6 else "")
                        )
                        break
                print(
                    f"round {round_} replay {rep}: loss eager {float(dict(want)['loss']['loss']):.4f} "
                    f"graphs {float(dict(got)['loss']['loss']):.4f}; "
                    + ("every micro-step equal" if first is None else f"first departure at {first}"),
                    flush=True,
                )
            with torch.no_grad():  # an optimizer step's worth of movement
                for p in params:
                    p.add_(torch.randn_like(p) * 0.01)
    if passes:
        print(f"packs of chunk {watched} (slot or dup/stays, shape, dtype, grad_fn, stride), first pass:")
        for rec in passes[0]:
            print("   ", *rec, flush=True)
        for n, recs in enumerate(passes[1:], 1):
            other = [f"{i}: {r}" for i, r in enumerate(recs) if i >= len(passes[0]) or r != passes[0][i]]
            print(f"  pass {n}: {len(recs)} packs; " + ("as the first" if not other else "; ".join(other)))
    if shape.arena is not None:
        print(f"arena: {len(shape.arena.slots)} slots, {shape.arena.nbytes / 2**20:.1f} MiB", flush=True)
        kinds = {}
        for k, v in shape.arena.slots.items():
            kinds.setdefault((str(v.device), str(v.dtype)), []).append(k)
        for kind, keys in kinds.items():
            print(f"  {kind}: {len(keys)} slots, e.g. {keys[:4]}", flush=True)


if __name__ == "__main__":
    main()
