"""The process groups of a tensor-parallel job, and how its N ranks come to exist.

Four groups over the same N ranks, so that the two sides of a co-located run never wait on each other:
``engine`` carries the decode model's collectives (NCCL on GPUs, gloo on CPUs) and ``engine_ctl`` rank 0's
step metadata (always gloo: it is host data); ``train`` and ``train_ctl`` are the trainer's pair. A
collective of one pair never queues behind one of the other, on the host (separate gloo contexts) or on the
GPU (separate NCCL communicators, each with its own internal stream).

``spawn`` starts the ranks with torch.multiprocessing on one host; under ``torchrun`` (RANK, WORLD_SIZE and
MASTER_ADDR set) ``from_env`` joins the job torchrun made instead.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from harli_train.model.config import ModelConfig, ModelError

TIMEOUT = datetime.timedelta(minutes=10)  # a rank that hangs this long in a collective fails the job
REPEAT_S = 1.0  # a signal again within this long is the same one, sent to the command and to its group


@dataclass(slots=True)
class TPGroups:
    """This process's place in a tensor-parallel job of ``world`` ranks."""

    rank: int
    world: int
    device: torch.device
    engine: Any  # dist.ProcessGroup: decode tensors
    engine_ctl: Any  # gloo: rank 0's step metadata
    train: Any  # trainer tensors
    train_ctl: Any  # gloo: rank 0's trainer commands

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def check_tensor_parallel(cfg: ModelConfig, n: int, model: str, on_gpu: bool) -> None:
    """ModelError unless ``model`` (of shape ``cfg``) can be split over ``n`` ranks here: n >= 1, dividing
    its attention heads, KV heads and intermediate size, and at most the GPUs present."""
    if n < 1:
        raise ModelError(f"--tensor-parallel {n}: expected a positive number of ranks")
    sizes = {
        "attention heads": cfg.num_heads,
        "KV heads": cfg.num_kv_heads,
        "intermediate size": cfg.intermediate_size,
    }
    bad = {k: v for k, v in sizes.items() if v % n}
    if bad:
        shape = ", ".join(f"{k} {v}" for k, v in sizes.items())
        names = list(bad)
        which = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        raise ModelError(f"--tensor-parallel {n}: must divide the {which} of model {model!r} ({shape})")
    if on_gpu and n > torch.cuda.device_count():
        raise ModelError(f"--tensor-parallel {n}: this machine has {torch.cuda.device_count()} GPU(s)")


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_groups(rank: int, world: int, on_gpu: bool, init_method: str | None = None) -> TPGroups:
    """Join the job as ``rank`` of ``world`` (rendezvous at ``init_method``, default the environment's
    MASTER_ADDR/PORT) and create the four groups. On a GPU the rank's device is its local rank's."""
    device = torch.device("cpu")
    if on_gpu:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    backend = "nccl" if on_gpu else "gloo"
    kwargs: dict[str, Any] = {"rank": rank, "world_size": world, "timeout": TIMEOUT}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if on_gpu:
        kwargs["device_id"] = device
    dist.init_process_group(backend, **kwargs)
    ranks = list(range(world))
    return TPGroups(
        rank,
        world,
        device,
        engine=dist.new_group(ranks, backend=backend),
        engine_ctl=dist.new_group(ranks, backend="gloo"),
        train=dist.new_group(ranks, backend=backend),
        train_ctl=dist.new_group(ranks, backend="gloo"),
    )


def from_env(on_gpu: bool) -> TPGroups:
    """The groups of a job torchrun started (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
    return init_groups(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), on_gpu)


def close_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, on_gpu: bool, address: str, fn: Callable, args: tuple) -> None:
    # A process group of the ranks' own: a signal to the command's group (a terminal's Ctrl-C, `timeout`,
    # systemd) reaches the spawning process alone, which hands it to rank 0 once.
    os.setpgrp()
    if rank == 0:
        _stop_with_parent()
    groups = init_groups(rank, world, on_gpu, init_method=address)
    try:
        fn(groups, *args)
    finally:
        close_groups()
    # The rank's work is done and written (fn reports through files). Leave without the interpreter's
    # finalization: a torch.distributed C++ thread still joinable there (one a daemon thread's collective
    # left behind) aborts the process with "terminate called without an active exception".
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stop_with_parent() -> None:
    """Linux: SIGTERM this process (rank 0, which then stops the job as asked) when its parent dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn(fn: Callable[..., None], world: int, on_gpu: bool, args: tuple = ()) -> None:
    """Run ``fn(groups, *args)`` on ``world`` new processes of this host, one per rank, and wait for them.

    The ranks run in a process group of their own; SIGINT and SIGTERM sent to this process (or to its
    group: a terminal's Ctrl-C) go to rank 0, which stops the job (a second Ctrl-C, as on one process, stops
    it at once; the same signal again within ``REPEAT_S``, as `timeout` sends it to the command and to its
    group, is passed on once); rank 0 gets SIGTERM if this process dies. A rank that raises or dies makes
    the others be terminated (torch.multiprocessing's join), and this raises
    torch.multiprocessing.spawn.ProcessException naming the rank; ``fn`` reports its own errors through
    whatever its args give it (``parallel.command`` uses a result file per rank).
    """
    import torch.multiprocessing as mp

    address = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.start_processes(
        _entry, args=(world, on_gpu, address, fn, args), nprocs=world, join=False, start_method="spawn"
    )
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    last: dict[int, float] = {}

    def forward(signum: int, frame: Any) -> None:
        # `timeout` and systemd signal the command and then its group: this process gets the signal twice at
        # once, and rank 0 must get it once (a second one stops it at once, mid-shutdown). A repeat later on
        # (a second Ctrl-C) is passed on.
        now = time.monotonic()
        if now - last.get(signum, -math.inf) >= REPEAT_S:
            os.kill(ctx.processes[0].pid, signum)
        last[signum] = now

    if in_main:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, forward)
    try:
        while not ctx.join():
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
