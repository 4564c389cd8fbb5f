"""Profiles: validated on load; stale, corrupt or incomplete files are reported and rebuilt, never used."""

import dataclasses
import json
import logging
import math

import pytest

from harli_train.colocate import step_timing
from harli_train.colocate.predictor import LatencyPredictor, fit_options
from harli_train.colocate.predictor_setup import GraphedWorkload, workload_kind
from harli_train.colocate.profile import (
    Profile,
    ProfileError,
    ProfileKey,
    check_destination,
    default_profile_path,
    get_or_build_profile,
    load_profile,
    save_profile,
)
from harli_train.colocate.profile_grid import build_profile, run_profile_grid
from harli_train.colocate.sm import SMLadder
from harli_train.engine.decode_linear import FMA_MIN_SMS

KEY = ProfileKey("NVIDIA H200", 132, "llama-8b", "2.11.0+cu130", "3.6.0", "13.0", "0.1.0")


def samples(shares=(32, 64, 132)):
    rows = []
    for s in shares:
        for b in (1, 8, 64):
            for kv in (512, 2048):
                t = 1e-3 * (1 + 64 / s) + 1e-5 * b + 1e-9 * b * kv
                rows.append(dict(batch=b, kv_tokens=b * kv, infer_sms=s, corun=False, latency_s=t))
                if s < 132:
                    rows.append(dict(batch=b, kv_tokens=b * kv, infer_sms=s, corun=True, latency_s=1.2 * t))
    return rows


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "p.json"
    save_profile(path, Profile(KEY, samples(), {"kv_bytes_per_token": 4096.0}))
    return path


def edit(path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def test_round_trip(saved):
    p = load_profile(saved, KEY)
    assert p.key == KEY and p.samples == samples() and p.meta["kv_bytes_per_token"] == 4096.0
    assert p.shares == [32, 64, 132]


def test_missing_and_corrupt_files(tmp_path, saved):
    with pytest.raises(ProfileError, match="no profile at") as err:
        load_profile(tmp_path / "nope.json", KEY)
    assert err.value.reason == "missing"
    saved.write_text(saved.read_text()[:100])  # truncated mid-write by a crash
    with pytest.raises(ProfileError, match="corrupt") as err:
        load_profile(saved, KEY)
    assert err.value.reason == "corrupt" and str(saved) in str(err.value)


def test_stale_key_names_what_changed(saved):
    newer = dataclasses.replace(KEY, torch_version="2.12.0", gpu_name="NVIDIA H100")
    with pytest.raises(ProfileError) as err:
        load_profile(saved, newer)
    msg = str(err.value)
    assert err.value.reason == "stale"
    assert "NVIDIA H200" in msg and "NVIDIA H100" in msg and "2.11.0+cu130" in msg and "2.12.0" in msg
    assert "triton_version" not in msg  # only what differs is listed


@pytest.mark.parametrize(
    "breakage,match",
    [
        (lambda d: d["key"].pop("torch_version"), "lacks key.torch_version"),
        (lambda d: d.pop("samples"), "lacks samples"),
        (lambda d: d.update(format="something-else"), "not a harli-train profile"),
        (lambda d: d.update(version=0), "format version"),
        (lambda d: d["key"].update(sm_count="132"), "malformed key.sm_count"),
        (lambda d: d.update(samples=[]), "no samples"),
        (lambda d: d["samples"][3].pop("latency_s"), "sample 3 has latency_s=None"),
        (lambda d: d["samples"][2].update(latency_s=-1.0), "sample 2 is out of range"),
        (lambda d: d["samples"][2].update(corun="yes"), "expected bool"),
        (lambda d: d["samples"][1].update(infer_sms=500), "uses 500 of 132 SMs"),
    ],
)
def test_invalid_contents_are_rejected(saved, breakage, match):
    edit(saved, breakage)
    with pytest.raises(ProfileError, match=match):
        load_profile(saved, KEY)


def test_nan_latency_is_rejected(saved):
    edit(saved, lambda d: d["samples"][0].update(latency_s=float("nan")))  # json writes a bare NaN
    with pytest.raises(ProfileError, match="out of range"):
        load_profile(saved, KEY)


def test_required_shares(saved):
    load_profile(saved, KEY, required_shares=[32, 64])
    with pytest.raises(ProfileError, match=r"not \[96\]") as err:
        load_profile(saved, KEY, required_shares=[32, 96])
    assert err.value.reason == "stale"


def test_get_or_build_builds_once_then_reuses(tmp_path):
    calls = []
    build = lambda: calls.append(1) or samples()
    path = tmp_path / "sub" / "p.json"
    first = get_or_build_profile(path, KEY, build)
    second = get_or_build_profile(path, KEY, build)
    assert len(calls) == 1 and first.samples == second.samples == samples()


def test_a_profile_made_beside_another_kind_of_workload_is_stale_and_made_again(saved, caplog):
    """`required_meta`: a stored profile whose meta lacks the entry, or holds another value, is stale (the
    H100's eager-workload profile priced decode beside the trainer 1.35x low on 32 SMs); the profile built
    instead records it and is reused from then on."""
    needs = {"corun_workload": "graphed"}
    with pytest.raises(ProfileError, match="corun_workload=None; this run needs 'graphed'") as err:
        load_profile(saved, KEY, required_meta=needs)
    assert err.value.reason == "stale"
    edit(saved, lambda d: d.setdefault("meta", {}).update(corun_workload="eager"))
    with pytest.raises(ProfileError, match="corun_workload='eager'"):
        load_profile(saved, KEY, required_meta=needs)
    assert load_profile(saved, KEY).samples == samples()  # nothing required: as before
    calls = []
    build = lambda: calls.append(1) or Profile(KEY, samples(), {"corun_workload": "graphed"})
    with caplog.at_level(logging.WARNING):
        got = get_or_build_profile(saved, KEY, build, required_meta=needs)
    assert calls == [1] and got.meta["corun_workload"] == "graphed" and "re-profiling" in caplog.text
    get_or_build_profile(saved, KEY, build, required_meta=needs)
    assert calls == [1]
    # The kind a profile records: the assembly's workload, graphed or launched eagerly.
    eager = lambda part: None
    assert workload_kind(GraphedWorkload(eager)) == "graphed" and workload_kind(eager) == "eager"


@pytest.mark.parametrize("damage", ["stale", "corrupt", "incomplete"])
def test_get_or_build_rebuilds_bad_profiles_and_says_why(saved, caplog, damage):
    key = KEY
    if damage == "stale":
        key = dataclasses.replace(KEY, torch_version="2.12.0")
    elif damage == "corrupt":
        saved.write_bytes(b"\x00\xff garbage")
    else:
        edit(saved, lambda d: d["key"].pop("driver_version"))
    fresh = [dict(r, latency_s=r["latency_s"] * 2) for r in samples()]
    with caplog.at_level(logging.WARNING):
        got = get_or_build_profile(saved, key, lambda: Profile(key, fresh))
    assert got.samples == fresh and got.key == key  # the rebuilt one, never the bad one
    assert "re-profiling" in caplog.text and str(saved) in caplog.text
    assert saved.with_name(saved.name + ".rejected").exists()
    assert load_profile(saved, key).samples == fresh


def test_a_destination_that_cannot_be_written_fails_before_profiling(tmp_path):
    """A profile that could not be saved is refused before its build runs (minutes of timing on a GPU), by
    its path: under a file, in a folder this user cannot make, or a folder itself."""
    (tmp_path / "afile").write_text("")
    calls = []
    build = lambda: calls.append(1) or samples()
    with pytest.raises(ProfileError, match="afile is a file, not a folder") as err:
        get_or_build_profile(tmp_path / "afile" / "p.json", KEY, build)
    assert err.value.reason == "unwritable" and str(tmp_path / "afile" / "p.json") in str(err.value)
    with pytest.raises(ProfileError, match="cannot write a profile to /proc/harli/p.json"):
        check_destination("/proc/harli/p.json")
    with pytest.raises(ProfileError, match="it is a folder"):
        check_destination(tmp_path)
    assert not calls
    check_destination(tmp_path / "new" / "p.json")  # a folder it can make
    assert list((tmp_path / "new").iterdir()) == []  # and leaves nothing behind


def test_rebuild_for_another_key_is_refused(tmp_path):
    other = dataclasses.replace(KEY, model_id="other")
    with pytest.raises(ProfileError, match="re-profile was made for"):
        get_or_build_profile(tmp_path / "p.json", KEY, lambda: Profile(other, samples()))


def test_grid_on_cpu_standin_feeds_the_predictor(tmp_path):
    ladder = SMLadder.cpu_standin(total_sms=32, step=16)
    seen = []

    def decode(batch, kv_len, part):
        seen.append((batch, kv_len, part.infer_sms))
        sum(range(50 * batch))

    trained = []
    key = ProfileKey.current("tiny", sm_count=32)
    assert key.gpu_name == "cpu" and key.sm_count == 32
    prof = build_profile(key, decode, lambda p: trained.append(p.train_sms), ladder, kv_bytes_per_token=64.0,
                         corun_workload="graphed", batches=(1, 4), kv_lens=(16, 32), warmup=1,
                         reps=3)  # fmt: skip
    solo = [s for s in prof.samples if not s["corun"]]
    corun = [s for s in prof.samples if s["corun"]]
    assert len(solo) == 2 * 2 * 2 and len(corun) == 2 * 2  # the full-GPU rung has no trainer beside it
    assert {s["infer_sms"] for s in corun} == {16} and all(s["latency_s"] > 0 for s in prof.samples)
    assert {s["kv_tokens"] for s in solo} == {16, 32, 64, 128}
    assert trained and set(trained) == {16}
    assert len(seen) == 12 * (1 + 3)
    save_profile(tmp_path / "grid.json", prof)
    again = load_profile(tmp_path / "grid.json", key, required_meta={"corun_workload": "graphed"})
    assert again.meta["fma_min_sms"] == FMA_MIN_SMS  # how its batch-1 steps ran (predictor.fit_options)
    pred = LatencyPredictor.fit(
        again.samples, 32, again.meta["kv_bytes_per_token"], **fit_options(again.meta)
    )
    assert pred.predict(4, 128, 16, corun=True) > 0 and pred.fma_min_sms == FMA_MIN_SMS


def test_only_requested_shares_are_profiled():
    ladder = SMLadder.cpu_standin(total_sms=64, step=16)
    rows = run_profile_grid(lambda b, kv, p: None, None, ladder, batches=(1,), kv_lens=(8,), shares=[32, 64],
                            warmup=0, reps=1)  # fmt: skip
    assert sorted(r["infer_sms"] for r in rows) == [32, 64] and not any(r["corun"] for r in rows)


def test_default_path_is_per_gpu_and_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HARLI_PROFILE_DIR", str(tmp_path))
    path = default_profile_path(KEY)
    assert path.parent == tmp_path and path.name == "NVIDIA_H200-llama-8b.json"


def test_a_decode_point_beside_the_trainer_takes_corun_reps_steps():
    ladder = SMLadder.cpu_standin(total_sms=64, step=16)
    calls = []
    rows = run_profile_grid(
        lambda b, kv, p: calls.append((b, kv)),
        lambda p: None,
        ladder,
        batches=(2,),
        kv_lens=(8,),
        shares=[32],
        warmup=1,
        reps=2,
        corun_reps=5,
    )
    assert sorted(r["corun"] for r in rows) == [False, True]
    assert len(calls) == (1 + 2) + (
        1 + 5
    )  # alone: warm-up and reps; beside the trainer: warm-up and corun_reps


@pytest.mark.parametrize(
    "first_covers, needed, retry_covers, queues, covered",
    [
        (True, None, None, 1, True),  # the first queue outlasts the decode steps
        (False, 1.5, True, 2, True),  # it ran dry: timed once more with the queue the first timing asks for
        (False, 1.5, False, 2, False),  # dry again: the second timing, marked
        (False, 3.0, None, 1, False),  # the queue needed is over RETRY_GROWTH times the first: not retried
        (False, None, None, 1, False),  # the launches hold the queue back: no queue would get ahead
    ],
)
def test_a_point_whose_trainer_queue_ran_dry_is_timed_once_more_with_the_queue_it_needs(
    monkeypatch, first_covers, needed, retry_covers, queues, covered
):
    """On a GPU, ``Corunner.check`` says whether the trainer's queue ended after the last timed decode step
    and ``steps_to_cover`` what queue would have; this stands in for both (``needed``: that queue over the
    first one)."""
    ladder = SMLadder.cpu_standin(total_sms=64, step=16)
    part = next(p for p in ladder.partitions if p.infer_sms == 32)
    sizes = []

    def timed(call, stream, warmup, reps, trainer=None):
        sizes.append(trainer.n)
        trainer.covered = first_covers if len(sizes) == 1 else retry_covers
        return [0.001 * len(sizes)] * reps

    monkeypatch.setattr(step_timing, "time_calls", timed)
    monkeypatch.setattr(
        step_timing.Corunner,
        "steps_to_cover",
        lambda self: None if needed is None else int(needed * self.n),
    )
    t, got, retimed = step_timing.time_beside(
        lambda: None, lambda p: None, part, 1, 4, t_solo=0.01, t_train=0.01
    )
    assert got is covered and retimed is (queues == 2)
    assert len(sizes) == queues
    if queues == 2:
        assert sizes[1] == int(needed * sizes[0])
    assert t == pytest.approx(0.001 * queues)  # the last timing


def test_the_queue_that_covers_is_computed_from_the_first_timings_gpu_and_host_seconds():
    """A queue of 100 steps ran 1.0 s on the GPU and took 0.6 s to launch (4 ms of lead a step); the decode
    steps, launched after it, ended 2.2 s after its start, so they needed 1.6 s of lead: 400 steps, 500
    with the margin. A GPU no faster than the host: no queue covers."""
    ladder = SMLadder.cpu_standin(total_sms=64, step=16)
    part = next(p for p in ladder.partitions if p.infer_sms == 32)
    runner = step_timing.Corunner(lambda p: None, part, 1.0, 0.01, n=100)
    runner._marks = (object(), object())
    runner._queue_s, runner._launch_s, runner._decode_end_s = 1.0, 0.6, 2.2
    assert runner.steps_to_cover() == math.ceil(step_timing.COVER_MARGIN * 1.6 / 0.004)
    runner._launch_s = 1.0
    assert runner.steps_to_cover() is None
    runner._launch_s, runner._decode_end_s = 0.0, 1e4  # more than MAX_STEPS
    assert runner.steps_to_cover() is None
