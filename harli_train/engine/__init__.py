"""The decode engine the trainer co-locates with: paged KV cache, continuous batching, CUDA-graph decode."""

from harli_train.engine.api import build_engine, generate_text, serve_trace
from harli_train.engine.engine import DecodeEngine, RequestRefused, StepResult
from harli_train.engine.engine_config import EngineConfig, EngineError
from harli_train.engine.kv_cache import KVCacheSpec, KVStorage, TensorKVStorage
from harli_train.engine.load import (
    LengthDist,
    TraceError,
    TraceReplay,
    TraceRequest,
    poisson_trace,
    rate_profile_trace,
    read_trace,
)
from harli_train.engine.metrics import EngineMetrics
from harli_train.engine.runner import DEFAULT_PARTITION
from harli_train.engine.sampling_params import SamplingParams
from harli_train.engine.sequence import Sequence, SequenceStatus

__all__ = [
    "DEFAULT_PARTITION",
    "DecodeEngine",
    "EngineConfig",
    "EngineError",
    "EngineMetrics",
    "KVCacheSpec",
    "KVStorage",
    "LengthDist",
    "RequestRefused",
    "SamplingParams",
    "Sequence",
    "SequenceStatus",
    "StepResult",
    "TensorKVStorage",
    "TraceError",
    "TraceReplay",
    "TraceRequest",
    "build_engine",
    "generate_text",
    "poisson_trace",
    "rate_profile_trace",
    "read_trace",
    "serve_trace",
]
