"""Predictor: recovers known coefficients from noisy synthetic profiles, predicts fast, corrects online."""

import json
import time

import numpy as np
import pytest

from harli_train.colocate.mixed_model import MixedStepModel
from harli_train.colocate.predictor import LatencyPredictor, fit_options, gemv_rows, split_samples
from harli_train.engine.decode_linear import FMA_MIN_SMS

TOTAL = 132
KV_BPT = 32768.0  # bytes of KV per cached token (8 layers of Llama-3-8B)
SHARES = list(range(8, 129, 8)) + [TOTAL]
W_BYTES = 3.5e9
HBM = 3.5e12
TRUE_G = (2.0e-5, 1.5e-7, 0.0, 4.0e-6)  # m/s, m^2/s, m^3/s, b (m: the GEMV's rows)


def bandwidth(s):
    return HBM * min(1.0, s / 56.0)


def true_params(s):
    """A, C, D of the generator: roofline weight + KV read at the share's bandwidth, contention at 1 - s/T."""
    u = (TOTAL - s) / TOTAL
    return 40e-6 + W_BYTES / bandwidth(s), 1.0 / bandwidth(s), 0.3 * u


E_TRUE = (4e-4, 1e-12)  # slowdown slopes per sequence and per KV byte


def truth(b, kv_tokens, s, corun, fma_min_sms=FMA_MIN_SMS):
    a, c, d = true_params(s)
    g1, g2, g3, g4 = TRUE_G
    m = gemv_rows(b, s, fma_min_sms)
    t = a + c * kv_tokens * KV_BPT + g1 * m / s + g2 * m * m / s + g3 * m**3 / s + g4 * b
    if corun:
        t *= 1 + d + E_TRUE[0] * b + E_TRUE[1] * kv_tokens * KV_BPT
    return t


def synthetic(
    noise=0.01,
    seed=0,
    batches=(1, 8, 16, 32, 64, 128),
    kv_lens=(256, 512, 1024, 2048),
    fma_min_sms=FMA_MIN_SMS,
):
    rng = np.random.default_rng(seed)
    rows = []
    for s in SHARES:
        for b in batches:
            for kv in kv_lens:
                for corun in (False, True) if s < TOTAL else (False,):
                    y = truth(b, b * kv, s, corun, fma_min_sms) * (1 + noise * rng.standard_normal())
                    rows.append(dict(batch=b, kv_tokens=b * kv, infer_sms=s, corun=corun, latency_s=y))
    return rows


@pytest.fixture(scope="module")
def fitted():
    return LatencyPredictor.fit(synthetic(noise=0.0), TOTAL, KV_BPT)


def test_recovers_known_coefficients_without_noise(fitted):
    for s in SHARES:
        a, c, d = true_params(s)
        got = fitted.share_params[s]
        assert got[0] == pytest.approx(a, rel=1e-6)
        assert got[1] == pytest.approx(c, rel=1e-6)
        if s < TOTAL:
            assert got[2] == pytest.approx(d, rel=1e-6, abs=1e-9)
    assert fitted.solo_global == pytest.approx(list(TRUE_G), rel=1e-5, abs=1e-12)
    assert fitted.slow_global == pytest.approx(list(E_TRUE), rel=1e-5)
    assert fitted.effective_bandwidth()[64] == pytest.approx(HBM, rel=1e-6)


def test_noisy_fit_holds_out_within_a_few_percent():
    rows = synthetic(noise=0.01, seed=1)
    train, held = split_samples(rows, 0.7, seed=2)
    pred = LatencyPredictor.fit(train, TOTAL, KV_BPT)
    err = pred.evaluate(held)
    assert err["solo_mape_pct"] < 2.0 and err["corun_mape_pct"] < 2.5
    assert err["solo_n"] + err["corun_n"] == len(held)
    a, c, _ = true_params(32)
    assert pred.share_params[32][0] == pytest.approx(a, rel=0.05)
    assert pred.share_params[32][1] == pytest.approx(c, rel=0.15)
    assert pred.fit_report["n_solo"] + pred.fit_report["n_corun"] == len(train)


def test_predict_matches_generator_and_handles_unprofiled_shares(fitted):
    assert fitted.predict(32, 32 * 1000, 48, corun=False) == pytest.approx(
        truth(32, 32000, 48, False), rel=1e-6
    )
    assert fitted.predict(32, 32 * 1000, 48, corun=True) == pytest.approx(
        truth(32, 32000, 48, True), rel=1e-6
    )
    lo, mid, hi = (fitted.predict(16, 16000, s, corun=False) for s in (40, 44, 48))
    assert hi <= mid <= lo  # interpolated between its neighbours
    assert fitted.predict(16, 16000, 4, corun=False) > fitted.predict(16, 16000, 8, corun=False)
    beyond = fitted.predict(256, 0, 64, corun=False)
    assert beyond >= 2 * fitted.predict(128, 0, 64, corun=False) * 0.999  # past the profile: safe side
    shares = [s for s, _ in fitted.predict_all_shares(8, 8000)]
    assert shares == SHARES


def test_residual_correction_tracks_measured_ratio(fitted):
    pred = LatencyPredictor.from_dict(fitted.to_dict())
    raw = pred.predict(16, 16000, 64, corun=True, raw=True)
    for _ in range(100):
        pred.observe(64, True, 1.2 * raw, raw)
    assert pred.correction(64, True) == pytest.approx(1.2, rel=1e-3)
    assert pred.predict(16, 16000, 64, corun=True) == pytest.approx(1.2 * raw, rel=1e-3)
    assert pred.correction(64, False) == 1.0  # solo and co-run are corrected apart
    # One wild outlier moves it by at most alpha_up * (clamp - correction); non-finite timings are ignored.
    pred.observe(64, True, 1000 * raw, raw)
    assert pred.correction(64, True) == pytest.approx(1.2 + pred.alpha_up * (2.0 - 1.2), rel=1e-6)
    pred.observe(64, True, float("nan"), raw)
    assert pred.correction(64, True) == pytest.approx(1.6, rel=1e-6)
    # Slower than predicted is caught at once, faster only decays: one 1.3x step takes the correction from
    # 1.0 at least halfway, one 0.7x step moves it down by alpha alone.
    pred.reset_corrections()
    pred.observe(64, True, 1.3 * raw, raw)
    assert pred.correction(64, True) >= 1.15 - 1e-9
    before = pred.correction(64, True)
    pred.observe(64, True, 0.7 * raw, raw)
    assert pred.correction(64, True) == pytest.approx(before + pred.alpha * (0.7 - before), rel=1e-6)
    pred.reset_corrections()
    assert pred.predict(16, 16000, 64) == raw


def test_mixed_steps_are_sized_by_an_upper_quantile_of_their_error(fitted):
    """A mixed step's chunk fills the budget, so its spread overruns the objective, not its mean: the mixed
    families' correction is at least the 95th percentile of their recent measured / raw ratios, GPU-wide,
    once enough are in; decode's families keep their EWMA alone."""
    pred = LatencyPredictor.from_dict(fitted.to_dict())
    raw = 0.02
    spread = [0.7 + 0.01 * (i % 60) for i in range(120)]  # 0.70-1.29, mean ~1.0: an EWMA sits near it
    for r in spread[: pred.mixed_min_samples - 1]:
        pred.observe(48, True, r * raw, raw, mixed=True)
    ewma = pred.correction(48, True, mixed=True)
    assert pred._mixed_q[1].value is None  # too few to say: the EWMA alone
    for r in spread[pred.mixed_min_samples - 1 :]:
        pred.observe(48 if r < 1 else 64, True, r * raw, raw, mixed=True)
    recent = sorted(spread[-pred.mixed_window :])
    q95 = recent[int(0.95 * len(recent))]
    assert q95 > 1.2 and pred._mixed_q[1].value == pytest.approx(q95)
    for sms in (32, 48, 64, 96):  # every share, measured or not
        assert pred.correction(sms, True, mixed=True) >= q95 - 1e-12
    assert pred.correction(48, False, mixed=True) < q95  # mixed solo steps are their own family
    assert pred.correction(48, True) == 1.0 and pred.correction(48, False) == 1.0  # decode untouched
    assert ewma < q95
    pred.reset_corrections()
    assert pred.correction(48, True, mixed=True) == 1.0  # a predictor without a mixed fit: no prior
    # Before enough mixed steps are measured, the mixed fit's worst error on its profile is the floor.
    pred.mixed = MixedStepModel({48: [0.01] + [0.0] * 5}, {}, {"fit_mixed_corun_max_ape_pct": 17.0})
    assert pred.correction(48, True, mixed=True) == pytest.approx(1.17)
    assert pred.correction(48, False, mixed=True) == 1.0 and pred.correction(48, True) == 1.0
    for _ in range(pred.mixed_min_samples):
        pred.observe(48, True, 0.9 * raw, raw, mixed=True)
    assert pred.correction(48, True, mixed=True) < 1.17  # measured: the quantile (and the EWMA) take over


def test_a_miss_on_one_share_carries_to_the_next_and_decays(fitted):
    """A GPU-wide slowdown learnt on one share applies at once to the share decode grows to and to shares
    not yet measured; it decays as other shares run as modelled, while the share keeps its own."""
    pred = LatencyPredictor.from_dict(fitted.to_dict())
    raw = {s: pred.predict(32, 32000, s, corun=True, raw=True) for s in (48, 64, 80)}
    pred.observe(48, True, 1.4 * raw[48], raw[48])  # after a burst of prefills: 40 % over the model
    assert pred.correction(64, True) == pred.correction(48, True) == pytest.approx(1.2)
    assert pred.predict(32, 32000, 64) == pytest.approx(1.2 * raw[64])  # padded before it is tried
    assert pred.correction(32, True) == pytest.approx(1.2)  # and a smaller share not yet measured
    assert pred.correction(64, False) == 1.0  # solo is its own family
    for _ in range(40):  # the GPU runs as modelled again, on 80 SMs
        pred.observe(80, True, raw[80], raw[80])
    assert pred.correction(80, True) == pred.correction(64, True) == pytest.approx(1.0, abs=0.01)
    # 48 keeps part of its own: its excess over the GPU-wide factor relaxes by idle_alpha per step elsewhere,
    # so one spike on a share holds it out of use for some steps, not for the rest of the run.
    assert 1.05 < pred.correction(48, True) < 1.15
    for _ in range(300):
        pred.observe(80, True, raw[80], raw[80])
    assert pred.correction(48, True) == pytest.approx(1.0, abs=0.01)
    # A share that keeps running slow keeps its factor while in use, and the GPU-wide one does not pull it down.
    for _ in range(60):
        pred.observe(48, True, 1.25 * raw[48], raw[48])
    assert pred.correction(48, True) == pytest.approx(1.25, abs=0.01)
    # A faster GPU gives no discount to a share not yet measured.
    pred.reset_corrections()
    pred.observe(80, True, 0.8 * raw[80], raw[80])
    assert pred.correction(64, True) == 1.0 and pred.correction(80, True) < 1.0
    # Both survive the JSON round trip.
    pred.observe(48, True, 1.3 * raw[48], raw[48])
    again = LatencyPredictor.from_dict(json.loads(json.dumps(pred.to_dict())))
    for s in (32, 48, 64, 80):
        for corun in (False, True):
            assert again.correction(s, corun) == pred.correction(s, corun)


def test_a_corun_spike_does_not_outlive_a_pause(fitted):
    """While the trainer is paused only solo steps are measured: the co-run factors learnt before the pause
    relax toward the solo one instead of keeping every share over budget for good."""
    pred = LatencyPredictor.from_dict(fitted.to_dict())
    raw = pred.predict(4, 4000, 64, corun=True, raw=True)
    for _ in range(3):  # stalls beside the trainer just before the pause
        pred.observe(64, True, 2.0 * raw, raw)
    spiked = pred.correction(48, True)
    assert spiked > 1.8
    solo = pred.predict(4, 4000, 132, corun=False, raw=True)
    for _ in range(20):  # decode alone on the whole GPU, as modelled
        pred.observe(132, False, solo, solo)
    assert 1.0 < pred.correction(48, True) < spiked - 0.25
    for _ in range(400):  # about 3 s of decode steps
        pred.observe(132, False, solo, solo)
    assert pred.correction(48, True) == pytest.approx(1.0, abs=0.02)
    assert pred.correction(64, True) == pytest.approx(1.0, abs=0.02)  # the spiked share's own factor too
    # A slow solo family pulls nothing up: only an excess relaxes.
    pred.reset_corrections()
    pred.observe(132, False, 1.5 * solo, solo)
    assert pred.correction(48, True) == 1.0


def test_round_trip_through_json(fitted):
    fitted.observe(32, True, 0.01, 0.008)
    again = LatencyPredictor.from_dict(json.loads(json.dumps(fitted.to_dict())))
    for s in (8, 40, 44, 132):
        for corun in (False, True):
            assert again.predict(64, 64 * 512, s, corun) == fitted.predict(64, 64 * 512, s, corun)
    fitted.reset_corrections()


def test_prediction_is_microseconds(fitted):
    n = 2000
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fitted.predict(32, 32768, 64, True)
        times.append((time.perf_counter() - t0) / n)
    assert min(times) < 10e-6  # loose on a shared CI core; the bench measures the real figure


def test_fit_rejects_empty_solo():
    with pytest.raises(ValueError, match="solo"):
        LatencyPredictor.fit(
            [dict(batch=1, kv_tokens=0, infer_sms=8, corun=True, latency_s=1.0)], TOTAL, KV_BPT
        )


def test_thin_shares_are_interpolated_not_fitted():
    rows = [r for r in synthetic(noise=0.0) if not (r["infer_sms"] == 48 and r["kv_tokens"] != 8 * 512)]
    pred = LatencyPredictor.fit(rows, TOTAL, KV_BPT)
    assert pred.fit_report["skipped_shares"] == [48] and 48 not in pred.shares
    lo, mid, hi = (pred.predict(8, 8 * 512, s, corun=False) for s in (40, 48, 56))
    assert hi < mid < lo


def test_a_batch_pays_for_the_rows_its_gemv_tile_computes(fitted):
    """33 sequences run the projections' 64-row tile: their compute is 64 rows', not a point between 32 and
    64 (only the per-sequence term and the KV read grow with the batch itself)."""
    assert [gemv_rows(b) for b in (1, 2, 16, 17, 32, 33, 64)] == [1, 16, 16, 32, 32, 64, 64]
    kv = 1024
    for s in (32, 64, 128):
        got = fitted.predict(33, 33 * kv, s, corun=False, raw=True)
        assert got == pytest.approx(truth(33, 33 * kv, s, False), rel=1e-6)
        g4 = TRUE_G[3]
        at_64 = fitted.predict(64, 33 * kv, s, corun=False, raw=True)
        assert at_64 - got == pytest.approx(31 * g4, rel=1e-4)  # the same tile: only b's own term differs


def test_a_saved_predictor_of_other_batch_terms_is_refused(fitted):
    d = json.loads(json.dumps(fitted.to_dict()))
    again = LatencyPredictor.from_dict(d)
    assert again.predict(33, 4096, 64) == pytest.approx(fitted.predict(33, 4096, 64))
    del d["batch_terms"]
    with pytest.raises(ValueError, match="refit it from its profile"):
        LatencyPredictor.from_dict(d)


def test_gemv_rows_are_the_rows_the_decode_gemv_computes():
    """The predictor's row count is `decode_linear_config`'s tile rows for the engine's default graph bucket
    of each batch on each share (one row streamed with FMAs at batch 1 on most of the GPU, a tensor-core tile
    on a partition's few SMs)."""
    from harli_train.engine.decode_linear import decode_linear_config
    from harli_train.engine.engine_config import EngineConfig

    buckets = EngineConfig(max_num_seqs=64).graph_batch_sizes
    for sms in (16, 48, 80, 96, 132):
        for b in range(1, 65):
            bucket = min(x for x in buckets if x >= b)
            assert gemv_rows(b, sms) == decode_linear_config(bucket, (4096,), 4096, sms).block_m, (b, sms)
    assert gemv_rows(1) == 1 and gemv_rows(1, 48) == 16


def test_a_profile_keeps_the_gemv_rows_its_batch_1_steps_were_timed_with():
    """A profile made before batch 1 took the tensor-core tiles on a partition (its meta lacks
    ``fma_min_sms``) was timed with FMAs on every share: ``fit_options`` fits it so, and its predictor counts
    one row there (fitted as tiles, those samples would bend every batch's terms); a new profile names the
    threshold. A saved predictor keeps it, and one saved without it reads as FMAs everywhere."""
    old = synthetic(noise=0.0, fma_min_sms=0)
    assert fit_options({"mixed_buckets": [16, 32]}) == {"mixed_buckets": (16, 32), "fma_min_sms": 0}
    assert fit_options({"fma_min_sms": FMA_MIN_SMS})["fma_min_sms"] == FMA_MIN_SMS
    right = LatencyPredictor.fit(old, TOTAL, KV_BPT, **fit_options({}))
    wrong = LatencyPredictor.fit(old, TOTAL, KV_BPT)  # as if timed on the tiles below FMA_MIN_SMS
    for b, s in ((1, 48), (8, 48), (1, TOTAL)):
        assert right.predict(b, b * 1000, s, corun=False) == pytest.approx(truth(b, b * 1000, s, False, 0))
    assert right.evaluate(old)["solo_max_ape_pct"] < 1e-6 < 0.1 < wrong.evaluate(old)["solo_max_ape_pct"]
    again = LatencyPredictor.from_dict(json.loads(json.dumps(right.to_dict())))
    assert again.fma_min_sms == 0 and again.predict(1, 1000, 48) == right.predict(1, 1000, 48)
    legacy = right.to_dict()
    legacy.pop("fma_min_sms")
    assert LatencyPredictor.from_dict(legacy).fma_min_sms == 0
    assert LatencyPredictor.from_dict(wrong.to_dict()).fma_min_sms == FMA_MIN_SMS


def test_mixed_steps_are_predicted_on_the_buckets_of_the_engine_that_runs_them():
    """A mixed model fitted on a profile's buckets (16, 32, 64, 128) predicts an engine whose graphs also
    have a 96-token bucket on that engine's buckets: a step of 90 tokens costs what its 96 rows cost on the
    fitted line, between the 64- and the 128-token steps, not the 128-token step it would have padded to;
    the chunk a mixed step may take is bounded by the engine's largest bucket."""
    from harli_train.colocate.mixed_model import MixedStepModel
    from harli_train.colocate.policy.base import graph_room
    from harli_train.engine.engine_config import EngineConfig
    from harli_train.engine.mixed_graphs import token_buckets
    from harli_train.engine.step_work import PrefillPiece, StepPreview

    assert token_buckets(EngineConfig(max_num_seqs=64)) == (16, 32, 64, 96, *range(128, 577, 64))
    profiled = (16, 32, 64, 128)
    pred = LatencyPredictor(132, 1.0, [132], {132: [1e-3, 0.0, 0.0]}, [0.0, 0.0, 0.0, 0.0], [0.0, 0.0], 64)
    # 2 ms + 20 us a row up to 64, 30 us a row past it.
    pred.mixed = MixedStepModel({132: [2e-3, 2e-5, 1e-5, 0.0, 0.0, 0.0]}, {132: 0.0}, buckets=profiled)
    at = lambda n: pred.predict_mixed(2, 0, n, 0, 132, corun=False, raw=True)  # noqa: E731
    assert at(88) == pytest.approx(at(126)) == pytest.approx(2e-3 + 2e-5 * 128 + 1e-5 * 64)
    pred.pad_to(token_buckets(EngineConfig(max_num_seqs=64)))
    assert at(88) == pytest.approx(2e-3 + 2e-5 * 96 + 1e-5 * 32)
    assert at(62) < at(88) < at(126)
    assert graph_room(pred, StepPreview(2, 0, (PrefillPiece(1000, 0, 0),), mixed=True)) == 574
    pred.pad_to(())  # an engine that runs mixed steps eagerly: the rows themselves
    assert at(88) == pytest.approx(2e-3 + 2e-5 * 90 + 1e-5 * 26)


def test_a_graphed_profile_is_fitted_through_the_cost_of_every_bucket_it_measured():
    """On graphs a mixed step runs its bucket's rows, and the cost between profiled buckets is not one line
    (on the H200 96 rows cost 1.2-1.5 ms more than 64: past the GEMV's rows cuBLAS takes over, then little
    more up to 256). The spline's knots are the profiled buckets between the least and the largest, so the
    fit goes through each one's cost and interpolates between them; a share that lacks some buckets fits a
    line over them; a model saved before the knots were kept reads with the fixed ones."""
    from harli_train.colocate.mixed_model import KNOTS, attention_pairs, padded_rows

    buckets = (16, 32, 64, 96, *range(128, 577, 64))

    def rows_cost(r: int) -> float:  # seconds at 132 SMs
        if r <= 64:
            return 5e-3 + 1e-5 * r
        if r <= 256:
            return 5e-3 + 64e-5 + 1.4e-3 + 4e-6 * (r - 64)
        return rows_cost(256) + 2.3e-5 * (r - 256)

    def truth(b: int, kv: int, n: int, pairs: int, sms: int) -> float:
        return (rows_cost(padded_rows(b + n, buckets)) + 2e-10 * pairs + 3e-9 * kv) * 132 / sms

    samples = []
    for sms in (64, 132):
        for b in (2, 8, 32):
            for n in (14, 30, 62, 192, 512):
                for ctx in (0, 426):
                    if sms == 64 and padded_rows(b + n, buckets) in (96, 256):
                        continue  # this share lacks two of the buckets
                    pairs = attention_pairs([(n, ctx)])
                    samples.append(
                        {"batch": b, "kv_tokens": b * 512, "prefill_tokens": n, "attn_pairs": pairs,
                         "infer_sms": sms, "corun": False, "latency_s": truth(b, b * 512, n, pairs, sms)}
                    )  # fmt: skip
    model = MixedStepModel.fit(samples, buckets)
    assert model.knots == (32, 64, 96, 256)
    assert model.fit_report["fit_mixed_solo_max_ape_pct"] < 0.01
    for rows in (16, 64, 96, 128, 192, 256, 384, 576):  # 128-192 and 384: between profiled buckets
        n = rows - 2
        assert model.predict(2, 1024, n, 0, 132, False) == pytest.approx(truth(2, 1024, n, 0, 132), rel=1e-4)
    assert all(np.isfinite(model.coef[64]))
    for rows in (16, 32, 64, 576):
        got, want = model.predict(8, 4096, rows - 8, 0, 64, False), truth(8, 4096, rows - 8, 0, 64)
        assert got == pytest.approx(want, rel=1e-4)
    saved = json.loads(json.dumps(model.to_dict()))
    assert MixedStepModel.from_dict(saved).predict(2, 1024, 90, 0, 132, False) == model.predict(
        2, 1024, 90, 0, 132, False
    )
    legacy = MixedStepModel.fit(samples, ()).to_dict()
    legacy.pop("knots")
    assert MixedStepModel.from_dict(legacy).knots == KNOTS
