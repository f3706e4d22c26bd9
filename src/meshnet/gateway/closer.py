"""Closing a session until it is closed: the gateway's ``DELETE``s on a route's head and on the
tracker, retried off the request path until acknowledged (issue 28).

A close that is lost leaves a zombie: the session holds its slot on every hop (and its count on
the tracker) until its idle TTL, and concurrent users find the nodes full. A close is lost when
the hop is still computing for the session (409 ``session_busy``: a killed stream's last step), is
briefly unreachable, or answers after the gateway stopped waiting. So:

- the first attempt is made at once, by the caller, with the caller's short timeout: a healthy
  route frees the session (and keeps its prompt blocks) before the stream ends, as before;
- an attempt that is not acknowledged goes to this closer's thread, which retries with
  exponential backoff (``FIRST_RETRY_S`` doubling to ``MAX_RETRY_S``), at most ``ATTEMPTS`` times
  (about two minutes in all), then gives up with a warning: the hop's TTL still frees it;
- acknowledged means 2xx, or 404/410 (nothing left to close); 409, 429, 5xx and transport errors
  are retried; any other 4xx (e.g. a refused ticket) will not change and is given up at once.

Threading: ``close`` may be called from any thread; one daemon thread owns the retries and its own
HTTP client. At most ``MAX_PENDING`` closes wait (the oldest is dropped, with a warning).
"""

from __future__ import annotations

import collections
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

__all__ = ["ATTEMPTS", "SessionCloser", "acknowledged"]

_log = logging.getLogger("meshnet.gateway")

ATTEMPTS = 8  # the first one included
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 30.0
MAX_PENDING = 4096
_RETRIED = frozenset({408, 409, 425, 429})


def acknowledged(status: int) -> bool | None:
    """True: closed (or nothing to close); False: retry; None: give up (it will not change)."""
    if status < 300 or status in (404, 410):
        return True
    if status in _RETRIED or status >= 500:
        return False
    return None


@dataclass
class _Close:
    url: str
    headers: dict[str, str]
    attempts: int
    due: float


class SessionCloser:
    def __init__(
        self,
        tls: ssl.SSLContext | None = None,
        *,
        attempts: int = ATTEMPTS,
        first_retry_s: float = FIRST_RETRY_S,
        max_retry_s: float = MAX_RETRY_S,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tls = tls
        self.attempts = attempts
        self.first_retry_s = first_retry_s
        self.max_retry_s = max_retry_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._pending: collections.deque[_Close] = collections.deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._working = 0  # a close the thread took and is attempting: still pending
        self.given_up = 0  # closes abandoned after every attempt (or refused for good)

    def close(self, url: str, headers: dict[str, str], *, client: httpx.Client, timeout_s: float) -> bool:
        """``DELETE url`` now with ``client`` (waiting at most ``timeout_s``); retried from the
        closer's thread if not acknowledged. Whether it was acknowledged at once."""
        done = self._attempt(client, url, headers, timeout_s)
        if done is None:
            self.given_up += 1
            return False
        if not done:
            self._queue(_Close(url, dict(headers), 1, self._clock() + self.first_retry_s))
        return done

    @property
    def pending(self) -> int:
        with self._wake:
            return len(self._pending) + self._working

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no close is pending (tests, shutdown); whether that happened in time."""
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.pending

    def shutdown(self, grace_s: float = 2.0) -> None:
        """Give pending closes ``grace_s`` to get through, then stop the thread."""
        self.wait_idle(grace_s)
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(grace_s + self.timeout_s)

    # -- the retry thread ------------------------------------------------------------------------
    def _queue(self, job: _Close) -> None:
        with self._wake:
            if len(self._pending) >= MAX_PENDING:
                dropped = self._pending.popleft()
                self.given_up += 1
                _log.warning("too many sessions left to close; no more retries for %s", dropped.url)
            self._pending.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="meshnet-closer", daemon=True)
                self._thread.start()
            self._wake.notify_all()

    def _next(self) -> _Close | None:
        """The earliest due close, once it is due (None: stopping)."""
        with self._wake:
            while not self._stopping:
                if self._pending:
                    job = min(self._pending, key=lambda j: j.due)
                    wait = job.due - self._clock()
                    if wait <= 0:
                        self._pending.remove(job)
                        self._working += 1
                        return job
                    self._wake.wait(min(wait, 1.0))
                else:
                    self._wake.wait(1.0)
            return None

    def _run(self) -> None:
        with httpx.Client(verify=self.tls or True, timeout=self.timeout_s) as client:
            while (job := self._next()) is not None:
                done = self._attempt(client, job.url, job.headers, self.timeout_s)
                job.attempts += 1
                if done:
                    _log.info("closed %s after %d attempts", job.url, job.attempts)
                elif done is None or job.attempts >= self.attempts:
                    self.given_up += 1
                    _log.warning("gave up closing %s after %d attempts: its idle TTL frees it", job.url, job.attempts)
                else:
                    delay = min(self.max_retry_s, self.first_retry_s * 2 ** (job.attempts - 1))
                    job.due = self._clock() + delay
                    with self._wake:
                        self._pending.append(job)
                with self._wake:
                    self._working -= 1

    @staticmethod
    def _attempt(client: httpx.Client, url: str, headers: dict[str, str], timeout_s: float) -> bool | None:
        try:
            response = client.delete(url, headers=headers, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return acknowledged(response.status_code)
