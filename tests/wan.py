"""A WAN on loopback for benchmarks: a user-space TCP proxy per link that delays every byte by a
fixed one-way latency (each direction) and paces it to a bandwidth cap.

This kernel has no ``tc netem``, so latency is added in user space: each chunk read from one side
is written to the other ``one_way_s`` after it arrived (plus its serialization time at
``bytes_per_s``), in order. A node started with ``--public-url`` pointing at its proxy is reached
only through it — by the gateway and by the hop before it — so every seam of a route pays the
link's round trip per request, as it would between machines.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["DelayProxy", "delay_proxy"]

_READ = 1 << 16


class DelayProxy:
    """Listens on 127.0.0.1 (an ephemeral port) and forwards to ``target_port`` with a delay."""

    def __init__(self, target_port: int, one_way_s: float, bytes_per_s: float | None = None) -> None:
        self.target_port = target_port
        self.one_way_s = one_way_s
        self.bytes_per_s = bytes_per_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> DelayProxy:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        self.port = future.result(timeout=10)
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except asyncio.CancelledError:
            pass  # the proxy is stopping: the link goes down with it, not an error to report
        finally:
            for w in (writer, up_writer):
                w.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy ``reader`` to ``writer``, each chunk delivered ``one_way_s`` (plus pacing) after it arrived."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        free_at = 0.0  # when the capped link has sent everything queued so far

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.write_eof()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(_READ):
                now = time.monotonic()
                if self.bytes_per_s:
                    free_at = max(free_at, now) + len(data) / self.bytes_per_s
                    due = free_at + self.one_way_s
                else:
                    due = now + self.one_way_s
                queue.put_nowait((due, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(ConnectionError, OSError):
                await sender


@contextlib.contextmanager
def delay_proxy(target_port: int, one_way_s: float, bytes_per_s: float | None = None) -> Iterator[DelayProxy]:
    proxy = DelayProxy(target_port, one_way_s, bytes_per_s).start()
    try:
        yield proxy
    finally:
        proxy.stop()
