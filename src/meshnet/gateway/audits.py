"""Audit sampling at the gateway (docs/security.md, "Audit sampling"; protocol.audits).

``--audit-rate R`` picks each generation for an audit with probability R, secretly: nothing a node
sees differs until its last token is out. For a picked one the route engine, before it closes the
route, records what the audit needs (``collect``): every non-tail hop's seam log (what it sent on,
fetched from it and checked against the output digest it signed), the chunks, the token ids, the
sampling parameters and seed, each hop's receipt (its latest signed entry) and the tail's signed
answers that committed a draw. ``Audits`` then, on a thread of its own, sends each hop's inputs to a
trusted auditor node of the same layers and numerics (from the tracker's node list), checks the
auditor's signature on its statement, judges it (``protocol.audits.judge``: bit-exact equality),
asks a second auditor to confirm a failure, keeps the verdict (``GET /v1/audits``, ``/metrics``)
and reports it with its evidence to the tracker, which checks it again and voids the node's pay,
suspends it (and in a private swarm revokes it once two auditors agree).

A hop whose seam log was not handed over (or does not match what it signed) cannot be audited
past itself: it is failed as ``withheld``; a hop with no auditor of its layers is skipped and
counted (``meshnet_gateway_audits_skipped``), never passed.

Concurrency: ``collect`` runs on the gateway's loop, reading the seam logs through the route
engine's own hop client (``protocol.hops``); the audits on one daemon thread
fed by a bounded queue (a full queue skips the audit and counts it); the book is locked.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import re
import secrets
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from meshnet.errors import HopFailed, MeshnetError
from meshnet.httputil import error_message, tls_or_default
from meshnet.ids import SessionId
from meshnet.protocol.audits import AuditRequest, AuditStatement, Finding, answer_at, judge, statement_signed_by
from meshnet.protocol.hops import HopTransport
from meshnet.protocol.ledger import EMPTY_DIGEST, extend_digest
from meshnet.protocol.messages import HopEntry
from meshnet.protocol.wire import frame_values
from meshnet.routes import Hop

__all__ = ["AuditJob", "AuditRecord", "Audits", "collect"]

_log = logging.getLogger("meshnet.gateway.audits")
MAX_RECORDS = 1000  # verdicts the gateway keeps for GET /v1/audits
MAX_QUEUED = 64  # audits waiting for the audit thread
AUDIT_TIMEOUT_S = 600.0  # one auditor's re-execution of one hop
_THREADS = re.compile(r"threads \d+; ")


@dataclass(frozen=True, slots=True)
class AuditJob:
    """Everything one session's audit needs, taken before its route closed."""

    session: str
    model: str
    hops: tuple[Hop, ...]
    chunks: tuple[int, ...]  # the route's: the tail holds these positions
    # int32 LE, positions 0..: the route's, then the drafts of a last verify chunk the tail rejected
    # and the hops before it still hold (they drop them lazily on the decode channel)
    ids: bytes
    sampling: dict[str, Any]
    receipts: dict[str, HopEntry]  # node -> its latest signed entry
    # node -> that receipt as the tracker takes it ({"entry", "answer"}: the tail's claim it signed with)
    signed: dict[str, dict[str, Any]]
    answers: dict[int, tuple[HopEntry, dict[str, Any]]]  # the tail's: position -> its signed entry, claim
    logs: dict[str, tuple[str, bytes]]  # non-tail node -> (dtype, what it sent on)
    withheld: dict[str, str] = field(default_factory=dict)  # node -> why its seam log is missing


@dataclass(frozen=True, slots=True)
class AuditRecord:
    audit_id: str
    session_id: str
    node_id: str
    layers: str
    verdict: str  # pass | fail
    reason: str
    kind: str  # reexecuted | withheld
    auditors: tuple[str, ...]
    at: float
    reported: bool
    deviation: float | None = None  # audited across numerics classes: the auditor's measure (else None)

    def to_json(self) -> dict[str, Any]:
        return {"audit_id": self.audit_id, "session_id": self.session_id, "node_id": self.node_id,
                "layers": self.layers, "verdict": self.verdict, "reason": self.reason, "kind": self.kind,
                "auditors": list(self.auditors), "at": self.at, "reported": self.reported,
                "deviation": self.deviation}  # fmt: skip


async def collect(
    hops_client: HopTransport,
    *,
    session: str,
    model: str,
    hops: Sequence[Hop],
    chunks: Sequence[int],
    tokens: Sequence[int],
    sampling: dict[str, Any],
    receipts: Mapping[str, HopEntry],
    signed: Mapping[str, dict[str, Any]],
    answers: Mapping[int, tuple[HopEntry, dict[str, Any]]],
    rejected: Sequence[int] = (),
    timeout_s: float = 30.0,
) -> AuditJob | None:
    """What auditing ``session`` needs, fetched from its route before it closes; ``None`` when the
    route's receipts do not describe its ``sum(chunks)`` positions (and, before the tail, at most
    the ``rejected`` drafts after them): nothing to audit against."""
    held = sum(chunks)
    ids = np.asarray([*tokens[:held], *rejected], dtype="<i4").tobytes()
    if held == 0 or any(
        receipts.get(h.node) is None or not held <= receipts[h.node].held <= held + len(rejected) for h in hops
    ):
        return None
    logs: dict[str, tuple[str, bytes]] = {}
    withheld: dict[str, str] = {}
    for hop in hops[:-1]:
        receipt = receipts[hop.node]
        own_chunks = (*chunks, *(1,) * (receipt.held - held))
        try:
            logs[hop.node] = await _seam_log(hops_client, hop, session, own_chunks, receipt, timeout_s=timeout_s)
        except _Withheld as exc:
            withheld[hop.node] = str(exc)
    tail = hops[-1].node
    own = {p: a for p, a in answers.items() if a[0].node == tail}
    return AuditJob(
        session,
        model,
        tuple(hops),
        tuple(chunks),
        ids,
        dict(sampling),
        dict(receipts),
        dict(signed),
        own,
        logs,
        withheld,
    )


class _Withheld(Exception):
    pass


async def _seam_log(
    hops_client: HopTransport, hop: Hop, session: str, chunks: tuple[int, ...], receipt: HopEntry, *,
    timeout_s: float,
) -> tuple[str, bytes]:  # fmt: skip
    """``hop``'s seam log, checked against the output digest it signed (``_Withheld`` otherwise)."""
    held = sum(chunks)
    try:
        frame, served = await hops_client.seam_log(hop.url, SessionId(session), timeout_s=timeout_s)
    except HopFailed as exc:
        raise _Withheld(f"its seam log could not be fetched: {exc.message}") from None
    except MeshnetError as exc:
        raise _Withheld(f"it did not hand over its seam log ({exc.status}: {exc.message})") from None
    except Exception as exc:  # any malformed log is the node's: its digest cannot be checked
        raise _Withheld(f"it handed over a malformed seam log: {exc}") from None
    shape, dtype = frame.shape, frame.dtype
    try:
        values = frame_values(frame).reshape(held, -1)
    except Exception as exc:
        raise _Withheld(f"it handed over a malformed seam log: {exc}") from None
    if served != chunks or shape[:2] != (1, held):
        raise _Withheld(f"its seam log covers chunks {served} of shape {shape}; the session's are {chunks}")
    digest, at = EMPTY_DIGEST, 0
    for size in chunks:
        digest = extend_digest(digest, at, size, values[at : at + size].tobytes())
        at += size
    if digest.hex() != receipt.output_digest:
        raise _Withheld("the seam log it handed over is not what it signed for sending on")
    return dtype, frame.body


class Audits:
    """The gateway's audits: which generations are audited, the audit thread, the verdicts kept."""

    def __init__(self, tracker_url: str, rate: float, *, tls: ssl.SSLContext | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"--audit-rate is a fraction of sessions in [0, 1], got {rate}")
        self.tracker_url = tracker_url.rstrip("/")
        self.rate = rate
        self._tls = tls
        self._records: collections.deque[AuditRecord] = collections.deque(maxlen=MAX_RECORDS)
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()  # pass, fail, skipped
        self._queue: queue.Queue[AuditJob | None] = queue.Queue(MAX_QUEUED)
        self._thread: threading.Thread | None = None

    def chosen(self) -> bool:
        """Whether the generation starting now is audited (a secret draw; nodes never learn it early)."""
        return self.rate > 0 and secrets.randbelow(1 << 30) < self.rate * (1 << 30)

    def submit(self, job: AuditJob | None) -> None:
        if job is None:
            self._count("skipped")
            return
        with self._lock:  # generations end on several worker threads: one audit thread
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="meshnet-audits", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._count("skipped")
            _log.warning("audit of session %s skipped: %d audits are waiting", job.session, MAX_QUEUED)

    def records(
        self, *, node: str | None = None, session: str | None = None, verdict: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        with self._lock:
            kept = list(self._records)
        chosen = [
            r for r in reversed(kept)
            if node in (None, r.node_id) and session in (None, r.session_id) and verdict in (None, r.verdict)
        ]  # fmt: skip
        return [r.to_json() for r in chosen[:limit]]

    def close(self) -> None:
        """Stop the audit thread after the audit it is on (audits still waiting are dropped)."""
        if self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=5.0)
            self._thread.join(timeout=5.0)

    # -- the audit thread --------------------------------------------------------------------
    def _work(self) -> None:
        timeout = httpx.Timeout(AUDIT_TIMEOUT_S, connect=5.0)
        with httpx.Client(verify=tls_or_default(self._tls), timeout=timeout) as client:
            while True:
                job = self._queue.get()
                try:
                    if job is None:
                        return
                    self._audit(client, job)
                except Exception:  # one audit's trouble must not end the thread
                    _log.exception("audit of session %s failed to run", job.session if job else "?")
                finally:
                    self._queue.task_done()

    def _audit(self, client: httpx.Client, job: AuditJob) -> None:
        nodes = self._nodes(client)
        for i, hop in enumerate(job.hops):
            if hop.node in job.withheld:
                self._withheld(client, job, hop, job.withheld[hop.node])
                continue
            before = job.hops[i - 1].node if i else None
            if before is not None and before not in job.logs:
                continue  # its inputs are the hop before's seam log, which was withheld: no verdict either way
            same, other = _auditors_for(nodes, hop, job.model)
            if not same and not other:
                self._count("skipped")
                _log.info("audit of session %s: no auditor holds layers %s; node %s not audited",
                          job.session, hop.layers, hop.node)  # fmt: skip
                continue
            self._reexecute(client, job, i, same or other, cross=not same)

    def _reexecute(
        self, client: httpx.Client, job: AuditJob, index: int, auditors: list[dict[str, Any]], *, cross: bool
    ) -> None:
        hop = job.hops[index]
        request = _request(job, index, cross=cross)
        receipt = job.receipts[hop.node]
        statements: list[AuditStatement] = []
        finding: Finding | None = None
        for auditor in auditors[:2]:  # a failure is confirmed by a second auditor where there is one
            statement = self._statement(client, auditor, request)
            if statement is None:
                continue
            try:
                found = judge(statement, receipt, job.answers)
            except ValueError as exc:
                _log.warning("audit of session %s, node %s: auditor %s answered off the point: %s", job.session,
                             hop.node, auditor["node_id"], exc)  # fmt: skip
                continue
            if finding is not None and found.verdict != finding.verdict:
                _log.warning("audit of session %s, node %s: auditors %s disagree; no verdict", job.session, hop.node,
                             [*(s.auditor for s in statements), statement.auditor])  # fmt: skip
                finding = None
                break
            statements.append(statement)
            finding = finding or found
            if found.verdict == "pass":
                break
        if finding is None:
            self._count("skipped")
            return
        self._keep(client, job, hop, finding, kind="reexecuted", statements=statements)

    def _statement(self, client: httpx.Client, auditor: dict[str, Any], request: AuditRequest) -> AuditStatement | None:
        try:
            response = client.post(f"{auditor['url']}/v1/audit", content=request.encode())
            if response.status_code != 200:
                _log.warning("auditor %s refused an audit: %s", auditor["node_id"], error_message(response))
                return None
            statement = AuditStatement.from_json(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            _log.warning("auditor %s did not answer an audit: %s", auditor["node_id"], exc)
            return None
        if statement.auditor != auditor["node_id"] or not statement_signed_by(str(auditor["hop_key"]), statement):
            _log.warning("auditor %s answered a statement it did not sign", auditor["node_id"])
            return None
        return statement

    def _withheld(self, client: httpx.Client, job: AuditJob, hop: Hop, why: str) -> None:
        self._keep(client, job, hop, Finding("fail", f"withheld: {why}"), kind="withheld", statements=[])

    def _keep(
        self, client: httpx.Client, job: AuditJob, hop: Hop, finding: Finding, *, kind: str,
        statements: list[AuditStatement],
    ) -> None:  # fmt: skip
        receipt = job.signed.get(hop.node) or {"entry": job.receipts[hop.node].to_json()}
        body: dict[str, Any] = {
            "session_id": job.session, "node_id": hop.node, "layers": str(hop.layers), "kind": kind,
            "verdict": finding.verdict, "reason": finding.reason, "receipt": receipt,
            "statements": [s.to_json() for s in statements], "answer": None,
        }  # fmt: skip
        if finding.position is not None:
            entry, claim = job.answers[finding.position]
            body["answer"] = answer_at(finding.position, entry, claim)
        reported = self._report(client, body)
        auditors = tuple(s.auditor for s in statements)
        record = AuditRecord(f"aud-{secrets.token_hex(8)}", job.session, hop.node, str(hop.layers), finding.verdict,
                             finding.reason, kind, auditors, time.time(), reported, finding.deviation)  # fmt: skip
        with self._lock:
            self._records.append(record)
        self._count(finding.verdict)
        if finding.verdict == "fail":
            _log.warning("audit FAILED: session %s, node %s (layers %s): %s", job.session, hop.node, hop.layers,
                         finding.reason)  # fmt: skip

    def _report(self, client: httpx.Client, body: dict[str, Any]) -> bool:
        try:
            response = client.post(f"{self.tracker_url}/v1/audits", json=body, timeout=30.0)
        except httpx.HTTPError as exc:
            _log.warning("the tracker did not take an audit of session %s: %s", body["session_id"], exc)
            return False
        if response.status_code >= 400:
            _log.warning("the tracker refused an audit of session %s: %s", body["session_id"], error_message(response))
            return False
        return True

    def _nodes(self, client: httpx.Client) -> list[dict[str, Any]]:
        try:
            response = client.get(f"{self.tracker_url}/v1/nodes", timeout=30.0)
            nodes = response.json().get("nodes", []) if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError):
            nodes = []
        return [n for n in nodes if isinstance(n, dict)]

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1


def _auditors_for(
    nodes: list[dict[str, Any]], hop: Hop, model: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Auditors of ``hop``'s model, identity and layers, shuffled: those of its numerics class (they
    compute its bits) and those of another (another backend or build: compared within a tolerance)."""
    audited = next((n for n in nodes if n.get("node_id") == hop.node), {})
    found = [
        n for n in nodes
        if n.get("auditor") is True and n.get("node_id") != hop.node and n.get("model") == model
        and n.get("layers") == str(hop.layers) and isinstance(n.get("hop_key"), str)
        and n.get("identity") == (hop.identity or audited.get("identity"))
    ]  # fmt: skip
    found.sort(key=lambda _: secrets.randbits(32))
    mine = numerics_class(audited.get("numerics"))
    same = [n for n in found if mine is not None and numerics_class(n.get("numerics")) == mine]
    return same, [n for n in found if n not in same]


def numerics_class(numerics: object) -> str | None:
    """What decides a hop's bits, less its thread count: llama.cpp's CPU kernels give the same bits
    on any number of threads (docs/backends.md), so an auditor need not run as many as the hop."""
    return _THREADS.sub("", numerics) if isinstance(numerics, str) else None


def _request(job: AuditJob, index: int, *, cross: bool = False) -> AuditRequest:
    """The audit of hop ``index``: the positions its receipt holds, from what the hop before it sent
    (``cross``: by an auditor of another numerics class, with what the hop sent on to compare)."""
    hop = job.hops[index]
    tail = index == len(job.hops) - 1
    held = job.receipts[hop.node].held
    chunks = (*job.chunks, *(1,) * (held - sum(job.chunks)))
    ids = job.ids[: 4 * held]
    if index == 0:
        dtype, inputs = "int32", ids
    else:
        before = job.hops[index - 1].node
        dtype, log = job.logs[before]
        inputs = log[: len(log) // job.receipts[before].held * held]  # its first ``held`` positions
    wire, outputs = job.logs[hop.node] if not tail and hop.node in job.logs else ("float32", b"")
    return AuditRequest(job.session, hop.node, str(hop.layers), chunks, dtype, inputs, wire, ids,
                        job.sampling if tail else None, tuple(sorted(job.answers)) if tail else (),
                        cross, outputs if cross else b"")  # fmt: skip
