"""What each node computed for a generation, and the outbox that delivers it to the tracker.

The gateway orchestrates every position a route computes (prefill chunks, decode steps, repair
replays), so it counts them per node (``Usage``) and, when the generation ends, submits one
billing record per session to the tracker's ``POST /v1/billing``. The tracker writes them in one
transaction and treats a resent record as a duplicate, so the outbox can retry freely: a tracker
that is down or restarting gets the record when it is back (retries with backoff, for at most
``give_up_s``), and nothing a client saw complete goes unbilled.

Threading: ``submit`` is called from gateway worker threads; one daemon thread delivers.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from meshnet.httputil import error_message
from meshnet.routes import Hop, RoutePlan

__all__ = ["BillingOutbox", "Usage"]

_log = logging.getLogger("meshnet.gateway")


@dataclass
class _NodeUsage:
    layers: str
    prefill_tokens: int = 0
    decode_tokens: int = 0


@dataclass
class Usage:
    """Positions each node of a session computed, by node id."""

    nodes: dict[str, _NodeUsage] = field(default_factory=dict)

    def add(self, hops: Iterable[Hop], *, prefill: int = 0, decode: int = 0) -> None:
        for hop in hops:
            entry = self.nodes.setdefault(hop.node, _NodeUsage(str(hop.layers)))
            entry.prefill_tokens += prefill
            entry.decode_tokens += decode

    def records(self) -> list[dict[str, Any]]:
        return [
            {"node_id": node, "layers": u.layers, "prefill_tokens": u.prefill_tokens, "decode_tokens": u.decode_tokens}
            for node, u in sorted(self.nodes.items())
            if u.prefill_tokens or u.decode_tokens
        ]


class BillingOutbox:
    def __init__(self, tracker_url: str, *, give_up_s: float = 600.0, timeout_s: float = 10.0) -> None:
        self.tracker_url = tracker_url.rstrip("/")
        self.give_up_s = give_up_s
        self._timeout = timeout_s
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.delivered = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="meshnet-billing", daemon=True)
        self._thread.start()

    def submit(self, plan: RoutePlan, usage: Usage, outcome: str) -> None:
        records = usage.records()
        if not records:
            return  # nothing was computed (e.g. refused before prefill)
        with self._lock:
            self._pending += 1
        self._queue.put(
            {
                "session_id": plan.session_id,
                "route_id": plan.route_id,
                "outcome": outcome,
                "records": records,
                "_deadline": time.monotonic() + self.give_up_s,
            }
        )

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def wait_idle(self, timeout_s: float) -> bool:
        """True once every submitted record was delivered or dropped (bounded by ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.pending

    def close(self, flush_s: float = 5.0) -> None:
        self.wait_idle(flush_s)
        if self.pending:
            _log.warning("%d billing record(s) not delivered to %s before shutdown", self.pending, self.tracker_url)
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=flush_s)

    # -- the delivery thread -------------------------------------------------------------------
    def _run(self) -> None:
        with httpx.Client(timeout=self._timeout) as client:
            while not self._stop.is_set():
                item = self._queue.get()
                if item is None:
                    return
                self._deliver(client, item)
                with self._lock:
                    self._pending -= 1

    def _deliver(self, client: httpx.Client, item: dict[str, Any]) -> None:
        body = {k: v for k, v in item.items() if not k.startswith("_")}
        delay, warned = 0.25, False
        while not self._stop.is_set():
            try:
                response = client.post(f"{self.tracker_url}/v1/billing", json=body)
                if response.status_code < 500:
                    if response.status_code >= 400:  # the tracker will never take it: say so, once
                        _log.error("billing record for %s refused: %s", body["session_id"], error_message(response))
                        self.dropped += 1
                    else:
                        self.delivered += 1
                    return
                why = error_message(response)
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > item["_deadline"]:
                _log.error(
                    "billing record for %s dropped after %gs of retries: %s", body["session_id"], self.give_up_s, why
                )
                self.dropped += 1
                return
            if not warned:
                _log.warning("tracker unreachable for billing (%s); retrying", why)
                warned = True
            self._stop.wait(delay)
            delay = min(5.0, delay * 2)
