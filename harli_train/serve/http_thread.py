"""The HTTP front end on a thread of its own (its own asyncio loop), for when another thread owns the engine:
co-located, the co-location runtime's loop drives the request port; this thread only answers HTTP."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

from aiohttp import web

log = logging.getLogger(__name__)


class HttpThread:
    """``start()`` listens on ``host:port`` (0: any free port) and returns the port; ``stop()`` stops
    listening and gives running requests ``grace_s`` to end."""

    def __init__(self, server, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 10.0) -> None:
        self.server, self.host, self.grace_s = server, host, grace_s
        self._sock = socket.create_server((host, port))
        self.port = self._sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="harli-http", daemon=True)

    def start(self) -> int:
        self._thread.start()
        self._ready.wait()
        log.info("serving %s on http://%s:%d/v1", ", ".join(self.server.models), self.host, self.port)
        return self.port

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def up() -> None:
            self._runner = web.AppRunner(self.server.app(), handle_signals=False)
            await self._runner.setup()
            await web.SockSite(self._runner, self._sock, shutdown_timeout=self.grace_s).start()

        self._loop.run_until_complete(up())
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def down() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self._loop).result(timeout=self.grace_s + 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
