"""Closing a session until it is closed: the gateway's ``DELETE``s on a route's head and on the
tracker, and a node's ``DELETE`` passed on to its next hop, retried off the request path until
acknowledged (issue 28).

A close that is lost leaves a zombie: the session holds its slot on every hop (and its count on
the tracker) until its idle TTL, and concurrent users find the nodes full. A close is lost when
the hop is still computing for the session (409 ``session_busy``: a killed stream's last step), is
briefly unreachable, or answers after the gateway stopped waiting. So:

- the first attempt is made at once, by the caller, with the caller's short timeout: a healthy
  route frees the session (and keeps its prompt blocks) before the stream ends, as before;
- an attempt that is not acknowledged is retried on a task of its own with exponential backoff
  (``FIRST_RETRY_S`` doubling to ``MAX_RETRY_S``), at most ``ATTEMPTS`` times (about two minutes in
  all), then given up with a warning: the hop's TTL still frees it;
- acknowledged means 2xx, or 404/410 (nothing left to close); 409, 429, 5xx and transport errors
  are retried; any other 4xx (e.g. a refused ticket) will not change and is given up at once
  (``protocol.hops.acknowledged``).

An attempt is any coroutine function saying whether it was acknowledged (a ``DELETE`` through the
hop client, ``protocol.hops``, or on the tracker), so a close goes the way every other request of
the route goes. The gateway's route engine keeps one closer with the defaults; a node keeps one that
asks its next hop again sooner (50 ms doubling: a next hop is only still finishing a step). Concurrency:
every call on the event loop of the closer's owner. At most ``MAX_PENDING`` closes wait (the oldest
is dropped, with a warning).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable

__all__ = ["ATTEMPTS", "Attempt", "SessionCloser"]

ATTEMPTS = 8  # the first one included
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 30.0
MAX_PENDING = 4096

# True: acknowledged; False: retry; None: give up (``protocol.hops.acknowledged``)
Attempt = Callable[[], Awaitable[bool | None]]


class SessionCloser:
    def __init__(
        self,
        *,
        attempts: int = ATTEMPTS,
        first_retry_s: float = FIRST_RETRY_S,
        max_retry_s: float = MAX_RETRY_S,
        timeout_s: float = 5.0,
        log: str = "meshnet.gateway",
    ) -> None:
        """``log``: the logger its retries are told in (its owner's)."""
        self._log = logging.getLogger(log)
        self.attempts = attempts
        self.first_retry_s = first_retry_s
        self.max_retry_s = max_retry_s
        self.timeout_s = timeout_s  # each retry's wait
        self._pending: collections.deque[asyncio.Task[None]] = collections.deque()
        self.given_up = 0  # closes abandoned after every attempt (or refused for good)

    async def close(self, attempt: Attempt, what: str, *, timeout_s: float) -> bool:
        """Make ``attempt`` now (waiting at most ``timeout_s``); retried on a task of its own if it is
        not acknowledged. ``what``: the session it closes, for the log. Whether it was acknowledged at once."""
        done = await self._try(attempt, timeout_s, what)
        if done is None:
            self.given_up += 1
            return False
        if not done:
            self._queue(attempt, what)
        return done

    @property
    def pending(self) -> int:
        return sum(not task.done() for task in self._pending)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no close is pending (tests, shutdown); whether that happened in time."""
        waiting = [task for task in self._pending if not task.done()]
        if waiting:
            await asyncio.wait(waiting, timeout=timeout_s)
        return not self.pending

    async def shutdown(self, grace_s: float = 2.0) -> None:
        """Give pending closes ``grace_s`` to get through, then stop retrying."""
        await self.wait_idle(grace_s)
        for task in self._pending:
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        self._pending.clear()

    def _queue(self, attempt: Attempt, what: str) -> None:
        while self._pending and self._pending[0].done():
            self._pending.popleft()
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft().cancel()
            self.given_up += 1
            self._log.warning("too many sessions left to close; no more retries for the oldest")
        self._pending.append(asyncio.ensure_future(self._retry(attempt, what)))

    async def _retry(self, attempt: Attempt, what: str) -> None:
        attempts = 1
        while True:
            await asyncio.sleep(min(self.max_retry_s, self.first_retry_s * 2 ** (attempts - 1)))
            done = await self._try(attempt, self.timeout_s, what)
            attempts += 1
            if done:
                self._log.info("closed %s after %d attempts", what, attempts)
                return
            if done is None or attempts >= self.attempts:
                self.given_up += 1
                self._log.warning("gave up closing %s after %d attempts: its idle TTL frees it", what, attempts)
                return

    async def _try(self, attempt: Attempt, timeout_s: float, what: str) -> bool | None:
        try:
            return await asyncio.wait_for(attempt(), timeout_s)
        except TimeoutError:
            return False
        except Exception as exc:  # an attempt's own bug must not end the retries silently
            self._log.warning("closing %s failed: %s: %s", what, type(exc).__name__, exc)
            return False
