"""Audit reports on the tracker: what a gateway's audit of one hop proves, and what follows from it
(docs/tracker.md, "Audits"; the statements and the verdict: protocol.audits).

A gateway re-executes a secret fraction of its sessions on trusted *auditor* nodes (nodes that
register with ``auditor: true``: the tracker never puts one on a route) and reports each audited
hop: ``POST /v1/audits``. The tracker takes a report only on evidence it checks itself, so that
neither a gateway nor an auditor alone can fail an honest node:

- the audited node served those layers of the session and was pinned with a hop key; the receipt
  (its latest entry) carries that key's signature over the session (a tail's receipt may have been
  signed with an answer the report does not carry: a failed tail's verdict rests on the answer
  evidence instead, which must carry it);
- every statement is signed by a live registered auditor (trusted, in a private swarm) with the
  hop key it registered, about this session, node and layers, one per auditor;
- the tracker recomputes the verdict (``protocol.audits.judge``) from the statements, the receipt
  and the evidence, and the report must say what they bear out.

A verified **fail** suspends the node persistently (``tracker.audit_store``: it stays listed,
heartbeats and all, but is never routed again until an operator lifts it), voids its unsettled pay
(every billing record of it so far, and later ones of sessions that started before the verdict),
and, in a private swarm, once fails of it carry statements of two distinct auditors, revokes its
certificate: one auditor's word suspends, two auditors' revoke. A **withheld** report (the node did
not hand over its seam log) is not evidence of wrong work: it counts as one failure of the node
(``SessionsApi.count_failed_hop``) and voids its pay for that session only. A pass changes nothing.
Every report taken is stored; a resend (the same session, node and auditors) answers the stored one.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet.errors import Forbidden, InvalidRequest, NotFound
from meshnet.httputil import read_body
from meshnet.layers import LayerRange
from meshnet.protocol.audits import AuditStatement, judge, statement_signed_by
from meshnet.protocol.messages import HopEntry
from meshnet.protocol.signing import signed_by
from meshnet.security.identity import Member
from meshnet.security.membership import SwarmAuthority, scope_member
from meshnet.security.revocation import revoke_member
from meshnet.tracker.audit_store import AuditRow, void_note
from meshnet.tracker.db import TrackerDB, member
from meshnet.tracker.limits import FAILURES
from meshnet.tracker.routing import NodeRecord
from meshnet.tracker.sessions import MAX_BODY_BYTES, SessionsApi, check_owner, limited_caller, parse_body, total_layers

__all__ = [
    "AUDITS_PATH",
    "MAX_REASON_CHARS",
    "MAX_STATEMENTS",
    "REVOKING_AUDITORS",
    "AuditReport",
    "AuditsApi",
    "check_auditor_registration",
    "check_report",
]

AUDITS_PATH = "/v1/audits"
MAX_STATEMENTS = 4  # auditors one report may carry
MAX_REASON_CHARS = 2000
REVOKING_AUDITORS = 2  # distinct auditors whose statements failed a node: then its certificate is revoked
MAX_LISTED = 1000
log = logging.getLogger("meshnet.tracker")
_Answers = Mapping[int, tuple[HopEntry, Mapping[str, Any]]]


class ReportedReceipt(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    entry: dict[str, Any]  # the audited node's latest signed entry (HopEntry JSON)
    answer: dict[str, Any] | None = None  # a tail's: the claim it signed the entry with, when the gateway has it


class TailAnswer(BaseModel):
    """A tail's signed answer at ``position`` (``protocol.audits.answer_at``): a failed tail's evidence."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    position: int = Field(ge=0, le=2**40)
    entry: dict[str, Any]
    answer: dict[str, Any]


class AuditReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    session_id: str = Field(min_length=1, max_length=64)
    node_id: str = Field(min_length=1, max_length=128)
    layers: str = Field(min_length=3, max_length=32)
    kind: Literal["reexecuted", "withheld"]
    verdict: Literal["pass", "fail"]
    reason: str = Field("", max_length=MAX_REASON_CHARS)
    receipt: ReportedReceipt
    statements: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_STATEMENTS)
    answer: TailAnswer | None = None


def check_auditor_registration(*, hop_key: str | None, certified: Member | None, private: bool) -> None:
    """A node registering with ``auditor: true``: its statements are checked against its hop key, so
    it needs one (400); in a private swarm only a trusted member audits (403)."""
    if hop_key is None:
        raise InvalidRequest(
            "an auditor signs its statements with its hop key: register it with a hop_key", param="hop_key"
        )
    if private and (certified is None or not certified.trusted):
        raise Forbidden(
            "an auditor must be a trusted member: its statements can suspend and revoke other nodes "
            "(invite it with meshnet swarm invite --trusted), or register it without auditor",
            param="auditor",
        )


def _bad(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def _pinned_key(report: AuditReport, session: dict[str, Any]) -> str:
    """The hop key the audited node was pinned to the session with; 400 when it served no such layers."""
    sid = session["session_id"]
    try:
        layers = str(LayerRange.parse(report.layers, total_layers(session)))
    except ValueError as exc:
        raise _bad(f"layers: {exc}", "layers") from None
    if layers != report.layers or member(report.node_id, layers) not in set(session["members"]):
        raise _bad(f"node {report.node_id} never served layers {report.layers} of session {sid}", "node_id")
    key = (session.get("hop_keys") or {}).get(member(report.node_id, layers))
    if key is None:
        raise _bad(
            f"node {report.node_id} was pinned to session {sid} without a hop key: nothing it signed can be audited",
            "node_id",
        )
    return str(key)


def _entry(raw: Mapping[str, Any], report: AuditReport, param: str) -> HopEntry:
    try:
        entry = HopEntry.from_json(raw)
    except ValueError as exc:
        raise _bad(f"{param}: {exc}", param) from None
    if (entry.node, entry.layers) != (report.node_id, report.layers):
        raise _bad(
            f"{param} is node {entry.node}'s for layers {entry.layers}; the report is about node {report.node_id} "
            f"layers {report.layers}",
            param,
        )
    return entry


def _receipt(report: AuditReport, sid: str, key: str) -> HopEntry:
    """The audited node's receipt, its signature checked: always for a hop that sends on; for a tail
    when the report carries the claim it signed the entry with (else its answer evidence carries it)."""
    entry = _entry(report.receipt.entry, report, "receipt.entry")
    if (entry.output_digest is not None or report.receipt.answer is not None) and not signed_by(
        key, sid, entry, report.receipt.answer
    ):
        raise _bad(
            f"the receipt does not carry node {report.node_id}'s signature over session {sid} (the hop key it "
            "was pinned with): send its latest signed entry as it signed it",
            "receipt.entry",
        )
    return entry


def _evidence(report: AuditReport, receipt: HopEntry, sid: str, key: str) -> _Answers:
    """A tail's signed answer the report brings: {position: (entry, claim)}, its signature checked."""
    if report.answer is None:
        return {}
    if receipt.output_digest is not None:
        raise _bad(
            f"answer evidence is a tail's; node {report.node_id} sends on (its receipt has an output digest): "
            "send answer: null",
            "answer",
        )
    entry = _entry(report.answer.entry, report, "answer.entry")
    if not signed_by(key, sid, entry, report.answer.answer):
        raise _bad(
            f"the answer evidence does not carry node {report.node_id}'s signature over session {sid} and that "
            "answer (the hop key it was pinned with)",
            "answer",
        )
    return {report.answer.position: (entry, report.answer.answer)}


def _auditor(st: AuditStatement, nodes: Mapping[str, NodeRecord], session: dict[str, Any], where: str) -> NodeRecord:
    """The live registered auditor that signed statement ``st``; 400 naming what is wrong."""
    node = nodes.get(st.auditor)
    if node is None:
        raise _bad(f"{where}: auditor {st.auditor} is not a live node of this tracker (an auditor registers with "
                   "auditor: true and heartbeats)", where)  # fmt: skip
    if not node.auditor:
        raise _bad(f"{where}: node {st.auditor} is not registered as an auditor (auditor: true)", where)
    if node.model != session["model"] or str(node.layers) != st.layers:
        raise _bad(f"{where}: auditor {st.auditor} serves layers {node.layers} of {node.model!r}, not layers "
                   f"{st.layers} of {session['model']!r}", where)  # fmt: skip
    if node.hop_key is None or not statement_signed_by(node.hop_key, st):
        raise _bad(f"{where} does not carry the signature of auditor {st.auditor} (the hop key it registered with)",
                   where)  # fmt: skip
    return node


def _statements(
    report: AuditReport, session: dict[str, Any], live: Sequence[NodeRecord], *, private: bool
) -> list[AuditStatement]:
    """The report's statements, each checked against the auditor that signed it."""
    if not report.statements:
        raise _bad(f'a "reexecuted" report carries 1 to {MAX_STATEMENTS} auditor statements', "statements")
    nodes = {n.node_id: n for n in live}
    found: list[AuditStatement] = []
    for i, raw in enumerate(report.statements):
        where = f"statements.{i}"
        try:
            st = AuditStatement.from_json(raw)
        except ValueError as exc:
            raise _bad(f"{where}: {exc}", where) from None
        about = (session["session_id"], report.node_id, report.layers)
        if (st.session, st.node, st.layers) != about:
            raise _bad(f"{where} is about session {st.session} node {st.node} layers {st.layers}; the report is "
                       f"about session {about[0]} node {about[1]} layers {about[2]}", where)  # fmt: skip
        if st.auditor == report.node_id:
            raise _bad(f"{where}: node {st.auditor} cannot audit itself", where)
        if st.auditor in {s.auditor for s in found}:
            raise _bad(f"{where}: a second statement of auditor {st.auditor} (one per auditor)", where)
        node = _auditor(st, nodes, session, where)
        if private and not node.trusted:
            raise _bad(f"{where}: auditor {st.auditor} is not a trusted member of this swarm", where)
        found.append(st)
    return found


def _bear_out(report: AuditReport, statements: Sequence[AuditStatement], receipt: HopEntry, answers: _Answers) -> str:
    """The verdict every statement gives (``judge``), which must be the reported one; its reason."""
    if receipt.output_digest is None and report.verdict == "fail" and not answers:
        raise _bad(
            "a failed tail is failed on an answer it signed: send it as answer (protocol.audits.answer_at)", "answer"
        )
    reasons = []
    for i, st in enumerate(statements):
        try:
            finding = judge(st, receipt, answers, complete=False)
        except ValueError as exc:
            raise _bad(f"statements.{i}: {exc}", f"statements.{i}") from None
        if finding.verdict != report.verdict:
            raise _bad(
                f"the statements do not bear out verdict {report.verdict!r}: auditor {st.auditor}'s gives "
                f"{finding.verdict!r} ({finding.reason})",
                "verdict",
            )
        reasons.append(finding.reason)
    return reasons[0]


def _check_withheld(report: AuditReport, receipt: HopEntry) -> str:
    if report.verdict != "fail":
        raise _bad('a "withheld" report is a fail: a node that withheld its seam log was not shown honest', "verdict")
    if report.statements or report.answer is not None:
        raise _bad('a "withheld" report carries no statements and answer: null (nothing was re-executed)',
                   "statements")  # fmt: skip
    if receipt.output_digest is None:
        raise _bad(f"node {report.node_id} is the tail: it sends nothing on, so it has no seam log to withhold",
                   "kind")  # fmt: skip
    return report.reason or f"node {report.node_id} did not hand over its seam log of session {report.session_id}"


def check_report(
    report: AuditReport, session: dict[str, Any], live: Sequence[NodeRecord], *, private: bool
) -> AuditRow:
    """The stored form of ``report`` about ``session``, judged on its evidence against the live nodes
    (the auditors among them); ``InvalidRequest`` naming the first thing the evidence does not bear out."""
    sid = session["session_id"]
    key = _pinned_key(report, session)
    receipt = _receipt(report, sid, key)
    answers = _evidence(report, receipt, sid, key)
    statements: list[AuditStatement] = []
    if report.kind == "withheld":
        reason = _check_withheld(report, receipt)
    else:
        statements = _statements(report, session, live, private=private)
        reason = _bear_out(report, statements, receipt, answers)
    # A fail keeps everything it was judged on; a pass (it proves nothing against anyone) the receipt
    # alone: a tail's statements carry a draw per answered position, too much to keep for every session.
    evidence: dict[str, Any] = {"receipt": report.receipt.model_dump(), "reported_reason": report.reason}
    if report.verdict == "fail":
        evidence["statements"] = [s.to_json() for s in statements]
        evidence["answer"] = None if report.answer is None else report.answer.model_dump()
    auditors = tuple(sorted(s.auditor for s in statements))
    return AuditRow(sid, report.node_id, report.layers, report.kind, report.verdict, reason, auditors,
                    json.dumps(evidence, separators=(",", ":")))  # fmt: skip


def _limit(raw: str | None) -> int:
    try:
        limit = 100 if raw is None else int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LISTED:
        raise _bad(f"limit is a whole number from 1 to {MAX_LISTED}, not {raw!r}", "limit")
    return limit


class AuditsApi:
    """``POST``/``GET /v1/audits`` and ``DELETE /v1/suspensions/{node_id}``; ``routes()`` mounts them.
    ``live()`` is every live node (auditors too); ``swarm`` a private swarm's authority (revocations)."""

    def __init__(
        self, db: TrackerDB, sessions: SessionsApi, live: Callable[[], list[NodeRecord]], swarm: SwarmAuthority | None
    ) -> None:
        self.db = db
        self.sessions = sessions  # sessions, their owners, and the failure ledger a withheld log counts in
        self.live = live
        self.swarm = swarm

    async def report(self, request: Request) -> Response:
        req = parse_body(AuditReport, await read_body(request, MAX_BODY_BYTES, "the tracker"))
        session = self.sessions.load(req.session_id)
        check_owner(request, session, "report audits of")
        if req.kind == "withheld":  # it counts as a failure of the node: limited like failure reports
            self.sessions.limits.check(limited_caller(request), FAILURES, time.time())
        row = check_report(req, session, self.live(), private=self.swarm is not None)
        record, fresh = self.db.audits.record(row)
        if fresh and row.verdict == "fail":
            self._failed(request, row, record["audit_id"])
        return JSONResponse({**record, "duplicate": not fresh}, status_code=201 if fresh else 200)

    def _failed(self, request: Request, row: AuditRow, audit_id: str) -> None:
        log.warning("audit %s: node %s (layers %s) failed on session %s (%s): %s", audit_id, row.node_id,
                    row.layers, row.session_id, row.kind, row.reason)  # fmt: skip
        note = void_note(audit_id, row.kind, row.reason)
        if row.kind == "withheld":  # no evidence of wrong work: one failure, and no pay for that session
            self.sessions.count_failed_hop(request, row.session_id, row.node_id, f"audit {audit_id}: {row.reason}")
            self.db.void_billing(row.node_id, note, session_id=row.session_id)
            return
        self.db.audits.suspend(row.node_id, f"audit {audit_id}: {row.reason}", audit_id)
        voided = self.db.void_billing(row.node_id, note)
        log.warning("audit %s: node %s is suspended from every route and %d billing record(s) of it are void",
                    audit_id, row.node_id, voided)  # fmt: skip
        self._revoke_if_confirmed(row.node_id)

    def _revoke_if_confirmed(self, node_id: str) -> None:
        """In a private swarm: revoke the node once fails of it carry statements of two auditors."""
        if self.swarm is None:
            return
        auditors = self.db.audits.failing_auditors(node_id)
        if len(auditors) < REVOKING_AUDITORS or node_id in self.swarm.revoked_ids():
            return
        try:
            serial = revoke_member(self.swarm.directory, node_id)
        except InvalidRequest as exc:
            log.warning("audits: node %s failed audits of %d auditors but cannot be revoked: %s", node_id,
                        len(auditors), exc.message)  # fmt: skip
            return
        log.warning("audits: revoked node %s (certificate %s): failed re-executions of it carry statements of "
                    "auditors %s", node_id, serial, ", ".join(sorted(auditors)))  # fmt: skip

    async def listing(self, request: Request) -> Response:
        q = request.query_params
        verdict = q.get("verdict")
        if verdict is not None and verdict not in ("pass", "fail"):
            raise _bad(f'verdict is "pass" or "fail", not {verdict!r}', "verdict")
        node_id = q.get("node_id")
        audits = self.db.audits.listing(
            node_id=node_id, session_id=q.get("session_id"), verdict=verdict, limit=_limit(q.get("limit"))
        )
        suspended = [s for s in self.db.audits.suspensions() if node_id is None or s["node_id"] == node_id]
        return JSONResponse({"audits": audits, "suspended": suspended})

    async def lift(self, request: Request) -> Response:
        node_id = request.path_params["node_id"]
        who = scope_member(request.scope)
        if who is not None and not (who.trusted or who.role == "admin"):
            raise Forbidden(
                f"only a trusted member lifts a suspension; {who.role} {who.member_id!r} is not trusted",
                param="node_id",
            )
        held = next((s for s in self.db.audits.suspensions() if s["node_id"] == node_id), None)
        if held is None or not self.db.audits.lift(node_id):
            raise NotFound(f"node {node_id} is not suspended")
        log.warning("audits: the suspension of node %s (%s) is lifted by %s", node_id, held["reason"],
                    "an open swarm's caller" if who is None else f"{who.role} {who.member_id}")  # fmt: skip
        return JSONResponse({"lifted": node_id, "reason": held["reason"], "since": held["since"]})

    def routes(self) -> list[Route]:
        return [
            Route(AUDITS_PATH, self.report, methods=["POST"]),
            Route(AUDITS_PATH, self.listing, methods=["GET"]),
            Route("/v1/suspensions/{node_id}", self.lift, methods=["DELETE"]),
        ]
