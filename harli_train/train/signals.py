"""SIGINT and SIGTERM held while something runs that must not be cut short: a checkpoint being written."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held_signals(what: str, redeliver: bool = True) -> Iterator[list[int]]:
    """Run the block with SIGINT and SIGTERM held; yields the list of the signals held so far.

    A signal arriving meanwhile is logged (naming ``what``, the thing being written) and remembered. When the
    block completes, the previous handlers come back and, with ``redeliver``, the first signal held is raised
    again: it then acts as if it had arrived just after the block. Without ``redeliver`` it is dropped, for a
    caller that is stopping anyway. If the block raises, nothing is redelivered: its error goes on. Off the
    main thread, where Python runs no signal handlers, the block simply runs.
    """
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        held.append(signum)
        log.warning(
            "%s arrived while writing %s; stopping once that is done", signal.Signals(signum).name, what
        )

    previous = {s: signal.signal(s, hold) for s in HELD}
    try:
        yield held
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
    if held and redeliver:
        signal.raise_signal(held[0])
