"""What adapters add to a decode step, for the latency predictor: the fit of LoRACost from profile samples,
the predictor's LoRA term (and that adapter samples leave the base model's fit alone), the engine's preview
of a step's distinct adapters, the controller giving a step on adapters the share it needs, and a profile of
an engine with adapter slots."""

import pytest

from harli_train.colocate.controller import Controller
from harli_train.colocate.lora_cost import LoRACost
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.profile_grid import run_profile_grid
from harli_train.colocate.sm import SMLadder
from harli_train.engine import SamplingParams

from .test_lora_serving import PROMPTS, _catalog, models  # noqa: F401  (the fixture)

F = {32: 4e-4, 64: 2e-4}  # one adapter's cost per share
P = {32: 1e-4, 64: 5e-5}  # each further adapter


def base_s(sms, batch, kv):
    return 1e-3 * (1 + 64 / sms) + 2e-6 * kv + 1e-5 * batch * 32 / sms


def samples():
    out = []
    for sms in (32, 64):
        for batch in (1, 8, 32):
            for kv in (256, 1024):
                for corun in (False, True):
                    t = base_s(sms, batch, batch * kv) * (1.2 if corun else 1.0)
                    out.append(
                        dict(batch=batch, kv_tokens=batch * kv, infer_sms=sms, corun=corun, latency_s=t)
                    )
        for n in (1, 2, 4):  # solo steps of batch 8 at KV 256 on n adapters
            t = base_s(sms, 8, 8 * 256) + F[sms] + P[sms] * (n - 1)
            out.append(
                dict(batch=8, kv_tokens=8 * 256, infer_sms=sms, corun=False, latency_s=t, lora_slots=n)
            )
    return out


def test_lora_cost_fits_the_fixed_and_per_adapter_parts_per_share_and_interpolates_between():
    cost = LoRACost.fit(samples())
    for sms in (32, 64):
        f, p = cost.params[sms]
        assert f == pytest.approx(F[sms], rel=1e-6) and p == pytest.approx(P[sms], rel=1e-6)
        assert cost.seconds(sms, 0) == 0.0
        assert cost.seconds(sms, 3) == pytest.approx(F[sms] + 2 * P[sms], rel=1e-6)
    assert cost.seconds(64, 1) < cost.seconds(48, 1) < cost.seconds(32, 1)  # in 1/s between shares
    assert cost.seconds(16, 1) == pytest.approx(2 * F[32], rel=1e-6)  # below the profile: in proportion
    assert cost.seconds(132, 1) == pytest.approx(F[64], rel=1e-6)
    assert LoRACost.from_dict(cost.to_dict()) == cost
    assert LoRACost.fit([r for r in samples() if not r.get("lora_slots")]) is None


def test_the_predictor_adds_the_adapters_and_fits_the_base_without_their_samples():
    with_lora = LatencyPredictor.fit(samples(), 132, 1.0)
    without = LatencyPredictor.fit([r for r in samples() if not r.get("lora_slots")], 132, 1.0)
    assert with_lora.share_params == without.share_params and without.lora is None
    for corun in (False, True):
        assert with_lora.predict(8, 2048, 64, corun, raw=True) == without.predict(
            8, 2048, 64, corun, raw=True
        )
    solo, solo_on_two = (with_lora.predict(8, 2048, 64, False, raw=True, lora_slots=n) for n in (0, 2))
    assert solo_on_two == pytest.approx(solo + F[64] + P[64], rel=1e-3)
    co, co_on_two = (with_lora.predict(8, 2048, 64, True, raw=True, lora_slots=n) for n in (0, 2))
    assert co_on_two / solo_on_two == pytest.approx(co / solo, rel=1e-9)  # the slowdown covers the adapters
    assert without.predict(8, 2048, 64, lora_slots=2) == without.predict(8, 2048, 64)  # nothing to add
    again = LatencyPredictor.from_dict(with_lora.to_dict())
    assert again.predict(8, 2048, 64, lora_slots=3) == with_lora.predict(8, 2048, 64, lora_slots=3)


def test_the_controller_gives_a_step_on_adapters_the_share_it_needs():
    ladder = SMLadder.cpu_standin(132, 16)
    pred = LatencyPredictor.fit(samples(), 132, 1.0)
    budget = pred.predict(8, 2048, 32, True) * 1.02  # the base step just fits 32 SMs
    base = Controller(pred, ladder, budget, 0.0, hysteresis_steps=1).target(8, 2048)
    lora = Controller(pred, ladder, budget, 0.0, hysteresis_steps=1).target(8, 2048, lora_slots=4)
    assert base[0].infer_sms == 32 < lora[0].infer_sms and lora[1] <= budget
    ctl = Controller(pred, ladder, budget, 0.0, hysteresis_steps=1)
    d = ctl.decide(8, 2048, lora_slots=4)
    assert d.partition is lora[0] and d.predicted_s == pytest.approx(lora[1])


def test_the_preview_counts_a_steps_distinct_adapters_and_the_profile_times_them(models):  # noqa: F811
    engine = _catalog(models).engine
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for prompt, slot in ((PROMPTS[0], 1), (PROMPTS[1], 1), (PROMPTS[2], 0)):
        engine.add_request(prompt, params, lora_slot=slot)
    while engine.peek().kind != "decode":
        engine.step()
    assert engine.peek().lora_slots == 1
    engine.add_request(PROMPTS[0], params, lora_slot=2)
    while engine.peek().kind != "decode" or engine.peek().decode_seqs < 4:
        engine.step()
    assert engine.peek().lora_slots == 2
    engine.run_until_done()
    assert engine.num_adapter_slots == 2
    ladder = SMLadder.cpu_standin(8, 4)
    from harli_train.colocate.engine_adapter import EngineAdapter

    adapter = EngineAdapter(engine, ladder.full)
    adapter.register(ladder.partitions)
    got = run_profile_grid(
        adapter.synthetic_decode,
        None,
        ladder,
        batches=(1, 2, 4),
        kv_lens=(8, 16),
        warmup=0,
        reps=1,
        lora_slots=(1, 2),
    )
    on_adapters = [r for r in got if r.get("lora_slots")]
    assert {(r["infer_sms"], r["lora_slots"], r["batch"]) for r in on_adapters} == {
        (s, n, 2) for s in ladder.shares for n in (1, 2)
    }
    assert all(r["latency_s"] > 0 and not r["corun"] for r in on_adapters)
    with pytest.raises(Exception, match="3 adapters asked of an engine with 2 slots"):
        engine.synthetic_decode(2, 8, lora_slots=3)


def _profiling_engine(models, tmp_path):  # noqa: F811
    """(engine with adapter slots, a CPU ladder of 8 SMs, its EngineAdapter with the rungs registered, a
    profile path, the profile key)."""
    from harli_train.colocate.engine_adapter import EngineAdapter
    from harli_train.colocate.profile import ProfileKey

    engine = _catalog(models).engine
    ladder = SMLadder.cpu_standin(8, 4)
    adapter = EngineAdapter(engine, ladder.full)
    adapter.register(ladder.partitions)
    return engine, ladder, adapter, tmp_path / "profile.json", ProfileKey.current("lora-test", sm_count=8)


def test_a_stored_profile_without_adapter_steps_gains_them_without_the_grid_timed_again(
    models,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """An engine with adapter slots over a profile made without them: only the adapter points are timed (the
    base step of each beside them, replacing the stored one); every other sample stays, and it is stored."""
    import harli_train.colocate.predictor_setup as setup
    from harli_train.colocate.profile import Profile, load_profile, save_profile

    engine, ladder, adapter, path, key = _profiling_engine(models, tmp_path)
    grid = dict(batches=(1, 2, 4), kv_lens=(8, 16), warmup=0, reps=1)
    plain = run_profile_grid(adapter.synthetic_decode, None, ladder, **grid)
    save_profile(path, Profile(key, plain, {"kv_bytes_per_token": 1.0}))
    monkeypatch.setattr(setup, "build_profile", lambda *a, **k: pytest.fail("the whole grid was timed"))
    predictor, profile = setup.build_predictor(adapter, ladder, "lora-test", None, 4, path=path, reps=1)
    on_adapters = [r for r in profile.samples if r.get("lora_slots")]
    assert {(r["infer_sms"], r["lora_slots"], r["batch"], r["kv_tokens"]) for r in on_adapters} == {
        (s, n, 2, 16) for s in ladder.shares for n in (1, 2)
    }
    point = lambda r: (r["infer_sms"], r["batch"], r["kv_tokens"], r["corun"])  # noqa: E731
    base = [r for r in profile.samples if not r.get("lora_slots")]
    assert sorted(map(point, base)) == sorted(map(point, plain))  # one base step per point, as before
    replaced = {(s, 2, 16, False) for s in ladder.shares}
    assert [r for r in base if point(r) not in replaced] == [r for r in plain if point(r) not in replaced]
    assert predictor.lora is not None and set(predictor.lora.params) == set(ladder.shares)
    stored = load_profile(path, key)
    assert stored.samples == profile.samples and stored.meta["adapter_steps"]["lora_slots"] == [1, 2]


G = {32: 6e-4, 64: 3e-4}  # one adapter in a mixed step: fixed part ...
Q = {32: 2e-5, 64: 1e-5}  # ... and per padded row
BUCKETS = (16, 32, 64, 128)


def mixed_samples():
    """Base mixed steps over the grid, and the middle batch's chunks again with every row on one adapter."""
    out = []
    for sms in (32, 64):
        for batch in (2, 8, 32):
            for n in (6, 24, 56, 100):
                rows = next(b for b in BUCKETS if b >= batch + n) if batch + n <= 128 else batch + n
                t = 1e-3 + 4e-5 * rows * 32 / sms + 1e-7 * batch * 256
                base = dict(batch=batch, kv_len=256, kv_tokens=batch * 256, infer_sms=sms, prefill_tokens=n,
                            prefill_context=0, attn_pairs=n * (n + 1) // 2)  # fmt: skip
                out.append({**base, "corun": False, "latency_s": t})
                out.append({**base, "corun": True, "latency_s": t * 1.3})
                if batch == 8:
                    out.append(
                        {**base, "corun": False, "latency_s": t + G[sms] + Q[sms] * rows, "lora_slots": 1}
                    )
    return out


def test_a_chunk_on_an_adapter_is_priced_by_the_steps_rows_and_the_base_mixed_fit_is_untouched():
    """MixedLoRACost recovers one adapter's fixed and per-row parts per share from mixed steps on an adapter
    beside the same steps on the base; the predictor's mixed step adds them (with LoRACost's part for each
    further adapter, and the co-run slowdown over all), fits the base mixed model without those samples,
    and keeps them through to_dict."""
    from harli_train.colocate.lora_cost import MixedLoRACost

    mixed = mixed_samples()
    cost = MixedLoRACost.fit(mixed, BUCKETS)
    for sms in (32, 64):
        g, q = cost.params[sms]
        assert g == pytest.approx(G[sms], rel=1e-6) and q == pytest.approx(Q[sms], rel=1e-6)
        assert cost.seconds(sms, 8 + 40) == pytest.approx(G[sms] + Q[sms] * 64, rel=1e-6)  # padded to 64
    assert cost.seconds(48, 40) < cost.seconds(32, 40)
    assert MixedLoRACost.from_dict(cost.to_dict()) == cost
    assert MixedLoRACost.fit([r for r in mixed if not r.get("lora_slots")], BUCKETS) is None

    both = LatencyPredictor.fit(samples() + mixed, 132, 1.0, mixed_buckets=BUCKETS)
    base_only = LatencyPredictor.fit(
        samples() + [r for r in mixed if not r.get("lora_slots")], 132, 1.0, mixed_buckets=BUCKETS
    )
    assert both.mixed.coef == base_only.mixed.coef and base_only.mixed_lora is None
    # The base model's error is reported on base steps only (a step on an adapter is not its to predict).
    assert both.evaluate(mixed) == base_only.evaluate([r for r in mixed if not r.get("lora_slots")])
    args = (8, 2048, 100, 5050, 64)
    base = both.predict_mixed(*args, corun=False, raw=True)
    one = both.predict_mixed(*args, corun=False, raw=True, lora_slots=1)
    assert one == pytest.approx(base + G[64] + Q[64] * 128, rel=1e-4)
    three = both.predict_mixed(*args, corun=False, raw=True, lora_slots=3)
    assert three == pytest.approx(one + 2 * P[64], rel=1e-4)
    co, co_one = (both.predict_mixed(*args, corun=True, raw=True, lora_slots=n) for n in (0, 1))
    assert co_one / one == pytest.approx(co / base, rel=1e-6)
    # Without mixed adapter steps the adapters are priced as in a decode step, whatever the chunk.
    assert base_only.predict_mixed(*args, corun=False, raw=True, lora_slots=1) == pytest.approx(
        base_only.predict_mixed(*args, corun=False, raw=True) + F[64], rel=1e-6
    )
    again = LatencyPredictor.from_dict(both.to_dict())
    assert again.predict_mixed(*args, lora_slots=2) == both.predict_mixed(*args, lora_slots=2)


def test_the_preview_counts_the_adapters_of_the_chunks_a_step_takes():
    from harli_train.engine.step_work import PrefillPiece, StepPreview

    pieces = (PrefillPiece(40, 0, 0, 2), PrefillPiece(30, 0, 10, 0), PrefillPiece(20, 0, 0, 3))
    preview = StepPreview(4, 400, pieces, True, frozenset({1}))
    assert preview.adapters(0) == 1  # the decode rows' alone
    assert preview.adapters(40) == 2 and preview.adapters(70) == 2  # slot 2's chunk; the base's adds none
    assert preview.adapters(None) == 3
    assert [p.lora_slot for p in preview.take(50)] == [2, 0]
    assert StepPreview(4, 400, pieces[:1], True).adapters(None) == 1
    same = StepPreview(4, 400, pieces[:1], True, frozenset({2}))
    assert same.adapters(None) == 1  # the chunk's adapter already runs in the decode rows


def test_a_stored_profile_without_mixed_adapter_steps_gains_them_and_the_preview_sees_a_chunks_adapter(
    models,  # noqa: F811
    tmp_path,
):
    """A profile with mixed steps and decode steps on adapters but no mixed step on one: the adapter points
    are timed again, the mixed ones included (every chunk size of the mixed grid's middle batch, all rows
    on one adapter, beside the same steps on the base), and the predictor prices a chunk on an adapter. A
    waiting request's adapter rides with its chunk in the engine's preview."""
    import harli_train.colocate.predictor_setup as setup
    from harli_train.colocate.profile import Profile, load_profile, save_profile
    from harli_train.colocate.profile_grid import MixedGrid

    engine, ladder, adapter, path, key = _profiling_engine(models, tmp_path)
    grid = MixedGrid(
        batches=(1, 2, 3), kv_len=8, tokens=(3, 6, 12), contexts=(0, 4), corun_batches=(), reps=1
    )
    stored = run_profile_grid(
        adapter.synthetic_decode, None, ladder, batches=(1, 2, 4), kv_lens=(8, 16), warmup=0, reps=1,
        lora_slots=(1,), mixed_step_fn=adapter.synthetic_mixed, mixed_grid=grid,
    )  # fmt: skip
    stored = [r for r in stored if not (r.get("lora_slots") and "prefill_tokens" in r)]  # an older profile
    assert setup.lacks_adapter_steps(stored)
    save_profile(path, Profile(key, stored, {"kv_bytes_per_token": 1.0}))
    predictor, profile = setup.build_predictor(adapter, ladder, "lora-test", None, 4, path=path, reps=1)
    on_adapter = {
        (r["infer_sms"], r["batch"], r["prefill_tokens"], r["prefill_context"])
        for r in profile.samples
        if r.get("lora_slots") and "prefill_tokens" in r
    }
    assert on_adapter == {(s, 2, n, 0) for s in ladder.shares for n in (3, 6, 12)}
    assert not setup.lacks_adapter_steps(profile.samples)
    assert predictor.mixed_lora is not None and set(predictor.mixed_lora.params) == set(ladder.shares)
    assert load_profile(path, key).meta["adapter_steps"]["mixed_points"] == [[2, n, 0] for n in (3, 6, 12)]
    # One sample per point and kind: the re-timed base points replaced, not repeated.
    kinds = [(r["infer_sms"], r["batch"], r["kv_tokens"], r.get("prefill_tokens"), r.get("prefill_context"),
              r["corun"], r.get("lora_slots", 0)) for r in profile.samples]  # fmt: skip
    assert len(kinds) == len(set(kinds))

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(PROMPTS[0], params)
    while engine.peek().kind != "decode":
        engine.step()
    engine.add_request(PROMPTS[1], params, lora_slot=2)
    preview = engine.peek()
    assert preview.lora_slots == 0  # the decode rows' only
    assert [p.lora_slot for p in preview.pieces] == [2] and preview.adapters(None) == 1
    engine.run_until_done()


def test_a_chunk_on_an_adapter_is_cut_to_the_bucket_that_fits_where_the_same_chunk_on_the_base_fits_whole():
    """The mixed step's chunking prices the chunks it takes: with a budget between a 100-token chunk's step on
    the base and on an adapter, the base chunk goes whole (the 128-row graph) and the adapter's is cut to
    what the 64-row graph holds beside the 8 decode rows."""
    from harli_train.colocate.policy.base import largest_chunk
    from harli_train.engine.step_work import PrefillPiece, StepPreview

    pred = LatencyPredictor.fit(samples() + mixed_samples(), 132, 1.0, mixed_buckets=BUCKETS)
    on_base, on_adapter = (StepPreview(8, 8 * 256, (PrefillPiece(100, 0, 0, slot),), True) for slot in (0, 1))
    pairs = 100 * 101 // 2
    base_s = pred.predict_mixed(8, 8 * 256, 100, pairs, 64, corun=False)
    adapter_s = pred.predict_mixed(8, 8 * 256, 100, pairs, 64, corun=False, lora_slots=1)
    budget = (base_s + adapter_s) / 2
    assert largest_chunk(pred, on_base, 64, False, budget)[0] == 100
    n, t, _ = largest_chunk(pred, on_adapter, 64, False, budget)
    assert n == 64 - 8 and t <= budget


def test_the_gemv_and_cublas_row_ranges_get_a_line_each():
    """Mixed steps up to MAX_GEMV_ROWS rows run the LoRA inside the GEMV's launches, past them in launches of
    their own: each range gets its own line, so a step of either is priced by its own path's cost; a share
    with one range only prices the other by it, and a saved cost without the second line still loads."""
    from harli_train.colocate.lora_cost import MixedLoRACost
    from harli_train.engine.engine_config import MAX_GEMV_ROWS

    buckets = (16, 32, 64, 128, 192, 256)
    narrow, wide = (4e-4, 6e-6), (1.5e-3, 1e-6)  # (G, Q): the cuBLAS path's launches cost a step more
    samples = []
    for batch, n in ((8, 6), (8, 24), (8, 56), (8, 100), (8, 180), (8, 240)):
        rows = next(b for b in buckets if b >= batch + n)
        g, q = narrow if rows <= MAX_GEMV_ROWS else wide
        base = dict(batch=batch, kv_len=256, kv_tokens=batch * 256, infer_sms=64, prefill_tokens=n,
                    prefill_context=0, attn_pairs=n * (n + 1) // 2, corun=False)  # fmt: skip
        samples.append({**base, "latency_s": 5e-3 + 2e-5 * rows})
        samples.append({**base, "latency_s": 5e-3 + 2e-5 * rows + g + q * rows, "lora_slots": 1})
    cost = MixedLoRACost.fit(samples, buckets)
    assert cost.params[64] == pytest.approx(narrow, rel=1e-6) and cost.wide[64] == pytest.approx(
        wide, rel=1e-6
    )
    assert cost.seconds(64, 8 + 40) == pytest.approx(narrow[0] + narrow[1] * 64, rel=1e-6)
    assert cost.seconds(64, 8 + 100) == pytest.approx(wide[0] + wide[1] * 128, rel=1e-6)
    assert MixedLoRACost.from_dict(cost.to_dict()) == cost
    only_narrow = MixedLoRACost.fit([r for r in samples if r["prefill_tokens"] <= 56], buckets)
    assert only_narrow.wide == {} and only_narrow.seconds(64, 108) == pytest.approx(
        narrow[0] + narrow[1] * 128
    )
    old = {"params": {"64": list(narrow)}, "buckets": list(buckets)}  # saved before the second line
    assert MixedLoRACost.from_dict(old).seconds(64, 108) == pytest.approx(narrow[0] + narrow[1] * 128)
