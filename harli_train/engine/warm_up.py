"""Warming an engine's prefill path up before traffic: Triton compiles a kernel per specialisation of its
integer arguments and per SM budget, and a compile inside a served request's prefill stalls every running
sequence for a second or more."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harli_train.engine.engine_config import EngineError
from harli_train.engine.sampler import TOP_K_BUCKETS
from harli_train.engine.sampling_params import SamplingParams
from harli_train.engine.step_result import RequestRefused

if TYPE_CHECKING:
    from harli_train.engine.engine import DecodeEngine

# Prefill lengths a warm-up runs: every integer specialisation Triton makes (1, multiples of 16, others),
# short and long, alone and packed.
WARMUP_PROMPT_LENS = (1, 5, 16, 17, 100, 512, 1000)
# The sampling of a warm-up's requests, one each in turn: greedy, then the sampler's other paths (a seeded
# temperature, top-k in each of the sampler's `TOP_K_BUCKETS` (a larger k sorts as top-p does), top-p), so
# that their kernels are loaded on the partition before a served request needs them: a kernel's first
# launch in a context loads it, waiting for the device's queued work.
WARMUP_SAMPLING = (
    SamplingParams(max_tokens=2, ignore_eos=True),
    SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.8, seed=1),
    *(
        SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.8, top_k=k, seed=2 + i)
        for i, k in enumerate(TOP_K_BUCKETS)
    ),
    SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5),
)


def warm_up_prefill(engine: DecodeEngine, prompt_lens: tuple[int, ...], partition: str) -> int:
    """Compile what `engine`'s prefill steps on `partition` launch for the shapes traffic brings. Runs prompts
    of `prompt_lens` tokens (capped by the engine's limits) alone and then packed into one step, each with one
    decode step after it, their sampling `WARMUP_SAMPLING` in turn (the packed step samples every way at
    once); then forgets them (blocks freed, metrics reset). With adapters loaded, the packed group runs once
    more on the first of them (the LoRA kernels of the prefill path). Returns how many requests ran. The
    engine must be idle."""
    if engine.has_unfinished():
        raise EngineError("warm_up needs an idle engine (requests are queued or running)")
    cfg = engine.config
    limit = min(cfg.max_model_len - 2, cfg.max_num_batched_tokens)
    lens = sorted({max(1, min(int(n), limit)) for n in prompt_lens})
    ran = 0
    loaded = [s for s, r in enumerate(engine.lora.ranks) if r] if engine.lora is not None else []
    groups = [([n], 0) for n in lens] + [(lens, 0)] + [(lens, s) for s in loaded[:1]]
    for group, slot in groups:
        for n in group:
            try:
                params = WARMUP_SAMPLING[ran % len(WARMUP_SAMPLING)]
                engine.add_request([3 + (7 * i) % 97 for i in range(n)], params, lora_slot=slot)
                ran += 1
            except RequestRefused:
                continue  # too big for this cache: not a shape it will ever prefill
        engine.run_until_done(partition)
    engine.reset_metrics()
    return ran
