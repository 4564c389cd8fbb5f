"""Decode-latency profiles: timed on the GPU once, stored as JSON keyed by hardware and software.

A profile holds the median latency of real decode steps over a grid of batch size, KV length and SM
share, and of mixed steps (decode rows plus a prefill chunk) over a grid of chunk sizes and contexts, alone
and beside representative trainer micro-steps; the predictor is fitted to it. A profile is
only reused when its key (GPU, SM count, model, torch, triton, driver, harli-train) matches the machine
exactly: a stale, corrupt or incomplete file raises ``ProfileError`` with the reason, and
``get_or_build_profile`` re-profiles instead of using it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from harli_train.colocate.mixed_model import attention_pairs
from harli_train.colocate.sm import Partition, SMLadder

log = logging.getLogger(__name__)

FORMAT, VERSION = "harli-train-profile", 2  # 2: mixed-step samples
DEFAULT_BATCHES = (1, 8, 32, 64, 128)
DEFAULT_KV_LENS = (512, 1024, 2048)
SAMPLE_FIELDS = {"batch": int, "kv_tokens": int, "infer_sms": int, "corun": bool, "latency_s": float}
MIXED_FIELDS = {"prefill_tokens": int, "attn_pairs": int}  # and SAMPLE_FIELDS, in a mixed-step sample


@dataclass(frozen=True, slots=True)
class MixedGrid:
    """Mixed steps to time per share: ``batches`` decode rows over ``kv_len`` tokens each, beside one prefill
    chunk of each of ``tokens`` after each of ``contexts`` cached tokens; beside the trainer too for the
    ``corun_batches`` (the slowdown is one factor per share: a few points pin it). Each point is timed
    ``reps`` times after ``warmup`` (a mixed step is long and steady)."""

    batches: tuple[int, ...] = (8, 32)
    kv_len: int = 512
    tokens: tuple[int, ...] = (64, 192, 512)
    contexts: tuple[int, ...] = (0, 768)
    corun_batches: tuple[int, ...] = (32,)
    warmup: int = 2
    reps: int = 5

    def points(self) -> list[tuple[int, int, int]]:
        return [(b, n, c) for b in self.batches for n in self.tokens for c in self.contexts]


class ProfileError(RuntimeError):
    """A profile file that must not be used; ``reason`` is missing, corrupt, invalid or stale."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ProfileKey:
    """Everything a decode-latency profile depends on; any difference means re-profiling."""

    gpu_name: str
    sm_count: int
    model_id: str
    torch_version: str
    triton_version: str
    driver_version: str
    harli_version: str

    @classmethod
    def current(cls, model_id: str, device: int = 0, sm_count: int | None = None) -> ProfileKey:
        """The key of this machine (a CPU host gives ``gpu_name="cpu"`` and the given ``sm_count``)."""
        import torch

        from harli_train import __version__

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(device)
            gpu, sms = props.name, props.multi_processor_count
        else:
            gpu, sms = "cpu", sm_count or 0
        return cls(
            gpu,
            int(sms),
            model_id,
            torch.__version__,
            _package_version("triton"),
            _driver_version(),
            __version__,
        )

    def describe(self) -> str:
        return (
            f"{self.gpu_name} ({self.sm_count} SMs), model {self.model_id}, torch {self.torch_version}, "
            f"triton {self.triton_version}, driver CUDA {self.driver_version}, "
            f"harli-train {self.harli_version}"
        )

    def differences(self, other: ProfileKey) -> list[str]:
        return [
            f"{f.name} {getattr(self, f.name)!r} -> {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


@dataclass(slots=True)
class Profile:
    """Timed decode steps: each sample is ``{batch, kv_tokens, infer_sms, corun, latency_s, ...}``."""

    key: ProfileKey
    samples: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def shares(self) -> list[int]:
        return sorted({int(s["infer_sms"]) for s in self.samples})


def save_profile(path: str | os.PathLike, profile: Profile) -> None:
    """Write atomically (a crash leaves the old file or the new one, never half of one)."""
    _validate_samples(profile.samples, profile.key.sm_count, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "key": asdict(profile.key),
        "meta": profile.meta,
        "samples": profile.samples,
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def load_profile(
    path: str | os.PathLike, expected_key: ProfileKey | None = None, required_shares: Iterable[int] = ()
) -> Profile:
    """Read and validate a profile; ``ProfileError`` says what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"no profile at {path}", "missing")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ProfileError(f"profile {path} is corrupt (not valid JSON: {err})", "corrupt") from err
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ProfileError(f"{path} is not a harli-train profile (no format: {FORMAT!r})", "invalid")
    if doc.get("version") != VERSION:
        raise ProfileError(
            f"profile {path} has format version {doc.get('version')}, expected {VERSION}", "stale"
        )
    missing = [k for k in ("key", "samples") if k not in doc]
    raw_key = doc.get("key") if isinstance(doc.get("key"), dict) else {}
    missing += [f"key.{f.name}" for f in fields(ProfileKey) if f.name not in raw_key]
    if missing:
        raise ProfileError(f"profile {path} lacks {', '.join(missing)}", "invalid")
    bad = [
        f"key.{f.name}={raw_key[f.name]!r}"
        for f in fields(ProfileKey)
        if not isinstance(raw_key[f.name], int if f.name == "sm_count" else str)
    ]
    if bad:
        raise ProfileError(f"profile {path} has malformed {', '.join(bad)}", "invalid")
    key = ProfileKey(**{f.name: raw_key[f.name] for f in fields(ProfileKey)})
    if expected_key is not None and key != expected_key:
        raise ProfileError(
            f"profile {path} was made on {key.describe()}; this is {expected_key.describe()} "
            f"(differs in {'; '.join(key.differences(expected_key))})",
            "stale",
        )
    samples = doc["samples"]
    _validate_samples(samples, key.sm_count, str(path))
    profile = Profile(key, samples, doc.get("meta") or {})
    lacking = sorted(set(required_shares) - set(profile.shares))
    if lacking:
        raise ProfileError(f"profile {path} covers SM shares {profile.shares}, not {lacking}", "stale")
    return profile


def _validate_samples(samples: Any, sm_count: int, where: str) -> None:
    if not isinstance(samples, list) or not samples:
        raise ProfileError(f"profile {where} has no samples", "invalid")
    for i, s in enumerate(samples):
        if not isinstance(s, dict):
            raise ProfileError(f"profile {where}: sample {i} is not an object", "invalid")
        for name, kind in {**SAMPLE_FIELDS, **(MIXED_FIELDS if "prefill_tokens" in s else {})}.items():
            v = s.get(name)
            ok = (
                isinstance(v, bool)
                if kind is bool
                else isinstance(v, (int, float)) and not isinstance(v, bool)
            )
            if not ok:
                raise ProfileError(
                    f"profile {where}: sample {i} has {name}={v!r}, expected {kind.__name__}", "invalid"
                )
        lat = s["latency_s"]
        if not (math.isfinite(lat) and lat > 0) or s["batch"] < 1 or s["kv_tokens"] < 0:
            raise ProfileError(f"profile {where}: sample {i} is out of range: {s}", "invalid")
        if s["infer_sms"] < 1 or (sm_count and s["infer_sms"] > sm_count):
            raise ProfileError(
                f"profile {where}: sample {i} uses {s['infer_sms']} of {sm_count} SMs", "invalid"
            )


def get_or_build_profile(
    path: str | os.PathLike,
    key: ProfileKey,
    build_fn: Callable[[], Profile | list[dict[str, Any]]],
    required_shares: Iterable[int] = (),
) -> Profile:
    """The stored profile when it matches ``key``; otherwise say why, re-profile and store the result."""
    path = Path(path)
    required = list(required_shares)
    try:
        return load_profile(path, key, required)
    except ProfileError as err:
        if err.reason == "missing":
            log.info("%s: profiling", err)
        else:
            log.warning("%s: re-profiling", err)
            os.replace(path, path.with_name(path.name + ".rejected"))  # kept for a post-mortem
    built = build_fn()
    profile = built if isinstance(built, Profile) else Profile(key, list(built))
    if profile.key != key:
        raise ProfileError(
            f"the re-profile was made for {profile.key.describe()}, not {key.describe()}", "stale"
        )
    save_profile(path, profile)
    return load_profile(path, key, required)


def default_profile_path(key: ProfileKey, root: str | os.PathLike | None = None) -> Path:
    """``$HARLI_PROFILE_DIR`` (or ~/.cache/harli-train/profiles)/<gpu>-<model>.json."""
    base = Path(root or os.environ.get("HARLI_PROFILE_DIR") or Path.home() / ".cache/harli-train/profiles")
    slug = "".join(c if c.isalnum() or c in "-._" else "_" for c in f"{key.gpu_name}-{key.model_id}")
    return base / f"{slug}.json"


# --- timing the grid -----------------------------------------------------------------------------------

DecodeStepFn = Callable[[int, int, Partition], Any]  # (batch, kv_len, partition): enqueue one decode step
# (batch, kv_len, prefill tokens, prefill context, partition): enqueue one mixed step
MixedStepFn = Callable[[int, int, int, int, Partition], Any]
CorunFn = Callable[[Partition], Any]  # (partition): enqueue one trainer micro-step on partition.train_stream


def run_profile_grid(
    decode_step_fn: DecodeStepFn,
    corun_fn: CorunFn | None,
    ladder: SMLadder,
    batches: Sequence[int] = DEFAULT_BATCHES,
    kv_lens: Sequence[int] = DEFAULT_KV_LENS,
    shares: Iterable[int] | None = None,
    warmup: int = 3,
    reps: int = 10,
    mixed_step_fn: MixedStepFn | None = None,
    mixed_grid: MixedGrid | None = None,
    lora_slots: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """Median latency of decode steps per (partition, batch, kv_len), and of mixed steps per (partition,
    ``mixed_grid`` point) when ``mixed_step_fn`` is given, alone and beside the trainer. With ``lora_slots``
    (adapter counts, e.g. (1, 2)): decode steps of the middle batch at the shortest KV length whose rows run
    on that many adapters, alone (``decode_step_fn(b, kv, partition, n)``), for ``LoRACost``.

    ``decode_step_fn`` and ``mixed_step_fn`` must launch on ``partition.infer_stream`` and ``corun_fn`` on
    ``train_stream``
    (GPU: both asynchronously; timed with CUDA events). On the CPU stand-in the calls run synchronously,
    are timed with ``perf_counter`` and the trainer loops in a thread.
    """
    wanted = None if shares is None else set(shares)
    parts = [p for p in ladder.partitions if wanted is None or p.infer_sms in wanted]
    samples = []
    for p in parts:
        corun = corun_fn is not None and p.train_sms > 0 and not p.time_sliced
        t_train = (
            _median(_time_calls(lambda p=p: corun_fn(p), p.train_stream, warmup, reps)) if corun else None
        )
        # (batch, kv_len, chunk or None, timing reps, warm-up, beside the trainer too)
        points: list[tuple] = [(b, kv, None, reps, warmup, corun) for b in batches for kv in kv_lens]
        b_lora = list(batches)[len(batches) // 2]
        points += [(b_lora, min(kv_lens), ("lora", n), reps, warmup, False) for n in lora_slots if n > 0]
        if mixed_step_fn is not None:
            g = mixed_grid or MixedGrid()
            points += [
                (b, g.kv_len, (n, c), g.reps, g.warmup, corun and b in g.corun_batches)
                for b, n, c in g.points()
            ]
        for b, kv, chunk, n_reps, n_warm, beside in points:
            base = {
                "batch": b,
                "kv_len": kv,
                "kv_tokens": b * kv,
                "infer_sms": p.infer_sms,
                "train_sms": p.train_sms,
            }
            if chunk is None:
                step = lambda b=b, kv=kv, p=p: decode_step_fn(b, kv, p)
            elif chunk[0] == "lora":
                step = lambda b=b, kv=kv, p=p, n=chunk[1]: decode_step_fn(b, kv, p, n)
                base["lora_slots"] = chunk[1]
            else:
                n, c = chunk
                step = lambda b=b, kv=kv, n=n, c=c, p=p: mixed_step_fn(b, kv, n, c, p)
                base.update(prefill_tokens=n, prefill_context=c, attn_pairs=attention_pairs([(n, c)]))
            t_solo = _median(_time_calls(step, p.infer_stream, n_warm, n_reps))
            samples.append({**base, "corun": False, "latency_s": t_solo})
            if beside:
                trainer = _Trainer(corun_fn, p, t_solo * (n_warm + n_reps), t_train)
                t_co = _median(_time_calls(step, p.infer_stream, n_warm, n_reps, trainer))
                samples.append({**base, "corun": True, "latency_s": t_co, "train_step_s": t_train})
        log.info("profiled %d/%d SMs: %d samples so far", p.infer_sms, p.train_sms, len(samples))
    return samples


def build_profile(
    key: ProfileKey,
    decode_step_fn: DecodeStepFn,
    corun_fn: CorunFn | None,
    ladder: SMLadder,
    kv_bytes_per_token: float,
    **grid: Any,
) -> Profile:
    """Run the grid and wrap it with what the predictor needs (``kv_bytes_per_token``) and provenance."""
    t0 = time.time()
    samples = run_profile_grid(decode_step_fn, corun_fn, ladder, **grid)
    meta = {
        "kv_bytes_per_token": kv_bytes_per_token,
        "ladder": ladder.describe(),
        "ladder_kind": ladder.kind,
        "created_unix": t0,
        "profile_seconds": time.time() - t0,
        "grid": {
            k: asdict(v) if isinstance(v, MixedGrid) else list(v) if isinstance(v, (list, tuple)) else v
            for k, v in grid.items()
            if not callable(v)
        },
    }
    return Profile(key, samples, meta)


class _Trainer:
    """Keeps the trainer busy on its stream for at least ``seconds`` while decode is timed."""

    def __init__(self, corun_fn: CorunFn, part: Partition, seconds: float, t_step: float | None) -> None:
        self.fn, self.part = corun_fn, part
        self.n = min(int(2.0 * seconds / max(t_step or seconds, 1e-6)) + 2, 5000)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_gpu: bool) -> None:
        if on_gpu:  # queue enough micro-steps ahead of the decode steps to overlap all of them
            import torch

            with torch.cuda.stream(self.part.train_stream):
                for _ in range(self.n):
                    self.fn(self.part)
            return
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.fn(self.part)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def fastest_step_s(
    decode_step_fn: DecodeStepFn, partition: Partition, batch: int = 1, kv_len: int = 1, reps: int = 5
) -> float:
    """The least latency of ``reps`` decode steps of ``batch`` x ``kv_len`` on ``partition`` alone, after a
    warm-up of as many (the least, not the median: a busy host only ever slows a step down)."""
    step = lambda: decode_step_fn(batch, kv_len, partition)
    return min(_time_calls(step, partition.infer_stream, warmup=reps, reps=reps))


def _time_calls(
    call: Callable[[], Any], stream: Any, warmup: int, reps: int, trainer: _Trainer | None = None
):
    on_gpu = _is_cuda_stream(stream)
    if trainer is not None:
        trainer.start(on_gpu)
    try:
        if not on_gpu:
            for _ in range(warmup):
                call()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            return times
        import torch

        with torch.cuda.stream(stream):
            for _ in range(warmup):
                call()
            marks = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                call()
                end.record(stream)
                marks.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e-3 for s, e in marks]
    finally:
        if trainer is not None:
            trainer.stop()


def median_step_s(call: Callable[[], Any], stream: Any, warmup: int = 3, reps: int = 10) -> float:
    """Median seconds of ``call`` (which launches one step on ``stream``) over ``reps`` runs after ``warmup``:
    CUDA events on a GPU stream, the host clock on a CPU stand-in."""
    return _median(_time_calls(call, stream, warmup, reps))


def _is_cuda_stream(stream: Any) -> bool:
    try:
        import torch
    except ImportError:
        return False
    return isinstance(stream, torch.cuda.Stream)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "none"


def _driver_version() -> str:
    try:
        from cuda.bindings import driver as cu

        err, v = cu.cuDriverGetVersion()
        return f"{v // 1000}.{v % 1000 // 10}" if err == cu.CUresult.CUDA_SUCCESS else "none"
    except Exception:  # no cuda-bindings or no libcuda on this host
        return "none"
