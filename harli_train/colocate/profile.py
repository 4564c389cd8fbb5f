"""Decode-latency profiles: timed on the GPU once, stored as JSON keyed by hardware and software.

A profile holds the median latency of real decode steps over a grid of batch size, KV length and SM
share, and of mixed steps (decode rows plus a prefill chunk) over a grid of chunk sizes and contexts, alone
and beside representative trainer micro-steps; the predictor is fitted to it. A profile is
only reused when its key (GPU, SM count, model, torch, triton, driver, harli-train) matches the machine
exactly, and its ``meta`` records what the caller requires (how the trainer beside decode was run): a stale,
corrupt or incomplete file raises ``ProfileError`` with the reason, and ``get_or_build_profile`` re-profiles
instead of using it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from harli_train.durable import writable_folder, write_file

log = logging.getLogger(__name__)

FORMAT, VERSION = "harli-train-profile", 5  # 2: mixed-step samples; 3-4: mixed steps on the decode kernels;
# 5: mixed steps in every graph bucket, and the buckets in ``meta``
SAMPLE_FIELDS = {"batch": int, "kv_tokens": int, "infer_sms": int, "corun": bool, "latency_s": float}
MIXED_FIELDS = {"prefill_tokens": int, "attn_pairs": int}  # and SAMPLE_FIELDS, in a mixed-step sample


class ProfileError(RuntimeError):
    """A profile file that must not be used (``reason``: missing, corrupt, invalid or stale) or cannot be
    written (unwritable)."""

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
    """Written durably (``durable.write_file``): a crash leaves the old file or the new one, never half."""
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
    write_file(path, json.dumps(doc, indent=1).encode())


def load_profile(
    path: str | os.PathLike,
    expected_key: ProfileKey | None = None,
    required_shares: Iterable[int] = (),
    required_meta: Mapping[str, Any] | None = None,
) -> Profile:
    """Read and validate a profile; ``ProfileError`` says what is wrong with it (stale: another key, a share
    of ``required_shares`` missing, or a ``required_meta`` entry its meta does not hold)."""
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
    for name, want in (required_meta or {}).items():
        if profile.meta.get(name) != want:
            raise ProfileError(
                f"profile {path} was made with {name}={profile.meta.get(name)!r}; this run needs {want!r}",
                "stale",
            )
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


def check_destination(path: str | os.PathLike) -> None:
    """ProfileError, naming ``path``, when no profile could be written there (a folder, under a file, or in
    a folder this user cannot make or write to): checked before minutes of profiling, not after."""
    path = Path(path)
    cannot = f"cannot write a profile to {path}"
    if path.is_dir():
        raise ProfileError(f"{cannot}: it is a folder", "unwritable")
    try:
        writable_folder(path.parent)
    except NotADirectoryError as err:
        raise ProfileError(f"{cannot}: {err.filename} is a file, not a folder", "unwritable") from None
    except OSError as err:
        raise ProfileError(f"{cannot}: [Errno {err.errno}] {err.strerror}", "unwritable") from None


def get_or_build_profile(
    path: str | os.PathLike,
    key: ProfileKey,
    build_fn: Callable[[], Profile | list[dict[str, Any]]],
    required_shares: Iterable[int] = (),
    required_meta: Mapping[str, Any] | None = None,
) -> Profile:
    """The stored profile when it matches ``key`` (and ``load_profile``'s requirements); otherwise say why,
    re-profile and store the result."""
    path = Path(path)
    required = list(required_shares)
    try:
        return load_profile(path, key, required, required_meta)
    except ProfileError as err:
        if err.reason == "missing":
            log.info("%s: profiling", err)
        else:
            log.warning("%s: re-profiling", err)
            os.replace(path, path.with_name(path.name + ".rejected"))  # kept for a post-mortem
    check_destination(path)
    built = build_fn()
    profile = built if isinstance(built, Profile) else Profile(key, list(built))
    if profile.key != key:
        raise ProfileError(
            f"the re-profile was made for {profile.key.describe()}, not {key.describe()}", "stale"
        )
    save_profile(path, profile)
    return load_profile(path, key, required, required_meta)


def default_profile_path(key: ProfileKey, root: str | os.PathLike | None = None) -> Path:
    """``$HARLI_PROFILE_DIR`` (or ~/.cache/harli-train/profiles)/<gpu>-<model>.json."""
    base = Path(root or os.environ.get("HARLI_PROFILE_DIR") or Path.home() / ".cache/harli-train/profiles")
    slug = "".join(c if c.isalnum() or c in "-._" else "_" for c in f"{key.gpu_name}-{key.model_id}")
    return base / f"{slug}.json"


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
