"""DecodeCore: the decode thread on a CPU core of its own while the co-located loop serves.

A decode step's token interval includes the decode thread's host work, and that thread holds the GIL while
it runs: if the OS takes its core away (another runnable thread, of this process or not, is placed there),
the step's interval grows by a scheduler slice, milliseconds, and no other Python thread runs meanwhile
either. ``DecodeCore`` gives the decode thread one core that none of the process's other threads may use
(their affinity is the rest, less that core's hyperthread siblings where there are others), and the decode
thread no other core: the trainer thread, the KV resizer, torch's worker threads and the driver's threads
run on the remaining cores. What other processes and the kernel do on that core is not this process's to
change.

Threads inherit their creator's affinity, so one the decode thread starts inside the block would share its
core: the runtime enters the block after starting its own threads, and the decode thread's torch CPU ops run
on itself alone meanwhile (``host_threads.single_threaded_ops``: an OpenMP team of its own would be created
on its core). On leaving, every thread's affinity is put back. Without at least two usable cores, or where
the OS refuses (no ``sched_setaffinity``), it does nothing and says so.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from harli_train.host_threads import single_threaded_ops, thread_ops

log = logging.getLogger(__name__)


class DecodeCore:
    """While entered (on the decode thread), that thread alone runs on ``core`` and the process's other
    threads on the rest of the CPUs the process may use. ``core``: the highest of them unless named."""

    def __init__(self, core: int | None = None) -> None:
        self.core = core
        self.active = False
        self._saved: dict[int, set[int]] = {}  # thread id -> its affinity before
        self._omp_threads = 1

    def __enter__(self) -> DecodeCore:
        me = threading.get_native_id()
        try:
            allowed = os.sched_getaffinity(0)
        except (AttributeError, OSError) as err:
            log.warning(
                "decode core: the CPU affinity cannot be read here (%s); threads left as they are", err
            )
            return self
        core = max(allowed) if self.core is None else self.core
        if len(allowed) < 2 or core not in allowed:
            log.warning(
                "decode core: needs two usable CPUs and core %d among them (usable: %s); "
                "threads left as they are",
                core,
                sorted(allowed),
            )
            return self
        rest = allowed - _siblings(core) or allowed - {core}
        for tid in _threads():
            try:
                before = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {core} if tid == me else (before & rest or rest))
            except ProcessLookupError:
                continue  # a thread that ended meanwhile
            except OSError as err:
                log.warning(
                    "decode core: the OS refused a thread's affinity (%s); threads left as they are", err
                )
                self._restore()
                return self
            self._saved[tid] = before
        self.core, self.active = core, True
        self._omp_threads = torch.get_num_threads()
        single_threaded_ops()  # an OpenMP team made now would inherit the decode thread's one core
        log.info(
            "decode core: the decode thread on CPU %d, %d other threads on %s",
            core,
            len(self._saved) - 1,
            sorted(rest),
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.active:
            return
        self._restore()
        self.active = False
        thread_ops(self._omp_threads)  # the decode thread's OpenMP team back to its size before

    def _restore(self) -> None:
        for tid, before in self._saved.items():
            try:
                os.sched_setaffinity(tid, before)
            except OSError:
                pass  # the thread has ended
        self._saved.clear()


def _siblings(cpu: int) -> set[int]:
    """``cpu`` and the CPUs that share its physical core (hyperthreads), from sysfs; ``{cpu}`` if unknown."""
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out | {cpu}


def _threads() -> list[int]:
    """The process's thread ids, from /proc/self/task."""
    return [int(t) for t in os.listdir("/proc/self/task")]
