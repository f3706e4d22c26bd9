"""A WAN on loopback for benchmarks: a user-space TCP proxy per link that delays every byte by a
fixed one-way latency (each direction) and paces it to a bandwidth cap.

This kernel has no ``tc netem``, so latency is added in user space: each chunk read from one side
is written to the other ``one_way_s`` after it arrived (plus its serialization time at
``bytes_per_s``), in order. A node started with ``--public-url`` pointing at its proxy is reached
only through it — by the gateway and by the hop before it — so every seam of a route pays the
link's round trip per request, as it would between machines.

Each direction of a connection is two threads over blocking sockets: one reads and stamps each
chunk with its due time, the other sleeps until that time and writes it. A thread's sleep ends
within tens of microseconds of its due time, where an event loop's timers (epoll waits in whole
milliseconds, rounded up) delivered each chunk 0.46 ms late on average: 1.4 ms a token more than
the link it stands for on a 3-seam route, which the benchmarks would have counted against the route.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator

__all__ = ["DelayProxy", "delay_proxy"]

_READ = 1 << 16
_POLL_S = 0.25  # how often a waiting thread looks whether the proxy is stopping
_CONNECT_TIMEOUT_S = 10.0
_JOIN_S = 5.0


class _Connection:
    """A proxied connection's two sockets, closed once both directions have ended."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.sockets = (client, upstream)
        self._open = 2
        self._lock = threading.Lock()

    def ended(self) -> None:
        with self._lock:
            self._open -= 1
            last = self._open == 0
        if last:
            for sock in self.sockets:
                sock.close()


class _Pipe:
    """One direction of a connection: chunks read from ``source`` are written to ``sink`` when due."""

    def __init__(self, proxy: DelayProxy, connection: _Connection, source: socket.socket, sink: socket.socket) -> None:
        self.proxy, self.connection, self.source, self.sink = proxy, connection, source, sink
        self._queue: deque[tuple[float, bytes]] = deque()  # (due, chunk); an empty chunk: the end
        self._ready = threading.Condition()
        self._free_at = 0.0  # when the capped link has sent everything queued so far
        self.reading = threading.Thread(target=self._read, name="delay-proxy-read", daemon=True)
        self.writing = threading.Thread(target=self._write, name="delay-proxy-write", daemon=True)

    def start(self) -> None:
        self.reading.start()
        self.writing.start()

    def _read(self) -> None:
        try:
            while data := self.source.recv(_READ):
                self._put(data)
        except OSError:
            pass  # the connection or the proxy went down: the other side is told below
        finally:
            self._put(b"")

    def _put(self, data: bytes) -> None:
        now = time.monotonic()
        if self.proxy.bytes_per_s and data:
            self._free_at = max(self._free_at, now) + len(data) / self.proxy.bytes_per_s
            now = self._free_at
        with self._ready:
            self._queue.append((now + self.proxy.one_way_s, data))
            self._ready.notify()

    def _write(self) -> None:
        """Deliver each chunk when due, then the end; a sink that fails ends the source too."""
        try:
            while not self.proxy.stopping.is_set():
                with self._ready:
                    if not self._queue:
                        self._ready.wait(_POLL_S)
                        continue
                    due, data = self._queue.popleft()
                while (left := due - time.monotonic()) > 0 and not self.proxy.stopping.is_set():
                    time.sleep(min(left, _POLL_S))
                if not data:
                    self.sink.shutdown(socket.SHUT_WR)
                    break
                self.sink.sendall(data)
        except OSError:
            with contextlib.suppress(OSError):
                self.source.shutdown(socket.SHUT_RD)  # its reader stops: nothing more goes anywhere
        finally:
            self.reading.join(_JOIN_S)
            self.connection.ended()


class DelayProxy:
    """Listens on 127.0.0.1 (an ephemeral port) and forwards to ``target_port`` with a delay."""

    def __init__(self, target_port: int, one_way_s: float, bytes_per_s: float | None = None) -> None:
        self.target_port = target_port
        self.one_way_s = one_way_s
        self.bytes_per_s = bytes_per_s
        self.port = 0
        self.stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._accepting = threading.Thread(target=self._accept, name="delay-proxy-accept", daemon=True)
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> DelayProxy:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(_POLL_S)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._accepting.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self._accepting.join(_JOIN_S)
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the threads reading it
        for thread in threads:
            thread.join(_JOIN_S)
        for sock in sockets:
            sock.close()
        if self._listener is not None:
            self._listener.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self.stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=_CONNECT_TIMEOUT_S)
            except OSError:
                client.close()  # nothing listens behind the proxy: the link is down
                continue
            for sock in (client, upstream):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(client, upstream)
            pipes = [_Pipe(self, connection, client, upstream), _Pipe(self, connection, upstream, client)]
            with self._lock:  # (what connections that ended left behind is let go)
                self._threads = [t for t in self._threads if t.is_alive()]
                self._sockets = [s for s in self._sockets if s.fileno() >= 0]
                self._sockets += [client, upstream]
                self._threads += [t for pipe in pipes for t in (pipe.reading, pipe.writing)]
            for pipe in pipes:
                pipe.start()


@contextlib.contextmanager
def delay_proxy(target_port: int, one_way_s: float, bytes_per_s: float | None = None) -> Iterator[DelayProxy]:
    proxy = DelayProxy(target_port, one_way_s, bytes_per_s).start()
    try:
        yield proxy
    finally:
        proxy.stop()
