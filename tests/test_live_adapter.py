"""The trainer's adapter served live: double-buffered refreshes that never touch a buffer a request runs on,
a request's tokens all from the version it pinned, `serve_adapter_every`, and the final adapter; then a
co-located `--serve` run whose served versions advance and each equal the checkpoint of their step."""

import json
import os
import re
import signal
import subprocess
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
