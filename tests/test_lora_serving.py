"""Adapters served unmerged by the decode engine: greedy output on an adapter equals peft's merged model and
`harli-train generate --adapter`; a batch mixing the base and two adapters gives each request what it gets
alone (decode, chunked prefill and mixed steps); the catalog's refusals and its slot reuse."""

import shutil

import pytest
import torch
from click.testing import CliRunner

from harli_train.adapter import AdapterError
from harli_train.cli import main
from harli_train.engine import EngineConfig, SamplingParams
from harli_train.engine.api import build_catalog

from .lora_adapters import ALL_TARGETS, greedy, peft_merged, save_base, save_peft_adapter

PROMPTS = [[256, *b"hello there"], [256, *b"a much longer prompt that is chunked"], [256, *b"ok"]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_base(root / "base")
    alpha = save_peft_adapter(base, root / "alpha", rank=8, alpha=16, targets=ALL_TARGETS, seed=1)
    beta = save_peft_adapter(
        base, root / "beta", rank=4, alpha=4, targets=["q_proj", "v_proj", "down_proj"], seed=2
    )
    return base, alpha, beta


def _catalog(models, **config):
    base, alpha, beta = models
    cfg = EngineConfig(max_model_len=128, **config)
    return build_catalog(str(base), "cpu", "float32", config=cfg, adapters=[str(alpha), str(beta)])


def _run(engine, requests, n=10):
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    seqs = [engine.add_request(ids, params, lora_slot=slot) for ids, slot in requests]
    engine.run_until_done()
    return [s.completion_token_ids for s in seqs]


def test_greedy_output_on_an_adapter_equals_peft_merged_and_generate(models, tmp_path):
    base, alpha, beta = models
    catalog = _catalog(models)
    assert catalog.ids() == ["base", "alpha", "beta"]
    engine = catalog.engine
    for name, adapter in (("base", None), ("alpha", alpha), ("beta", beta)):
        (got,) = _run(engine, [(PROMPTS[0], catalog.slot(name))], n=12)
        assert got == greedy(peft_merged(base, adapter), PROMPTS[0], 12), name
    (on_base,), (on_alpha,) = _run(engine, [(PROMPTS[0], 0)]), _run(engine, [(PROMPTS[0], 1)])
    assert on_base != on_alpha  # the adapter matters
    # The command line's --adapter: the same unmerged path, the same text.
    prompt = "hello there"
    seq = engine.add_request(prompt, SamplingParams(max_tokens=8), lora_slot=catalog.slot("alpha"))
    engine.run_until_done()
    args = ["generate", "--model", str(base), "--adapter", str(alpha), "--prompt", prompt]
    result = CliRunner().invoke(main, [*args, "--max-tokens", "8", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == prompt + engine.decode_text(seq)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_batch_mixing_base_and_two_adapters_gives_each_request_what_it_gets_alone(models, mixed):
    """Prompts chunked (8 tokens a step) and, with mixed prefill, riding in decode steps beside rows of
    other adapters."""
    engine = _catalog(models, mixed_prefill=mixed, prefill_chunk_tokens=8, max_num_batched_tokens=16).engine
    requests = [(PROMPTS[i % 3], slot) for i, slot in enumerate([0, 1, 2, 1, 0, 2])]
    alone = [_run(engine, [r])[0] for r in requests]
    together = _run(engine, requests)
    assert together == alone
    assert len({tuple(a) for a in alone[:3]}) == 3  # base, alpha and beta differ on these prompts


@pytest.mark.slow
@pytest.mark.parametrize("lora_kernel", ["gemv", "gemv-split-norm", "fused", "split"])
def test_triton_kernels_serve_the_same_tokens_in_a_mixed_batch(models, monkeypatch, lora_kernel):
    """The decode path with the GEMV kernels and the batched LoRA kernels (under the interpreter); on
    "gemv" also with the norms after o and down split by columns (`decode_norm_shrink.SPLIT_NORM_ROWS`)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if lora_kernel == "gemv-split-norm":
        from harli_train.engine import decode_norm_shrink

        lora_kernel = "gemv"
        monkeypatch.setattr(decode_norm_shrink, "SPLIT_NORM_ROWS", 64)
        monkeypatch.setattr(decode_norm_shrink, "SPLIT_NORM_COLUMNS", 16)  # several programs a row
    torch_engine = _catalog(models).engine
    triton_engine = _catalog(models, kernels="triton", lora_kernel=lora_kernel).engine
    assert triton_engine.runner.decode_forward is not None and triton_engine.lora.kernel == lora_kernel
    requests = [(PROMPTS[0], 1), (PROMPTS[2], 0), (PROMPTS[0], 2)]
    assert _run(triton_engine, requests, n=6) == _run(torch_engine, requests, n=6)


@pytest.mark.parametrize("lora_kernel", ["fused", "split"])
def test_a_decode_step_with_adapters_runs_the_base_launches_plus_the_deltas(models, monkeypatch, lora_kernel):
    """The adapter step keeps the base step's fused projections (SwiGLU and add + norm in their epilogues,
    each now given the delta) and adds one delta per projection launch; a base step computes no delta."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from harli_train import kernels
    from harli_train.engine import decode_forward, lora_fused, lora_ops

    engine = _catalog(models, kernels="triton", lora_kernel=lora_kernel).engine
    calls = []

    def record(module, name):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.append(name + ("+delta" if kwargs.get("addend") is not None else ""))
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for module, name in [
        (decode_forward, "decode_linear"),
        (decode_forward, "decode_linear_add_rms_norm"),
        (kernels, "swiglu"),
        (kernels, "add_rms_norm"),
        (lora_fused, "lora_delta_fused"),
        (lora_ops, "lora_delta_split"),
        (lora_ops, "lora_add"),
    ]:
        record(module, name)
    engine.add_partition("two_sms", None, 2)  # few attention splits: fewer programs to interpret
    engine.synthetic_decode(2, 4, "two_sms")
    base = list(calls)
    calls.clear()
    engine.synthetic_decode(2, 4, "two_sms", lora_slots=2)
    delta = "lora_delta_fused" if lora_kernel == "fused" else "lora_delta_split"
    layers = engine.model.config.num_layers
    assert calls.count(delta) == 4 * layers and len(calls) == len(base) + 4 * layers
    assert [c.removesuffix("+delta") for c in calls if c != delta] == base
    assert sum(c.endswith("+delta") for c in calls) == 4 * layers  # every projection but the LM head
    assert "swiglu" not in base and not any("lora" in c for c in base)


def test_the_gemv_kernel_runs_each_adapter_step_projection_in_its_own_launches(models, monkeypatch):
    """With lora_kernel "gemv" an adapter step calls the base step's projections, each given its layer's
    LoRA (no separate delta kernel), and a base step gives none. Where q/k/v and gate/up run without
    split-K (every projection of this tiny model), the norms before them compute their shrink: the first
    layer's input norm alone (`rms_norm_shrink`), every other one in the launch that also sums the o or
    down projection before it, adds that projection's own expand, the residual and norms
    (`decode_linear_add_rms_norm_shrink`); the last down projection, before the final norm, has no shrink
    ahead."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from harli_train.engine import decode_forward, lora_fused, lora_ops

    engine = _catalog(models, kernels="triton", lora_kernel="gemv").engine
    calls = []

    def record(module, name):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.append(name + ("+lora" if kwargs.get("lora") is not None else ""))
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for module, name in [
        (decode_forward, "decode_linear"),
        (decode_forward, "decode_linear_add_rms_norm"),
        (decode_forward, "decode_linear_add_rms_norm_shrink"),
        (decode_forward, "rms_norm_shrink"),
        (lora_fused, "lora_delta_fused"),
        (lora_ops, "lora_delta_split"),
        (lora_ops, "lora_add"),
    ]:
        record(module, name)
    engine.add_partition("two_sms", None, 2)
    engine.synthetic_decode(2, 4, "two_sms")
    base = list(calls)
    calls.clear()
    engine.synthetic_decode(2, 4, "two_sms", lora_slots=2)
    layers = engine.model.config.num_layers
    assert not any("+lora" in c or "shrink" in c for c in base)
    assert calls.count("rms_norm_shrink") == 1
    projections = [c.removesuffix("+lora") for c in calls if c != "rms_norm_shrink"]
    fused = "decode_linear_add_rms_norm"
    assert [c.replace(fused + "_shrink", fused) for c in projections] == base
    assert projections.count(fused) == 1  # the last down projection, before the final norm
    assert projections.count(fused + "_shrink") == 2 * layers - 1
    assert sum(c.endswith("+lora") for c in calls) == 4 * layers  # all but the head


def test_lora_kernel_names_the_allowed_values():
    from harli_train.engine import EngineError

    with pytest.raises(
        EngineError, match=r"lora_kernel is one of \('gemv', 'fused', 'split'\), got 'punica'"
    ):
        EngineConfig(lora_kernel="punica")


def test_the_catalog_refuses_what_it_cannot_serve_and_reuses_slots(models, tmp_path):
    base, alpha, _ = models
    catalog = _catalog(models)
    pickled = tmp_path / "pickled"
    shutil.copytree(alpha, pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(AdapterError, match="only safetensors adapters.*adapter_model.bin is a pickle"):
        catalog.read(pickled)
    big = save_peft_adapter(base, tmp_path / "big", rank=32, alpha=32, targets=["q_proj"], seed=3)
    with pytest.raises(AdapterError, match="rank 32 exceeds the engine's max LoRA rank 16"):
        catalog.read(big)
    other = tmp_path / "other-base"
    from .hf_models import save_tiny_llama

    save_tiny_llama(other, vocab_size=264, hidden_size=48, intermediate_size=72, num_hidden_layers=2)
    wrong = save_peft_adapter(other, tmp_path / "wrong", rank=4, alpha=4, targets=["q_proj"], seed=4)
    with pytest.raises(AdapterError, match="expected .*adapter made for another model"):
        catalog.read(wrong)
    with pytest.raises(AdapterError, match="already served"):
        catalog.add("alpha", catalog.read(alpha))
    with pytest.raises(AdapterError, match="all 2 adapter slots are in use"):
        catalog.add("gamma", catalog.read(alpha))
    # Unloading: a running request finishes on its slot; the slot is reused only after it has.
    engine = catalog.engine
    running = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), lora_slot=1)
    catalog.remove("alpha")
    with pytest.raises(KeyError):
        catalog.slot("alpha")
    with pytest.raises(AdapterError, match="slots are in use"):
        catalog.add("gamma", catalog.read(alpha))
    engine.run_until_done()
    assert running.completion_token_ids == _run(_catalog(models).engine, [(PROMPTS[0], 1)], n=4)[0]
    assert catalog.add("gamma", catalog.read(alpha)) == 1 and catalog.ids() == ["base", "beta", "gamma"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("lora_kernel", ["gemv", "split"])
@pytest.mark.parametrize("mixed", [False, True])
def test_graphs_with_adapters_equal_eager_and_base_batches_replay_the_base_graph(models, mixed, lora_kernel):
    """On a GPU: decode (and mixed) steps replay the LoRA graph of their bucket for a mix of adapters and
    give the eager engine's tokens; a base-only batch replays the base graph."""
    base, alpha, beta = models
    # A cache of its own size: sized from the device's free memory, it found none while the smoke's other
    # GPU processes held theirs.
    cfg = dict(max_model_len=128, mixed_prefill=mixed, prefill_chunk_tokens=8, max_num_batched_tokens=64)
    cfg.update(lora_kernel=lora_kernel, num_kv_blocks=64)
    graphs = build_catalog(
        str(base), "cuda", "float32", config=EngineConfig(**cfg), adapters=[str(alpha), str(beta)]
    )
    eager = build_catalog(
        str(base),
        "cuda",
        "float32",
        config=EngineConfig(enforce_eager=True, **cfg),
        adapters=[str(alpha), str(beta)],
    )
    assert graphs.engine.runner.use_graphs and ("default", 1, True) in graphs.engine.runner.graphs.graphs
    requests = [(PROMPTS[i % 3], slot) for i, slot in enumerate([0, 1, 2, 1, 0, 2])]
    assert _run(graphs.engine, requests) == _run(eager.engine, requests)
    replayed = []

    class Spy:  # stands for a graph: records which one replays
        def __init__(self, key, graph):
            self.key, self.graph = key, graph

        def replay(self):
            replayed.append(self.key)
            self.graph.replay()

    table = graphs.engine.runner.graphs.graphs
    for key in list(table):
        table[key] = Spy(key, table[key])
    assert _run(graphs.engine, [(PROMPTS[0], 0)]) == _run(eager.engine, [(PROMPTS[0], 0)])
    assert replayed and all(not with_lora for _, _, with_lora in replayed)


@pytest.mark.parametrize("lora_kernel", ["gemv", "split"])
def test_past_the_gemv_rows_the_deltas_are_added_into_cublas_outputs_in_place(
    models, monkeypatch, lora_kernel
):
    """A step past MAX_GEMV_ROWS (a mixed step with a prefill chunk) computes each projection with cuBLAS and
    adds its adapter rows' deltas in place: one shrink + expand pair (`lora_add`) for q/k/v side by side,
    one for gate and up (each slice into its own output), one for down before its residual add + norm, no
    fp32 delta; the outputs equal the torch reference slot by slot."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    import numpy as np

    from harli_train import kernels
    from harli_train.engine import decode_forward, lora_fused, lora_ops
    from harli_train.engine.engine_config import MAX_GEMV_ROWS
    from harli_train.engine.lora_ops import lora_add_reference

    engine = _catalog(models, kernels="triton", lora_kernel=lora_kernel).engine
    fwd, slots = engine.runner.decode_forward, engine.lora
    calls = []
    for module, name in [
        (lora_ops, "lora_add"),
        (lora_fused, "lora_delta_fused"),
        (lora_ops, "lora_delta_split"),
    ]:
        fn = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k)
        )
    rows = MAX_GEMV_ROWS + 6
    token_slots = np.random.default_rng(0).integers(0, 3, rows)
    x = torch.randn(rows, engine.model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    layer = engine.model.model.layers[1]
    cases = [
        (decode_forward.QKV, (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj), False),
        (decode_forward.GATE_UP, (layer.mlp.gate_proj, layer.mlp.up_proj), True),
    ]
    slots_t = torch.from_numpy(token_slots)
    with slots.active(token_slots):
        for group, mods, swiglu in cases:
            weights = tuple(m.weight for m in mods)
            calls.clear()
            got = decode_forward._project(x, weights, swiglu=swiglu, **fwd._adapters(x, weights, 1, group))
            assert calls == ["lora_add"]
            ys = [
                lora_add_reference(
                    torch.nn.functional.linear(x, w),
                    x,
                    [slots.a[t][1]],
                    [slots.b[t][1]],
                    [0],
                    slots_t,
                    slots.scales,
                )
                for w, t in zip(weights, group, strict=True)
            ]
            want = kernels.swiglu(*ys) if swiglu else torch.cat(ys, dim=-1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            base = token_slots == 0
            plain = [torch.nn.functional.linear(x, w) for w in weights]
            plain = kernels.swiglu(*plain) if swiglu else torch.cat(plain, dim=-1)
            assert torch.equal(got[torch.from_numpy(base)], plain[torch.from_numpy(base)])  # the base's rows
        down, norm = layer.mlp.down_proj, engine.model.model.norm
        act = torch.randn(rows, down.weight.shape[1], generator=torch.Generator().manual_seed(2))
        calls.clear()
        adds = fwd._adapters(act, (down.weight,), 1, decode_forward.DOWN)
        y, h = decode_forward._project_add_norm(act, down.weight, x, norm, **adds)
        assert calls == ["lora_add"]
        p = torch.nn.functional.linear(act, down.weight)
        p = lora_add_reference(
            p, act, [slots.a["down_proj"][1]], [slots.b["down_proj"][1]], [0], slots_t, slots.scales
        )
        want_y, want_h = kernels.add_rms_norm(p, x, norm.weight, norm.eps)
        torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
