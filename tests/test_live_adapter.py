"""The trainer's adapter served live: double-buffered refreshes that never touch a buffer a request runs on,
a request's tokens all from the version it pinned, `serve_adapter_every`, and the final adapter; then a
co-located `--serve` run whose served versions advance and each equal the checkpoint of their step."""

import json
import queue
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from harli_train.colocate.live_adapter import LiveAdapter
from harli_train.colocate.shared_model import base_view
from harli_train.engine import DecodeEngine, EngineConfig, SamplingParams
from harli_train.engine.adapters import AdapterCatalog
from harli_train.model import load_model

from .servers import launch

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 42, 99, 3, 7]


def _trainer_model():
    model = load_model("tiny", torch.float32, "cpu")
    model.add_lora(8, 16.0, 0.0, seed=0)
    return model


def _step(model, seed):
    """What an optimizer step does to the masters: every A and B moves."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.lora_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def _reference(model, n):
    """Greedy tokens of PROMPT from an engine holding the masters as they are now (a snapshot)."""
    engine = DecodeEngine(base_view(model), EngineConfig(max_model_len=64, max_loras=1, max_lora_rank=8))
    pairs = {
        p: (m.lora_A.detach().clone(), m.lora_B.detach().clone()) for p, m in model.lora_modules().items()
    }
    first = next(iter(model.lora_modules().values()))
    engine.load_lora(1, pairs, first.rank, first.scale)
    seq = engine.add_request(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True), lora_slot=1)
    engine.run_until_done()
    return seq.completion_token_ids


def _live(model, every=1):
    engine = DecodeEngine(base_view(model), EngineConfig(max_model_len=64, max_loras=2, max_lora_rank=8))
    catalog = AdapterCatalog(engine, "tiny")
    return engine, catalog, LiveAdapter(engine, catalog, "run", model, step=0, every=every)


def test_a_request_keeps_its_version_while_the_adapter_moves_on():
    model = _trainer_model()
    _step(model, 1)
    engine, catalog, live = _live(model)
    assert [(c.id, c.step) for c in catalog.cards] == [("tiny", None), ("run", 0)]
    want_v0 = _reference(model, 12)
    first = catalog.slot("run")
    pinned = engine.add_request(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), lora_slot=first)
    for _ in range(3):
        engine.step()
    _step(model, 2)
    want_v1 = _reference(model, 12)
    live.after_optimizer_step(1)  # into the spare buffer
    live.poll()
    assert (live.step, catalog.step("run")) == (1, 1) and catalog.slot("run") != first
    newer = engine.add_request(
        PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), lora_slot=catalog.slot("run")
    )
    _step(model, 3)
    live.after_optimizer_step(2)  # both buffers have requests: the refresh waits
    live.poll()
    assert live.step == 1
    engine.run_until_done()
    assert pinned.completion_token_ids == want_v0 and newer.completion_token_ids == want_v1
    assert want_v0 != want_v1
    live.poll()  # the old buffer is free now and goes back to the trainer side
    _step(model, 4)
    live.after_optimizer_step(3)
    live.poll()
    assert live.step == 3 and catalog.slot("run") == first
    assert live.publish_final(3)  # nothing newer to serve


def test_refreshes_follow_every_and_the_final_adapter_is_served():
    model = _trainer_model()
    engine, catalog, live = _live(model, every=2)
    live.after_optimizer_step(1)
    live.poll()
    assert live.step == 0  # not due yet
    live.after_optimizer_step(2)
    live.poll()
    assert live.step == 2
    _step(model, 5)
    live.after_optimizer_step(3)  # not due; training then ends at step 3
    assert live.publish_final(3) and catalog.step("run") == 3
    seq = engine.add_request(
        PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), lora_slot=catalog.slot("run")
    )
    engine.run_until_done()
    assert seq.completion_token_ids == _reference(model, 8)


def _get(url):
    import urllib.request

    with urllib.request.urlopen(url) as resp:
        return json.loads(resp.read())


def _live_card(url, name):
    return next(m for m in _get(f"{url}/v1/models")["data"] if m["id"] == name)


@pytest.mark.slow
def test_a_colocated_serve_run_serves_its_adapter_live(tmp_path):
    """`--colocate-with tiny --serve 0`: /v1/models shows the run's adapter and its step; requests during
    training run on advancing versions, each equal to the checkpoint of the step it names; after training
    the final adapter stays served."""
    openai = pytest.importorskip("openai")
    steps, run = 5, tmp_path / "live-run"
    proc, url = launch([str(ROOT / "recipes" / "quickstart.yaml"), "--colocate-with", "tiny", "--serve", "0",
                        "--quiet", "colocation.rate=0", f"train.steps={steps}", "train.batch_size=2",
                        "data.seq_len=32", "train.warmup_steps=1", "train.log_every=1", "output.checkpoint_every=1",
                        f"output.keep_checkpoints={steps}", f"output.dir={run}"])  # fmt: skip
    seen: list[tuple[int, str]] = []
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        assert _live_card(url, "live-run")["parent"] == "tiny"
        deadline = time.time() + 240
        while time.time() < deadline and _live_card(url, "live-run")["step"] < steps:
            done = client.completions.create(model="live-run", prompt="add 1+2 =", max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True})  # fmt: skip
            seen.append((int(done.system_fingerprint.removeprefix("step-")), done.choices[0].text))
        time.sleep(1.0)  # training is over: the final adapter stays
        done = client.completions.create(model="live-run", prompt="add 1+2 =", max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})  # fmt: skip
        seen.append((int(done.system_fingerprint.removeprefix("step-")), done.choices[0].text))
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert seen[-1][0] == steps and len({s for s, _ in seen}) >= 3, seen  # the versions advanced
    from harli_train.engine.api import build_engine

    texts = {}
    for step, text in seen:
        if step not in texts:
            adapter = run / "checkpoints" / f"step_{step:06d}" if step else None
            engine = build_engine("tiny", "cpu", config=EngineConfig(max_model_len=64), adapter=adapter)
            seq = engine.add_request("add 1+2 =", SamplingParams(max_tokens=6, ignore_eos=True),
                                     lora_slot=1 if adapter else 0)  # fmt: skip
            engine.run_until_done()
            texts[step] = engine.decode_text(seq)
        assert text == texts[step], step


def test_the_recipe_key_and_trace_lines_naming_a_model_are_checked(tmp_path):
    from harli_train.config import RecipeError, load_recipe
    from harli_train.engine.load import TraceError, TraceRequest, parse_request, read_trace

    with pytest.raises(RecipeError, match="colocation.serve_adapter_every"):
        load_recipe(ROOT / "recipes" / "quickstart.yaml", ["colocation.serve_adapter_every=0"])
    assert load_recipe(ROOT / "recipes" / "quickstart.yaml").colocation.serve_adapter_every == 1
    line = {"arrival_s": 0.5, "prompt_len": 8, "output_len": 4, "model": "run"}
    assert parse_request(line, "t:1").model == "run"
    with pytest.raises(TraceError, match="t:1: model must be a non-empty string"):
        parse_request({**line, "model": 3}, "t:1")
    trace = tmp_path / "t.jsonl"
    trace.write_text(TraceRequest(0.5, 4, prompt_len=8, request_id="a", model="run").to_json() + "\n")
    assert read_trace(trace)[0].model == "run"


def test_the_live_adapter_follows_a_fresh_trainer_and_refreshes_from_its_steps():
    """A bench window's fresh trainer (another model, its steps from 0): the live id serves its adapter at
    once, and its first optimizer step refreshes it (the old trainer's step count no longer holds it back)."""
    old = _trainer_model()
    _step(old, 1)
    engine, catalog, live = _live(old)
    live.after_optimizer_step(5)
    live.poll()
    assert live.step == 5
    fresh = _trainer_model()
    _step(fresh, 7)
    live.follow(fresh, 0)
    assert (live.step, catalog.step("run")) == (0, 0)
    seq = engine.add_request(
        PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), lora_slot=catalog.slot("run")
    )
    engine.run_until_done()
    assert seq.completion_token_ids == _reference(fresh, 8)
    _step(fresh, 8)
    live.after_optimizer_step(1)
    live.poll()
    assert live.step == 1
    seq = engine.add_request(
        PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), lora_slot=catalog.slot("run")
    )
    engine.run_until_done()
    assert seq.completion_token_ids == _reference(fresh, 8)


def test_the_bench_puts_a_share_of_each_cells_requests_on_the_live_adapter():
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_colocate import LIVE_MODEL, on_live_adapter
    from colocate_load import make_cells

    cells = make_cells("steady", ["light"], 15.0, 50)
    (half,) = on_live_adapter(cells, 0.5)
    models = [r.model for r in half.requests]
    assert abs(models.count(LIVE_MODEL) - len(models) / 2) <= 1 and set(models) == {None, LIVE_MODEL}
    assert [r.arrival_s for r in half.requests] == [r.arrival_s for r in cells[0].requests]
    assert on_live_adapter(cells, 0.0) == cells


class _Copy:
    """A refresh's event on a GPU: reached once the trainer's stream has run the copy (and what it queued)."""

    def __init__(self) -> None:
        self.reached = False

    def query(self) -> bool:
        return self.reached

    def synchronize(self) -> None:
        self.reached = True


def test_a_refresh_is_served_only_once_its_copy_has_run_so_no_decode_step_waits_for_the_trainer():
    # The copy is queued on the trainer's stream behind the optimizer's update and whatever the trainer
    # queued before it: a decode step made to wait for its event would wait for all of that.
    model = _trainer_model()
    engine, catalog, live = _live(model)
    copies: list[_Copy] = []

    class Mailbox(queue.SimpleQueue):
        def put(self, item, block=True, timeout=None):
            copies.append(_Copy())
            super().put((item[0], item[1], copies[-1]))

    live._to_engine = Mailbox()
    first = catalog.slot("run")
    _step(model, 1)
    live.after_optimizer_step(1)
    live.poll()
    assert (live.step, catalog.slot("run")) == (0, first) and engine.lora.take_waits() == []
    engine.add_request(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), lora_slot=first)
    engine.step()  # decode goes on, on the version it has
    copies[0].reached = True
    live.poll()
    assert live.step == 1 and catalog.slot("run") != first and engine.lora.take_waits() == copies
    # Training ends with a refresh in flight: the final adapter is served once its copy has run, and a second
    # call does not post it again.
    engine.run_until_done()
    live.poll()
    _step(model, 2)
    assert not live.publish_final(2) and len(copies) == 2 and live.step == 1
    assert not live.publish_final(2) and len(copies) == 2
    copies[1].reached = True
    assert live.publish_final(2) and (live.step, catalog.step("run")) == (2, 2)
