"""What each node computed for a generation, and the outbox that delivers it to the tracker.

The gateway orchestrates every position a route computes (prefill chunks, decode steps, repair
replays), so it counts them per node (``Usage``) and, when the generation ends, submits one
billing record per session to the tracker's ``POST /v1/billing``. The tracker writes them in one
transaction and treats a resent record as a duplicate, so the outbox can retry freely: a tracker
that is down or restarting gets the record when it is back (retries with backoff, for at most
``give_up_s``), and nothing a client saw complete goes unbilled.

Each record is also written to a spool directory (one JSON file per session, written atomically)
before it is queued, and removed once the tracker answered: a gateway that restarts — or is
killed — delivers what its predecessor had not (``spool_dir``; by default one directory per
tracker URL under ``~/.cache/meshnet/billing``). A record resent this way is a duplicate at the
tracker at worst, never a second bill.

Threading: ``submit`` is called from gateway worker threads; one daemon thread delivers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshnet.fsutil import PRIVATE_MODE, write_atomic
from meshnet.httputil import error_message, tls_or_default
from meshnet.protocol.messages import HopAnswer, HopEntry
from meshnet.protocol.signing import HopKey, claim_of, countersign, signed_by
from meshnet.routes import Hop, RoutePlan
from meshnet.tracker.billing import MAX_DECODE_S

__all__ = ["BillingOutbox", "Usage", "default_spool_dir"]

_log = logging.getLogger("meshnet.gateway")


@dataclass
class _NodeUsage:
    layers: str
    prefill_tokens: int = 0
    decode_tokens: int = 0


@dataclass
class Usage:
    """Positions each node of a session computed, by node id, and the seconds its decode steps took.

    ``decode_s`` is the sum of the wall times of the session's decode steps that succeeded, each
    from sending the step to having its answer checked; a step that failed and the repair after it
    are not in it (a repair is not the route's speed). The tracker compares it with the speeds the
    route's nodes advertised (tracker.plausibility): a route much slower than its nodes claimed
    gets floors on what routing charges them.
    """

    nodes: dict[str, _NodeUsage] = field(default_factory=dict)
    decode_s: float = 0.0
    # Each node's latest signed entry of the session, from an answer the gateway verified (with the
    # answer it vouched for, at the tail): its receipt (tracker.receipts), written out at billing.
    receipts: dict[str, tuple[HopEntry, HopAnswer | None]] = field(default_factory=dict)
    # Nodes caught lying in an answer they signed (a token their committed draw does not give): unpaid.
    unpaid: set[str] = field(default_factory=set)
    # Receipts whose signature is not checked yet: node -> (session, the key pinned for it). Decode
    # answers check only the tail's signature at once (it protects the tokens); the rest are checked
    # once, on the latest entry, before the receipts are used (``check_receipts``).
    unchecked: dict[str, tuple[str, str]] = field(default_factory=dict)

    def add(self, hops: Iterable[Hop], *, prefill: int = 0, decode: int = 0) -> None:
        for hop in hops:
            entry = self.nodes.setdefault(hop.node, _NodeUsage(str(hop.layers)))
            entry.prefill_tokens += prefill
            entry.decode_tokens += decode

    def signed(self, answer: HopAnswer, session: str = "", keys: Mapping[str, str | None] | None = None) -> None:
        """The entries of an answer the gateway verified: each node's becomes its receipt so far.
        ``keys``: the pinned keys of the nodes whose signatures it did not check yet (of ``session``)."""
        last = len(answer.hops) - 1
        for i, entry in enumerate(answer.hops):
            if entry.signature is not None:
                self.receipts[entry.node] = (entry, answer if i == last else None)
                key = keys.get(entry.node) if keys is not None and i != last else None
                if key is not None:
                    self.unchecked[entry.node] = (session, key)
                else:
                    self.unchecked.pop(entry.node, None)

    def check_receipts(self) -> list[str]:
        """Check the signatures not checked yet, on each node's latest entry; the nodes whose entry
        does not carry its own signature (empty: all did). Such an entry was made up or changed by
        a relaying hop that cannot be told apart from it, so then no node is paid (``void``)."""
        bad = []
        for node, (session, key) in sorted(self.unchecked.items()):
            if not signed_by(key, session, self.receipts[node][0], None):  # (never the tail's: checked at once)
                bad.append(node)
        self.unchecked.clear()
        if bad:
            self.void()
        return bad

    def receipt(self, node: str) -> dict[str, Any] | None:
        """``node``'s receipt as the tracker takes it (``None``: it signed no entry)."""
        if node not in self.receipts:
            return None
        entry, answer = self.receipts[node]
        return {"entry": entry.to_json(), "answer": None if answer is None else claim_of(answer)}

    def decoded(self, seconds: float) -> None:
        """One decode step took ``seconds`` (a clock that went backwards counts 0)."""
        self.decode_s += max(0.0, seconds)

    def void(self) -> None:
        """No node of the session is paid: an answer was forged by a hop that cannot be told apart
        from the one whose entry it changed (``RouteInconsistent``)."""
        self.unpaid.update(self.nodes)

    def records(self) -> list[dict[str, Any]]:
        return [
            {"node_id": node, "layers": u.layers, "prefill_tokens": u.prefill_tokens, "decode_tokens": u.decode_tokens}
            for node, u in sorted(self.nodes.items())
            if (u.prefill_tokens or u.decode_tokens) and node not in self.unpaid
        ]


def default_spool_dir(tracker_url: str) -> Path:
    """Where a gateway of ``tracker_url``'s swarm keeps undelivered billing records by default."""
    digest = hashlib.sha256(tracker_url.rstrip("/").encode()).hexdigest()[:16]
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshnet" / "billing" / digest


class BillingOutbox:
    """``give_up_s`` (wall clock, counted from the record's creation) stays inside the tracker's
    billing grace after a session ends (an hour), so a spooled record is still taken when it arrives."""

    def __init__(
        self,
        tracker_url: str,
        *,
        give_up_s: float = 3000.0,
        timeout_s: float = 10.0,
        spool_dir: Path | None = None,
        tls: ssl.SSLContext | None = None,
        key: HopKey | None = None,
        client: Callable[[], httpx.Client] | None = None,
    ) -> None:
        """``client``: makes the delivery thread's HTTP client (default: one for ``tracker_url`` with
        ``tls``; tests hand it an in-process tracker's)."""
        self._client = client or (lambda: httpx.Client(timeout=timeout_s, verify=tls_or_default(tls)))
        self.tracker_url = tracker_url.rstrip("/")
        # The gateway's key: it countersigns every report (the key pinned with the session's route)
        self.key = key if key is not None else HopKey.generate()
        self.give_up_s = give_up_s
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.delivered = 0
        self.dropped = 0
        self.spool = spool_dir if spool_dir is not None else default_spool_dir(self.tracker_url)
        self.spool.mkdir(parents=True, exist_ok=True)
        self.recovered = self._recover()
        self._thread = threading.Thread(target=self._run, name="meshnet-billing", daemon=True)
        self._thread.start()

    def submit(self, plan: RoutePlan, usage: Usage, outcome: str) -> None:
        records = usage.records()
        if not records:
            return  # nothing was computed (e.g. refused before prefill)
        body: dict[str, Any] = {"session_id": plan.session_id, "route_id": plan.route_id, "records": records}
        body["outcome"] = outcome
        receipts = [r for r in (usage.receipt(record["node_id"]) for record in records) if r is not None]
        if receipts:
            body["receipts"] = receipts
        if usage.decode_s > 0 and any(r["decode_tokens"] for r in records):
            body["decode_s"] = round(min(usage.decode_s, MAX_DECODE_S), 6)  # the tracker refuses more
        self._enqueue({**countersign(self.key, body), "_created": time.time()}, spooled=False)

    def _enqueue(self, item: dict[str, Any], *, spooled: bool) -> None:
        if not spooled:
            path = self.spool / f"{item['session_id']}.json"
            try:  # a crash leaves the old file or the new one, never half of one
                write_atomic(path, json.dumps(item).encode(), mode=PRIVATE_MODE)
            except OSError as exc:
                _log.error("billing record for %s not spooled (%s): it is lost if this gateway stops first",
                           item["session_id"], exc)  # fmt: skip
        with self._lock:
            self._pending += 1
        self._queue.put(item)

    def _recover(self) -> int:
        """Queue what an earlier gateway of this swarm spooled and never delivered."""
        count = 0
        for path in sorted(self.spool.glob("*.json")):
            try:
                item = json.loads(path.read_text())
                if not isinstance(item, dict) or "session_id" not in item or "records" not in item:
                    raise ValueError("not a billing record")
            except (OSError, ValueError) as exc:
                _log.error("unreadable billing spool file %s set aside: %s", path, exc)
                with contextlib.suppress(OSError):
                    path.rename(path.with_suffix(".bad"))
                continue
            self._enqueue(item, spooled=True)
            count += 1
        for tmp in self.spool.glob("*.tmp"):  # a write cut short: its record was never queued
            with contextlib.suppress(OSError):
                tmp.unlink()
        if count:
            _log.warning("delivering %d billing record(s) left undelivered by an earlier gateway", count)
        return count

    def _done(self, item: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            (self.spool / f"{item['session_id']}.json").unlink()

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
            _log.warning(
                "%d billing record(s) not delivered to %s before shutdown; the next gateway delivers them from %s",
                self.pending,
                self.tracker_url,
                self.spool,
            )
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=flush_s)

    # -- the delivery thread -------------------------------------------------------------------
    def _run(self) -> None:
        with self._client() as client:
            while not self._stop.is_set():
                item = self._queue.get()
                if item is None:
                    return
                if self._deliver(client, item):
                    self._done(item)
                with self._lock:
                    self._pending -= 1

    def _deliver(self, client: httpx.Client, item: dict[str, Any]) -> bool:
        """Deliver ``item``; True once it is settled (taken, refused for good, or given up on), False if
        the gateway stopped first (its spool file stays for the next one)."""
        body = {k: v for k, v in item.items() if not k.startswith("_")}
        deadline = time.monotonic() + self.give_up_s - max(0.0, time.time() - float(item.get("_created", time.time())))
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
                    return True
                why = error_message(response)
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > deadline:
                _log.error(
                    "billing record for %s dropped after %gs of retries: %s", body["session_id"], self.give_up_s, why
                )
                self.dropped += 1
                return True
            if not warned:
                _log.warning("tracker unreachable for billing (%s); retrying", why)
                warned = True
            self._stop.wait(delay)
            delay = min(5.0, delay * 2)
        return False
