"""A small HTTP file server that answers Range requests: the BEP 19 web seed of a published model.

``python -m http.server`` ignores ``Range`` and answers every request with the whole file, which a
BitTorrent web seed cannot use. This server answers ``GET``/``HEAD`` with ``206 Partial Content``
for one ``bytes=A-B`` range (multi-range requests get the whole file, as RFC 9110 allows), refuses
paths outside its root, and binds where it is told (127.0.0.1 by default).

Concurrency: one thread per connection (``ThreadingHTTPServer``); files are opened per request.
"""

from __future__ import annotations

import contextlib
import http.server
import re
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["RangeServer", "serve_directory"]

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_CHUNK = 1 << 20


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: libtorrent reuses the connection for many ranges

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def _answer(self, *, body: bool) -> None:
        path = self._resolve()
        if path is None:
            self.send_error(404, "not found")
            return
        size = path.stat().st_size
        start, stop = 0, size
        status = 200
        header = self.headers.get("Range")
        if header:
            match = _RANGE.match(header.strip())
            if match and (match.group(1) or match.group(2)):
                first, last = match.group(1), match.group(2)
                if first:
                    start = int(first)
                    stop = min(size, int(last) + 1) if last else size
                else:  # a suffix range: the last N bytes
                    start = max(0, size - int(last))
                if start >= size or start >= stop:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(stop - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.end_headers()
        if not body:
            return
        with path.open("rb") as f, contextlib.suppress(BrokenPipeError, ConnectionResetError):
            f.seek(start)
            left = stop - start
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)

    def _resolve(self) -> Path | None:
        rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        root = self.server.root
        path = (root / rel).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            return None
        return path


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    root: Path
    verbose: bool


class RangeServer:
    """Serves ``root`` on ``host:port`` (port 0 picks a free one) from a background thread."""

    def __init__(self, root: Path, *, host: str = "127.0.0.1", port: int = 0, verbose: bool = False) -> None:
        self._server = _Server((host, port), _Handler)
        self._server.root = root.resolve()
        self._server.verbose = verbose
        self._thread = threading.Thread(target=self._server.serve_forever, name="meshnet-webseed", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> RangeServer:
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(10)
        self._server.server_close()


@contextlib.contextmanager
def serve_directory(root: Path, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[RangeServer]:
    server = RangeServer(root, host=host, port=port).start()
    try:
        yield server
    finally:
        server.close()
