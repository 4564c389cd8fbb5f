"""The decode engine end to end on the CPU: greedy output equals transformers' `generate`, requests arriving
mid-run, chunked prefill and preemption, refusal, seeded sampling, traces and metrics."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import copy  # noqa: E402
import json  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from harli_train.cli import main  # noqa: E402
from harli_train.engine import (  # noqa: E402
    DecodeEngine,
    EngineConfig,
    EngineError,
    LengthDist,
    RequestRefused,
    SamplingParams,
    TraceError,
    generate_text,
    poisson_trace,
    rate_profile_trace,
    read_trace,
    serve_trace,
)
from harli_train.engine.kv_cache import KVCacheSpec, kv_cache_blocks  # noqa: E402
from harli_train.engine.step_work import PrefillPiece, StepPreview  # noqa: E402
from harli_train.engine.warm_up import WARMUP_SAMPLING  # noqa: E402
from harli_train.model import load_model, model_config  # noqa: E402

from .hf_models import save_tiny_llama  # noqa: E402

EOS = 2
VOCAB = 120
TRACES = os.path.join(os.path.dirname(__file__), "..", "recipes", "traces")


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A small random transformers Llama (weights large enough that greedy choices are clear-cut) and our
    model loaded from its saved directory."""
    path = tmp_path_factory.mktemp("hf_engine")
    hf = save_tiny_llama(
        path,
        std=0.15,
        vocab_size=VOCAB,
        intermediate_size=112,
        num_hidden_layers=2,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    return hf, load_model(str(path), torch.float32, "cpu")


def _prompts(n, lengths):
    g = torch.Generator().manual_seed(n)
    return [[1] + torch.randint(3, VOCAB, (length - 1,), generator=g).tolist() for length in lengths]


def _hf_greedy(hf, prompt, max_tokens):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _run_with_arrivals(engine, prompts, params, arrive_at):
    """Add prompts[i] before step arrive_at[i]; step until all are done."""
    seqs, step = [None] * len(prompts), 0
    while step <= max(arrive_at) or engine.has_unfinished():
        for i, at in enumerate(arrive_at):
            if at == step:
                seqs[i] = engine.add_request(prompts[i], params[i])
        engine.step()
        step += 1
    return seqs


@pytest.mark.parametrize(
    "kernels,cfg",
    [
        ("torch", dict(num_kv_blocks=128, max_num_batched_tokens=512)),
        # Prompts longer than the token budget are chunked; a cache of 14 blocks forces preemptions.
        ("torch", dict(num_kv_blocks=14, max_num_batched_tokens=16)),
        ("triton", dict(num_kv_blocks=40, max_num_batched_tokens=24)),
    ],
)
def test_greedy_matches_transformers_generate(hf_pair, kernels, cfg):
    hf, ours = hf_pair
    lengths = [3, 17, 30, 1, 9, 22] if kernels == "torch" else [3, 17, 30, 9]
    max_tokens = [12, 7, 12, 10, 12, 5] if kernels == "torch" else [6, 4, 6, 5]
    arrive_at = [0, 0, 2, 3, 5, 9] if kernels == "torch" else [0, 0, 2, 4]
    prompts = _prompts(len(lengths), lengths)
    config = EngineConfig(block_size=4, max_num_seqs=8, max_model_len=64, kernels=kernels, **cfg)
    if kernels == "triton" and torch.cuda.is_available():  # compiled kernels need the model on the GPU
        ours = copy.deepcopy(ours).to("cuda")
    engine = DecodeEngine(ours, config, num_sms=2)  # 2 SMs: few decode splits, quick under the interpreter
    params = [SamplingParams(max_tokens=m) for m in max_tokens]
    seqs = _run_with_arrivals(engine, prompts, params, arrive_at)
    for prompt, m, seq in zip(prompts, max_tokens, seqs, strict=True):
        assert seq.completion_token_ids == _hf_greedy(hf, prompt, m), f"{len(prompt)}-token prompt differs"
        assert seq.finish_reason == ("eos" if seq.token_ids[-1] == EOS else "length")
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    if cfg["num_kv_blocks"] == 14:
        assert sum(s.num_preemptions for s in seqs) > 0, "the small cache should have forced preemptions"
        assert any(r.num_tokens < max(lengths) for r in engine.metrics.steps if r.kind == "prefill")


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("num_kv_blocks", [128, 14])
def test_overlapped_decode_computes_what_the_plain_engine_does(hf_pair, num_kv_blocks, mixed):
    """Launching each decode step's successor before the step's tokens are read changes nothing drawn: the
    same tokens and finish reasons with greedy and seeded sampling, requests arriving mid-run (with mixed
    prefill, admitted and their chunks continued in mixed steps launched ahead), sequences ending by EOS while
    their next step is already launched, and (14 blocks) preemptions."""
    _, ours = hf_pair
    prompts = _prompts(6, [3, 17, 30, 1, 9, 22])
    params = [
        SamplingParams(max_tokens=12),
        SamplingParams(max_tokens=7),
        SamplingParams(max_tokens=12, temperature=1.2, top_p=0.9, seed=3),
        SamplingParams(max_tokens=10),
        SamplingParams(max_tokens=12, temperature=0.8, seed=9),
        SamplingParams(max_tokens=5),
    ]
    arrive_at = [0, 0, 2, 3, 5, 9]

    def run(overlap: bool, eos: set[int]):
        cfg = EngineConfig(
            block_size=4,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=8,
            max_model_len=64,
            max_num_batched_tokens=16,
            kernels="torch",
            overlap=overlap,
            mixed_prefill=mixed,
        )
        engine = DecodeEngine(ours, cfg)
        engine.scheduler.eos_ids = eos
        launch, engine.launches = engine.runner.launch, []

        def record(batch, partition, after=None):
            engine.launches.append((batch.kind, after.batch.kind if after is not None else None))
            return launch(batch, partition, after)

        engine.runner.launch = record
        seqs = _run_with_arrivals(engine, prompts, params, arrive_at)
        assert engine.block_manager.num_free == num_kv_blocks and engine._inflight is None
        engine.block_manager.check([])
        return engine, [(s.token_ids, s.finish_reason) for s in seqs]

    _, first = run(False, {EOS})
    # Make tokens the plain run draws mid-sequence end tokens, so that several sequences end by EOS.
    middles = [t for ids, _ in first for t in ids[len(ids) - 4 : -1]]
    eos = {EOS, max(set(middles), key=middles.count)}
    plain_engine, plain = run(False, eos)
    engine, overlapped = run(True, eos)
    assert overlapped == plain
    assert sum(reason == "eos" for _, reason in plain) >= 2
    assert engine.num_launched_ahead > 5 and plain_engine.num_launched_ahead == 0
    # Mixed prefill: prompts admitted, and chunks continued, in mixed steps launched ahead of mixed steps.
    assert (("mixed", "decode") in engine.launches) == mixed
    assert (("mixed", "mixed") in engine.launches) == mixed
    decode_steps = [s for s in engine.metrics.steps if s.kind == "decode"]
    assert len(decode_steps) >= len([s for s in plain_engine.metrics.steps if s.kind == "decode"])


def test_overlapped_engine_aborts_and_shrinks_with_a_step_launched_ahead(hf_pair, monkeypatch):
    _, ours = hf_pair
    cfg = EngineConfig(
        block_size=4, num_kv_blocks=32, max_num_seqs=4, max_model_len=64, kernels="torch", overlap=True
    )
    engine = DecodeEngine(ours, cfg)
    for p in _prompts(11, [5, 9]):
        engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True))
    for _ in range(3):  # a prefill, then decode steps, each leaving the next one launched
        engine.step()
    assert engine._inflight is not None and engine.num_launched_ahead >= 1
    assert not engine.shrink_kv_blocks(2)  # blocks in use by running sequences: refused, nothing changed
    assert engine._inflight is not None
    assert engine.abort_all() == 2 and engine._inflight is None and not engine.has_unfinished()
    assert engine.block_manager.num_free == 32 and engine.shrink_kv_blocks(16)
    assert engine.step().kind == "idle"
    # A step in flight whose wait fails (a device error): the requests are dropped all the same.
    for p in _prompts(12, [5, 9]):
        engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True))
    for _ in range(2):
        engine.step()
    assert engine._inflight is not None

    def fail(step):
        raise RuntimeError("device error")

    monkeypatch.setattr(type(engine._inflight), "wait", fail)
    with pytest.raises(RuntimeError, match="device error"):
        engine.abort_all()
    assert engine._inflight is None and not engine.has_unfinished() and engine.block_manager.num_free == 16


def test_request_that_can_never_fit_is_refused_others_continue(hf_pair):
    hf, ours = hf_pair
    engine = DecodeEngine(
        ours, EngineConfig(block_size=4, num_kv_blocks=10, max_num_seqs=4, max_model_len=64, kernels="torch")
    )
    prompts = _prompts(3, [5, 8])
    a = engine.add_request(prompts[0], SamplingParams(max_tokens=6))
    first = engine.step()
    assert first.gpu_s is None and first.forward_launch_s is None  # no stream to time on a CPU
    with pytest.raises(RequestRefused, match=r"needs 11 KV blocks .* the whole cache has 10"):
        engine.add_request(_prompts(4, [30])[0], SamplingParams(max_tokens=15))
    with pytest.raises(RequestRefused, match="exceeds max_model_len 64"):
        engine.add_request(_prompts(5, [60])[0], SamplingParams(max_tokens=10))
    b = engine.add_request(prompts[1], SamplingParams(max_tokens=6))
    engine.run_until_done()
    assert a.completion_token_ids == _hf_greedy(hf, prompts[0], 6)
    assert b.completion_token_ids == _hf_greedy(hf, prompts[1], 6)
    summary = engine.metrics.summary()
    assert summary["requests"] == 2 and summary["refused"] == 2
    out = engine.generate([prompts[0], _prompts(4, [30])[0]], SamplingParams(max_tokens=15))
    assert out[1].finish_reason == "refused" and "KV blocks" in out[1].error
    assert out[0].finish_reason in ("eos", "length") and out[0].num_completion_tokens > 0


def test_seeded_sampling_is_reproducible_and_batch_invariant(hf_pair):
    _, ours = hf_pair
    cfg = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_model_len=64, kernels="torch")
    prompts = _prompts(6, [4, 11, 7])
    hot = SamplingParams(max_tokens=10, temperature=1.5, top_p=0.95, seed=123, ignore_eos=True)
    alone = DecodeEngine(ours, cfg).generate([prompts[0]], hot)[0].completion_token_ids
    mates = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=8, temperature=0.7, seed=5)]
    batched = DecodeEngine(ours, cfg).generate(prompts, [hot, *mates])
    assert batched[0].completion_token_ids == alone
    other_seed = DecodeEngine(ours, cfg).generate(
        [prompts[0]], SamplingParams(max_tokens=10, temperature=1.5, top_p=0.95, seed=124, ignore_eos=True)
    )[0]
    assert other_seed.completion_token_ids != alone
    # A nucleus this small keeps only the top token: sampling degenerates to greedy.
    narrow_p = SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6)
    narrow = DecodeEngine(ours, cfg).generate(prompts, narrow_p)
    greedy = DecodeEngine(ours, cfg).generate(prompts, SamplingParams(max_tokens=8))
    assert [s.token_ids for s in narrow] == [s.token_ids for s in greedy]


def test_top_k_stop_tokens_and_aborting_one_request(hf_pair):
    """top_k=1 is greedy whatever the temperature; a stop token ends a request (kept, finish_reason 'stop');
    aborting one request frees its blocks at once and records it, the others go on unchanged."""
    import torch.nn.functional as F

    from harli_train.engine.sampler import Sampler, SamplingBatch

    _, ours = hf_pair
    cfg = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_model_len=64, kernels="torch")
    prompts = _prompts(21, [5, 9, 7])
    greedy = DecodeEngine(ours, cfg).generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    hot_k1 = SamplingParams(max_tokens=8, temperature=5.0, top_k=1, seed=1, ignore_eos=True)
    assert [s.token_ids for s in DecodeEngine(ours, cfg).generate(prompts, hot_k1)] == [
        s.token_ids for s in greedy
    ]
    # The sampler's cut against a direct one: each row keeps its own k most likely tokens.
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    ks = torch.tensor([1, 5, 0])
    probs = Sampler._top_k(F.softmax(logits, -1), ks, 5)
    assert (probs[0] > 0).sum() == 1 and (probs[1] > 0).sum() == 5 and (probs[2] > 0).sum() == 50
    assert set(probs[1].nonzero().flatten().tolist()) == set(logits[1].topk(5).indices.tolist())
    batch = SamplingBatch(
        torch.full((3,), 1.0), torch.ones(3), torch.arange(3), torch.zeros(3, dtype=torch.int64), False, ks, 5
    )
    drawn = Sampler()(logits, batch)
    assert drawn[0] == logits[0].argmax() and drawn[1] in logits[1].topk(5).indices
    # Every k of a bucket, and a k above the last bucket (a full sort), cuts exactly its own k.
    wide = F.softmax(torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)), -1)
    for k_max in (64, 1024, 2500):
        ks = torch.tensor([1, 63, k_max, 0])
        kept = (Sampler._top_k(wide, ks, k_max) > 0).sum(-1).tolist()
        assert kept == [1, 63, k_max, 3000]
    # A stop token: the third token the greedy run drew for the first prompt.
    stop = greedy[0].completion_token_ids[2]
    stopped = DecodeEngine(ours, cfg).generate(
        [prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(stop,))
    )[0]
    first = greedy[0].completion_token_ids.index(stop)
    assert (
        stopped.finish_reason == "stop"
        and stopped.completion_token_ids == greedy[0].completion_token_ids[: first + 1]
    )
    # Abort one of three mid-run.
    engine = DecodeEngine(ours, cfg)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
    for _ in range(3):
        engine.step()
    free_before = engine.block_manager.num_free
    assert engine.abort(seqs[1]) and not engine.abort(seqs[1])
    assert seqs[1].finish_reason == "aborted" and engine.block_manager.num_free > free_before
    engine.run_until_done()
    assert [seqs[0].token_ids, seqs[2].token_ids] == [greedy[0].token_ids, greedy[2].token_ids]
    (record,) = [r for r in engine.metrics.requests if r.finish_reason == "aborted"]
    assert 0 < record.output_tokens < 8
    with pytest.raises(EngineError, match="top_k"):
        SamplingParams(top_k=-1)


def test_step_metrics_and_summary(hf_pair):
    _, ours = hf_pair
    engine = DecodeEngine(
        ours, EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_model_len=64, kernels="torch")
    )
    engine.add_partition("half", None, num_sms=66)
    for p in _prompts(7, [5, 9, 13]):
        engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
    n = 0
    while engine.has_unfinished():
        engine.step("half" if n % 2 else "default")
        n += 1
    steps = engine.metrics.steps
    assert [s.partition for s in steps[:3]] == ["default", "half", "default"]
    assert steps[0].kind == "prefill" and steps[0].num_tokens == 27 and steps[0].kv_tokens == 27
    decode = [s for s in steps if s.kind == "decode"]
    assert len(decode) == 5 and decode[0].num_seqs == 3 and decode[0].kv_tokens == 27 + 3
    summary = engine.metrics.summary()
    assert summary["requests"] == 3 and summary["output_tokens"] == 18
    assert summary["tpot_ms"]["count"] == 3 and summary["ttft_ms"]["p50"] > 0
    assert summary["decode_batch"]["p50"] == 3.0
    engine.add_request(_prompts(1, [3])[0], SamplingParams(max_tokens=2))
    with pytest.raises(EngineError, match="unknown partition 'nope'"):
        engine.step("nope")


def test_peek_abort_and_synthetic_decode(hf_pair):
    _, ours = hf_pair
    engine = DecodeEngine(
        ours, EngineConfig(block_size=4, num_kv_blocks=32, max_num_seqs=4, max_model_len=64, kernels="torch")
    )
    assert engine.peek() == StepPreview()
    assert engine.peek().kind == "idle"
    for p in _prompts(9, [5, 9]):
        engine.add_request(p, SamplingParams(max_tokens=8))
    preview = engine.peek()
    assert preview.kind == "prefill" and preview.prefill_tokens == 14
    assert preview.pieces == (PrefillPiece(5, 0, 0), PrefillPiece(9, 0, 0))
    assert preview.decode_after() == (2, 16)  # both prompts finish in this prefill, a token each
    assert preview.decode_after(budget=10) == (1, 6)  # the second prompt is cut: 4 of 9 tokens
    engine.step()
    assert engine.peek() == StepPreview(2, 16)
    engine.synthetic_decode(3, 20)  # a profiling step: no request, no metrics, no blocks change
    engine.synthetic_mixed(2, 20, prefill_tokens=7, prefill_context=5)  # the same, a mixed step
    with pytest.raises(EngineError, match="exceed max_model_len"):
        engine.synthetic_mixed(1, 20, prefill_tokens=60, prefill_context=10)
    assert len(engine.metrics.steps) == 1 and engine.block_manager.num_free == 32 - 2 - 3
    assert engine.abort_all() == 2 and not engine.has_unfinished()
    assert engine.block_manager.num_free == 32 and engine.peek().kind == "idle"


def test_mixed_steps_are_stall_free_and_compute_what_prefill_first_does(hf_pair, kernels="torch"):
    """Prefill chunks ride in decode steps: while a long prompt is prefilled over many steps (within each
    step's budget), every decoding request still gets a token per step, and every request draws exactly the
    tokens of a prefill-first engine (greedy and seeded) and of transformers (greedy)."""
    hf, ours = hf_pair
    prompts = _prompts(12, [6, 40, 3, 25])
    params = [
        SamplingParams(max_tokens=14),
        SamplingParams(max_tokens=6),
        SamplingParams(max_tokens=10, temperature=1.1, top_p=0.9, seed=4),
        SamplingParams(max_tokens=8),
    ]

    def run(mixed: bool, budget: int | None):
        cfg = EngineConfig(
            block_size=4,
            num_kv_blocks=64,
            max_num_seqs=8,
            max_model_len=64,
            max_num_batched_tokens=32,
            prefill_chunk_tokens=5,
            mixed_prefill=mixed,
            kernels=kernels,
        )
        engine, seqs, kinds = DecodeEngine(ours, cfg), [], []
        assert (engine.runner.decode_forward is not None) == (kernels == "triton")
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            seqs.append(engine.add_request(prompt, p))
            for _ in range(2 if i == 0 else 1):  # the first request decodes before the others arrive
                decoding = len(engine.scheduler._decoding())
                result = engine.step(prefill_tokens=budget)
                kinds.append((decoding, result))
        while engine.has_unfinished():
            decoding = len(engine.scheduler._decoding())
            kinds.append((decoding, engine.step(prefill_tokens=budget)))
        return seqs, kinds

    plain, plain_steps = run(False, None)
    assert any(r.kind == "prefill" and n for n, r in plain_steps), "prefill-first stalls decoding requests"
    for budget in (None, 3):
        seqs, steps = run(True, budget)
        assert [s.token_ids for s in seqs] == [s.token_ids for s in plain]
        cap = 5 if budget is None else budget
        for decoding, r in steps:
            assert r.num_decode == decoding, "a decoding request waited out a step"
            assert r.kind != "prefill" or decoding == 0
            assert r.prefill_tokens <= (cap if decoding else 32)
        assert sum(r.kind == "mixed" for _, r in steps) >= 40 // cap, "the long prompt is chunked over steps"
        # Every drawn token was timed: one interval per token after the first.
        assert all(len(s.token_times) == s.num_completion_tokens for s in seqs)
    for i in (0, 1, 3):
        assert seqs[i].completion_token_ids == _hf_greedy(hf, prompts[i], params[i].max_tokens)


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_mixed_steps_through_the_graphs_static_buffers_compute_what_eager_steps_do(hf_pair, kernels):
    """The padded static buffers mixed-step graphs read (tokens padded to a bucket, rows to max_num_seqs):
    run eagerly over them on the CPU, every step draws the tokens of the plain varlen path (greedy and
    seeded), including steps past the largest bucket, which stay eager. With the Triton kernels (as a
    GPU's graphs run) a mixed step runs the decode GEMV projections over every packed token and splits
    attention between the decode kernel (one-token rows) and the prefill kernel (chunks); the tokens then
    equal a prefill-first engine's too. Overlapped, with prompts arriving mid-run, mixed steps launched ahead
    take their decode rows' input ids from the tokens of the step in flight, in the static buffers too."""
    from harli_train.engine.mixed_graphs import MixedGraphs

    _, ours = hf_pair
    prompts = _prompts(13, [6, 40, 3, 25, 11])
    params = [
        SamplingParams(max_tokens=12),
        SamplingParams(max_tokens=5),
        SamplingParams(max_tokens=9, temperature=1.1, top_p=0.9, seed=4),
        SamplingParams(max_tokens=7),
        SamplingParams(max_tokens=6, temperature=0.7, seed=2),
    ]

    def run(static: bool, overlap: bool = False, arrive_at=(0, 0, 0, 0, 0)):
        cfg = EngineConfig(
            block_size=4,
            num_kv_blocks=64,
            max_num_seqs=6,
            max_model_len=64,
            max_num_batched_tokens=80,
            prefill_chunk_tokens=9,
            mixed_prefill=True,
            kernels=kernels,
            overlap=overlap,
        )
        engine = DecodeEngine(ours, cfg)
        if static:
            runner = engine.runner
            graphs = MixedGraphs(
                ours, runner.attn, cfg, torch.device("cpu"), decode_forward=runner.decode_forward
            )
            assert graphs.buckets == (16,) and graphs.max_rows == 6
            engine.runner.mixed_graphs = graphs
            replay, engine.fed = graphs.replay, []

            def record(*args, **kwargs):
                engine.fed.append(len(args) > 10 and args[10] is not None)
                return replay(*args, **kwargs)

            graphs.replay = record
        seqs = _run_with_arrivals(engine, prompts, params, list(arrive_at))
        return [s.token_ids for s in seqs], engine

    plain, _ = run(False)
    static, engine = run(True)
    assert static == plain
    arrivals = (0, 0, 6, 9, 14)
    late, _ = run(False, arrive_at=arrivals)
    ahead, overlapped = run(True, True, arrivals)
    assert ahead == late and overlapped.num_launched_ahead > 0 and any(overlapped.fed)
    assert any(s.kind == "mixed" and s.num_seqs > 1 for s in overlapped.metrics.steps)
    assert engine.runner.mixed_graphs.num_replays > 0  # the mixed steps went through the static buffers
    assert any(s.kind == "mixed" for s in engine.metrics.steps)
    assert (engine.runner.decode_forward is not None) == (kernels == "triton")
    if kernels == "triton":
        first = DecodeEngine(ours, EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=6,
                                                max_model_len=64, kernels=kernels))  # fmt: skip
        seqs = [first.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        first.run_until_done()
        assert [s.token_ids for s in seqs] == static


def test_close_releases_buffers_and_later_steps_are_refused(hf_pair):
    _, ours = hf_pair
    engine = DecodeEngine(
        ours, EngineConfig(block_size=4, num_kv_blocks=32, max_num_seqs=4, max_model_len=64, kernels="torch")
    )
    engine.add_request(_prompts(3, [5])[0], SamplingParams(max_tokens=4))
    engine.step()
    engine.close()
    engine.close()  # idempotent
    assert not engine.runner.partitions and not engine.runner._token_host
    with pytest.raises(EngineError, match="closed"):
        engine.step()


def test_warm_up_runs_prefill_shapes_and_leaves_the_engine_as_it_was(hf_pair):
    _, ours = hf_pair
    engine = DecodeEngine(
        ours, EngineConfig(block_size=4, num_kv_blocks=40, max_num_seqs=8, max_model_len=64, kernels="torch")
    )
    asked = []
    add = engine.add_request
    engine.add_request = lambda prompt, params, **kw: asked.append(params) or add(prompt, params, **kw)
    # Lengths are capped at max_model_len - 2 (100 -> 62): three alone, then the three packed.
    assert engine.warm_up((1, 17, 100)) == 3 + 3
    # The sampler's paths in turn (greedy, temperature, top-k per bucket, top-p): the packed step samples in
    # several.
    assert asked == [WARMUP_SAMPLING[i % len(WARMUP_SAMPLING)] for i in range(6)]
    assert {p.greedy for p in asked[3:]} == {True, False} and any(p.top_k for p in asked)
    assert any(p.top_p < 1 for p in asked)
    del engine.add_request
    assert not engine.has_unfinished() and engine.block_manager.num_free == 40
    assert engine.metrics.steps == [] and engine.metrics.summary()["requests"] == 0
    engine.add_request(_prompts(3, [5])[0], SamplingParams(max_tokens=1))
    with pytest.raises(EngineError, match="idle engine"):
        engine.warm_up()


def test_engine_refuses_a_model_with_an_adapter():
    model = load_model("tiny", torch.float32, "cpu")
    model.add_lora(rank=4, alpha=8, dropout=0.0)
    with pytest.raises(EngineError, match="serves the base model"):
        DecodeEngine(model, EngineConfig(num_kv_blocks=8, kernels="torch"))


def test_traces_and_synthetic_load(tmp_path):
    for name in ("steady", "bursty", "varying"):
        reqs = read_trace(os.path.join(TRACES, f"{name}.jsonl"))
        assert len(reqs) >= 20 and all(r.output_len >= 1 and (r.prompt_len or r.prompt) for r in reqs)
        assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    a = poisson_trace(5.0, 20.0, "lognormal:256:0.5:16:1024", "uniform:8:64", seed=3)
    assert a == poisson_trace(5.0, 20.0, "lognormal:256:0.5:16:1024", "uniform:8:64", seed=3)
    assert 60 <= len(a) <= 140 and all(16 <= r.prompt_len <= 1024 and 8 <= r.output_len <= 64 for r in a)
    bursty = poisson_trace(1.0, 40.0, 32, 8, seed=3, burst_rate=20.0, burst_every_s=10.0, burst_len_s=2.0)
    in_burst = sum((r.arrival_s % 10.0) < 2.0 for r in bursty)
    assert in_burst > 2 * (len(bursty) - in_burst)
    ramp = rate_profile_trace([(0, 1.0), (10, 1.0), (20, 10.0), (30, 10.0)], 32, 8, seed=1)
    counts = [sum(lo <= r.arrival_s < lo + 10 for r in ramp) for lo in (0, 10, 20)]
    assert counts[0] < counts[1] < counts[2] and 60 <= counts[2] <= 140 and ramp[-1].arrival_s < 30
    with pytest.raises(TraceError, match="time order"):
        rate_profile_trace([(5, 1.0), (0, 1.0)], 32, 8)


def test_shipped_traces_regenerate_byte_for_byte(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_traces", os.path.join(TRACES, "make_traces.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "HERE", tmp_path)
    module.main()
    for name in ("steady", "bursty", "varying"):
        with open(os.path.join(TRACES, f"{name}.jsonl")) as shipped:
            assert (tmp_path / f"{name}.jsonl").read_text() == shipped.read(), name
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_len": 4, "output_len": 2}\n{"arrival_s": 1, "output_len": 2}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2: give exactly one of 'prompt'"):
        read_trace(bad)
    with pytest.raises(TraceError, match="uniform:LOW:HIGH"):
        LengthDist.parse("gauss:3")


def test_a_load_request_past_the_model_context_is_refused_not_served(tmp_path):
    # A 100000-token prompt once sized the engine (and its prefill) past the machine's memory. The engine is
    # capped at tiny's 2048-token context: that request is refused and recorded, the others are served.
    trace = tmp_path / "t.jsonl"
    lines = [
        {"arrival_s": 0.0, "prompt_len": 12, "output_len": 3},
        {"arrival_s": 0.0, "prompt_len": 100000, "output_len": 4, "id": "huge"},
        {"arrival_s": 0.01, "prompt_len": 2046, "output_len": 3, "id": "just-past"},
        {"arrival_s": 0.02, "prompt": "hello", "output_len": 3},
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    summary = serve_trace("tiny", tmp_path / "out", trace, device="cpu")
    assert summary["requests"] == 2 and summary["refused"] == 2
    assert summary["setup"]["engine"]["max_model_len"] == 2048
    recs = {r["request_id"]: r for r in map(json.loads, (tmp_path / "out" / "requests.jsonl").open())}
    for rid, total in (("huge", 100004), ("just-past", 2049)):
        assert recs[rid]["finish_reason"] == "refused" and recs[rid]["output_tokens"] == 0
        assert f"= {total} exceeds the model's context of 2048 tokens" in recs[rid]["error"]
    assert recs["0"]["output_tokens"] == 3 and recs["3"]["output_tokens"] == 3
    # A synthetic load past the context: every request refused, none served, nothing sized for them.
    synthetic = serve_trace(
        "tiny", tmp_path / "syn", rate=40.0, duration_s=0.2, prompt_len=5000, output_len=4
    )
    assert synthetic["refused"] >= 1 and synthetic["requests"] == 0
    assert synthetic["setup"]["engine"]["max_model_len"] == 2048


def test_a_trace_that_is_not_utf8_names_the_file_and_line(tmp_path):
    trace = tmp_path / "latin1.jsonl"
    trace.write_bytes(
        b'{"arrival_s": 0, "prompt_len": 4, "output_len": 2}\n{"arrival_s": 1, "prompt": "caf\xe9", "output_len": 2}\n'
    )
    with pytest.raises(TraceError) as info:
        read_trace(trace)
    assert str(info.value).startswith(f"{trace}:2: not UTF-8 text (invalid continuation byte at byte ")
    result = CliRunner().invoke(main, ["serve-trace", "--trace", str(trace), "--out", str(tmp_path / "out")])
    lines = [line for line in result.output.splitlines() if not line.startswith("harli-train: ")]  # logs
    assert result.exit_code == 2 and lines == [f"Error: {info.value}"], result.output
    trace.write_bytes(b'\xef\xbb\xbf{"arrival_s": 0, "prompt": "caf\xc3\xa9", "output_len": 2}\r\n')
    assert read_trace(trace)[0].prompt == "caf\u00e9"  # a BOM and CRLF line ends are fine


def test_serve_trace_and_generate_text_on_tiny(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [
        {"arrival_s": 0.0, "prompt": "hello", "output_len": 5},
        {"arrival_s": 0.01, "prompt_len": 20, "output_len": 4, "id": "x"},
        {"arrival_s": 0.02, "prompt_len": 300, "output_len": 8},
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cfg = EngineConfig(block_size=16, num_kv_blocks=12, max_num_seqs=4, max_model_len=512, kernels="torch")
    summary = serve_trace("tiny", tmp_path / "out", trace, device="cpu", config=cfg)
    assert summary["requests"] == 2 and summary["refused"] == 1 and summary["output_tokens"] == 9
    recs = [json.loads(x) for x in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    assert {r["request_id"] for r in recs} == {"0", "x", "2"}
    assert (tmp_path / "out" / "steps.jsonl").read_text().count("\n") == len(
        [1 for _ in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    )
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["setup"]["kv_blocks"] == 12
    texts = generate_text(
        "tiny",
        ["hi", "a longer prompt"],
        max_tokens=6,
        device="cpu",
        config=EngineConfig(num_kv_blocks=16, max_model_len=128, kernels="torch"),
    )
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)


def test_kv_cache_gib_sizes_the_cache_of_serve_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_len": 8, "output_len": 3}\n')
    out = tmp_path / "out"
    args = ["serve-trace", "--model", "tiny", "--device", "cpu", "--trace", str(trace), "--out", str(out)]
    result = CliRunner().invoke(main, [*args, "--kv-cache-gib", "0.0005"])
    assert result.exit_code == 0, result.output
    spec = KVCacheSpec.for_model(model_config("tiny"), 16, torch.float32)
    setup = json.loads((out / "summary.json").read_text())["setup"]
    assert setup["kv_blocks"] == int(0.0005 * 2**30) // spec.bytes_per_block
    result = CliRunner().invoke(main, [*args, "--kv-cache-gib", "0"])
    assert result.exit_code == 2 and "--kv-cache-gib" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_fixed_kv_cache_size_is_honoured_and_one_past_free_memory_is_refused():
    model = load_model("tiny", torch.bfloat16, "cuda")
    spec = KVCacheSpec.for_model(model.config, 16, torch.bfloat16)
    cfg = EngineConfig(max_num_seqs=64, max_model_len=1024, kv_cache_bytes=200 * spec.bytes_per_block)
    assert kv_cache_blocks(model, cfg, spec) == 200  # not the 90 % of the GPU the default rule gives
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(EngineError, match=r"a KV cache of [0-9.]+ GiB does not fit: [0-9.]+ GiB are free"):
        kv_cache_blocks(model, replace(cfg, kv_cache_bytes=free + (1 << 30)), spec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_on_two_partitions_match_transformers(hf_pair, tmp_path):
    hf, _ = hf_pair
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), torch.float32, "cuda")  # fp32: the kernels' dots run in IEEE fp32
    cfg = EngineConfig(
        block_size=4, num_kv_blocks=128, max_num_seqs=8, max_model_len=64, graph_batch_sizes=(1, 2, 4, 8)
    )
    engine = DecodeEngine(ours, cfg)
    assert engine.runner.use_graphs
    engine.add_partition("side", torch.cuda.Stream(), num_sms=16)
    prompts = _prompts(8, [3, 17, 30, 1, 9])
    seqs = [engine.add_request(p, SamplingParams(max_tokens=10)) for p in prompts]
    step = 0
    while engine.has_unfinished():
        result = engine.step(
            "side" if step % 2 else "default"
        )  # alternate partitions, as the controller would
        assert result.gpu_s is not None and 0 < result.gpu_s  # the step's span on its stream
        assert 0 < result.forward_launch_s <= result.launch_s  # the forward's part of the launch
        step += 1
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.completion_token_ids == _hf_greedy(hf, prompt, 10)
    assert engine.overlap and engine.num_launched_ahead > 0, "decode steps were launched ahead"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_mixed_step_graphs_on_two_partitions_match_eager_steps(hf_pair, tmp_path):
    hf, _ = hf_pair
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), torch.float32, "cuda")
    prompts = _prompts(8, [3, 40, 30, 1, 9, 22])
    params = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=8, temperature=0.9, seed=3)] * 3

    def run(graphs: bool):
        cfg = EngineConfig(
            block_size=4,
            num_kv_blocks=128,
            max_num_seqs=8,
            max_model_len=64,
            graph_batch_sizes=(1, 2, 4, 8),
            mixed_prefill=True,
            prefill_chunk_tokens=12,
        )
        engine = DecodeEngine(ours, cfg)
        if not graphs:
            engine.runner.mixed_graphs = None  # every varlen step eager (and "side" captures decode only)
        engine.add_partition("side", torch.cuda.Stream(), num_sms=16)
        seqs, step = [], 0
        for p, sp in zip(prompts, params, strict=True):
            seqs.append(engine.add_request(p, sp))
            engine.step("side" if step % 2 else "default")  # alternate partitions, as the controller would
            step += 1
        while engine.has_unfinished():
            engine.step("side" if step % 2 else "default")
            step += 1
        return engine, [s.token_ids for s in seqs]

    engine, with_graphs = run(True)
    _, eager = run(False)
    assert with_graphs == eager
    assert engine.runner.mixed_graphs.num_replays > 0 and any(s.kind == "mixed" for s in engine.metrics.steps)
    for prompt, sp, ids in zip(prompts, params, with_graphs, strict=True):
        if sp.temperature == 0:
            assert ids[len(prompt) :] == _hf_greedy(hf, prompt, sp.max_tokens)


def test_a_successor_the_mixed_graphs_do_not_take_is_not_launched_ahead(hf_pair):
    """Where mixed graphs run the varlen steps, a successor whose packed tokens exceed their largest bucket
    would launch eagerly (tens of milliseconds of host time on a GPU for a long prompt), holding back the
    tokens of the step in flight: it is not launched ahead and nothing is scheduled for it (the prompt still
    waits, no block is taken); the step in flight completes alone and the prompt's step is scheduled after
    it. Successors the graphs take are launched ahead as before, and the tokens are those of an engine
    without graphs, which launches every successor ahead."""
    from harli_train.engine.mixed_graphs import MixedGraphs

    _, ours = hf_pair
    cfg = EngineConfig(
        block_size=4,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_model_len=64,
        prefill_chunk_tokens=9,
        kernels="torch",
        mixed_prefill=True,
    )

    def run(graphs: bool):
        engine = DecodeEngine(ours, cfg)
        if graphs:  # the CPU's static buffers of the GPU's mixed graphs: one bucket, 16 packed tokens
            runner = engine.runner
            runner.mixed_graphs = MixedGraphs(ours, runner.attn, cfg, torch.device("cpu"))
            assert runner.mixed_graphs.max_tokens == 16
        launched = []  # (packed tokens, launched ahead) of every step
        launch = engine.runner.launch

        def record(batch, partition, after=None):
            launched.append((sum(batch.num_tokens), after is not None))
            return launch(batch, partition, after)

        engine.runner.launch = record
        first, second, third = _prompts(21, [5, 30, 6])
        a = engine.add_request(first, SamplingParams(max_tokens=8))
        assert engine.step().kind == "prefill" and not engine.in_flight
        assert engine.step(ahead=True).kind == "decode" and engine.in_flight == "decode"
        b = engine.add_request(second, SamplingParams(max_tokens=6))
        free = engine.block_manager.num_free
        step = engine.step(prefill_tokens=30, ahead=True)  # its successor: 1 decode row + 30 prompt tokens
        assert step.kind == "decode"
        if graphs:
            assert not engine.in_flight and b in engine.scheduler.waiting
            assert engine.block_manager.num_free == free  # not even the decode row's next block
        else:
            assert engine.in_flight == "mixed" and b not in engine.scheduler.waiting
        c = engine.add_request(third, SamplingParams(max_tokens=6))
        while engine.has_unfinished():
            engine.step(prefill_tokens=8, ahead=True)
        return [s.token_ids for s in (a, b, c)], launched

    eager, every = run(False)
    graphed, launched = run(True)
    assert graphed == eager
    assert any(tokens > 16 for tokens, ahead in every if ahead)
    assert all(tokens <= 16 for tokens, ahead in launched if ahead)
    assert any(ahead for _, ahead in launched)


def test_a_prefill_budget_caps_the_step_launched_ahead_as_well(hf_pair):
    """With mixed prefill a step's successor launched ahead takes the call's prefill budget: none while a
    drain holds prefill back (budget 0), a chunk of the budget once it is given, the rest of the prompt
    continuing in the steps after."""
    _, ours = hf_pair
    cfg = EngineConfig(
        block_size=4, num_kv_blocks=64, max_num_seqs=4, max_model_len=64, kernels="torch", mixed_prefill=True
    )
    engine = DecodeEngine(ours, cfg)
    first, second = _prompts(21, [5, 9])
    a = engine.add_request(first, SamplingParams(max_tokens=8))
    assert engine.step().kind == "prefill" and not engine.in_flight
    b = engine.add_request(second, SamplingParams(max_tokens=8))
    step = engine.step(prefill_tokens=0, ahead=True)  # a decodes, b waits: so does the step launched ahead
    assert step.kind == "decode" and engine.in_flight == "decode"
    step = engine.step(prefill_tokens=3, ahead=True)  # completes that one; its successor takes 3 of b's 9
    assert step.kind == "decode" and engine.in_flight == "mixed"
    preview = engine.peek()  # the step after the one in flight: b's chunk goes on past its first 3 tokens
    assert preview.decode_seqs == 1 and [(p.tokens, p.context) for p in preview.pieces] == [(6, 3)]
    step = engine.step(prefill_tokens=4, ahead=True)
    assert (step.kind, step.prefill_tokens) == ("mixed", 3) and b.num_computed == 3
    step = engine.step(prefill_tokens=4, ahead=True)
    assert (step.kind, step.prefill_tokens) == ("mixed", 4) and b.num_computed == 7
    engine.run_until_done()
    assert a.num_completion_tokens == b.num_completion_tokens == 8


@pytest.mark.parametrize("max_rows,sizes", [(8, [1]), (16, [1]), (17, [1, 17]), (64, [1, 64])])
def test_the_fed_tokens_gather_is_launched_on_both_sides_of_torchs_kernel_choice(
    monkeypatch, max_rows, sizes
):
    """A step launched ahead gathers its fed tokens with index_select, whose kernel torch picks by the count
    of indices (<= 16 or more); capture launches both so that no served step loads one (a stall)."""
    from harli_train.engine import graph_capture

    seen, real = [], torch.index_select

    def record(src, dim, index, out=None):
        seen.append((index.numel(), index.dtype, src.dtype))
        return real(src, dim, index, out=out)

    monkeypatch.setattr(torch, "index_select", record)
    graph_capture.load_gather_kernels(torch.device("cpu"), max_rows)
    assert [n for n, _, _ in seen] == sizes
    assert all(d == torch.int64 and s == torch.int64 for _, d, s in seen)  # the sampler's token dtype
