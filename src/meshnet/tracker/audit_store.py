"""Where the tracker keeps audit reports and the suspensions failed audits impose (tracker.audits).

Two tables beside ``tracker.db``'s (the same database, created and migrated by ``TrackerDB``):

- ``audits``: every audit report the tracker verified and took, one row each, with the evidence it
  was judged on (JSON). ``report_key`` (the session, the audited node and the set of auditors) is
  unique: a gateway resending a report whose acknowledgement it lost finds the stored one.
- ``suspensions``: nodes a verified failed re-execution keeps off the routes, one row per node,
  until an operator lifts it (``DELETE /v1/suspensions/{node_id}``). Kept in the database, so a
  suspended node stays off the routes across its heartbeats and across a tracker restart.

Every write is one committed transaction.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

__all__ = ["AUDITS_TABLE", "AUDIT_METADATA", "AuditRow", "AuditStore", "void_note"]

AUDIT_METADATA = sa.MetaData()
AUDITS_TABLE = sa.Table(
    "audits",
    AUDIT_METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("audit_id", sa.String(32), nullable=False, unique=True),
    # sha256 of the session, the node and the sorted auditors: what makes a report a resend.
    sa.Column("report_key", sa.String(64), nullable=False, unique=True),
    sa.Column("session_id", sa.String(64), nullable=False),
    sa.Column("node_id", sa.String(128), nullable=False),
    sa.Column("layers", sa.String(32), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),  # reexecuted | withheld
    sa.Column("verdict", sa.String(8), nullable=False),  # pass | fail
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("auditors", sa.Text, nullable=False),  # JSON list of auditor node ids, sorted
    sa.Column("recorded_at", sa.Float, nullable=False),
    sa.Column("evidence", sa.Text, nullable=False),  # JSON: what the report was judged on
    sa.Index("audits_node", "node_id"),
    sa.Index("audits_session", "session_id"),
)
_SUSPENSIONS = sa.Table(
    "suspensions",
    AUDIT_METADATA,
    sa.Column("node_id", sa.String(128), primary_key=True),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("since", sa.Float, nullable=False),
    sa.Column("audit_id", sa.String(32), nullable=False),  # the failed audit that suspended it
)
_LISTED = ["audit_id", "session_id", "node_id", "layers", "kind", "verdict", "reason", "auditors", "recorded_at"]


@dataclass(frozen=True, slots=True)
class AuditRow:
    """One verified audit report, as the tracker stores it."""

    session_id: str
    node_id: str
    layers: str
    kind: str
    verdict: str
    reason: str
    auditors: tuple[str, ...]  # sorted
    evidence: str  # JSON

    @property
    def report_key(self) -> str:
        return hashlib.sha256(json.dumps([self.session_id, self.node_id, list(self.auditors)]).encode()).hexdigest()


def void_note(audit_id: str, kind: str, reason: str) -> str:
    """Why a billing record is not paid: the failed audit of its node (``billing_records.voided``)."""
    return f"audit {audit_id} failed the node ({kind}): {reason}"


class AuditStore:
    """The two tables over ``TrackerDB``'s engine, and the suspensions in memory (asked for every node
    at every registration and route), read at start and kept in step with every write."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._suspended = {s["node_id"]: str(s["reason"]) for s in self.suspensions()}

    def suspended(self, node_id: str) -> str | None:
        """Why ``node_id`` is suspended; ``None`` when it is not."""
        return self._suspended.get(node_id)

    def record(self, row: AuditRow) -> tuple[dict[str, Any], bool]:
        """Store a report; (the stored record, whether it is new). A resend of a stored report (the
        same session, node and auditors) answers the stored one and writes nothing."""
        held = self._by_key(row.report_key)
        if held is not None:
            return held, False
        value = {
            "audit_id": "aud-" + secrets.token_hex(12),
            "report_key": row.report_key,
            "session_id": row.session_id,
            "node_id": row.node_id,
            "layers": row.layers,
            "kind": row.kind,
            "verdict": row.verdict,
            "reason": row.reason,
            "auditors": json.dumps(list(row.auditors)),
            "recorded_at": time.time(),
            "evidence": row.evidence,
        }
        try:
            with self._engine.begin() as conn:
                conn.execute(sa.insert(AUDITS_TABLE).values(**value))
        except sa.exc.IntegrityError:  # the same report, written between the look and the write
            held = self._by_key(row.report_key)
            if held is None:
                raise
            return held, False
        return _listed(value), True

    def _by_key(self, key: str) -> dict[str, Any] | None:
        query = sa.select(*[AUDITS_TABLE.c[f] for f in _LISTED]).where(AUDITS_TABLE.c.report_key == key)
        with self._engine.connect() as conn:
            row = conn.execute(query).mappings().first()
        return None if row is None else _listed(row)

    def listing(
        self, *, node_id: str | None = None, session_id: str | None = None, verdict: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """Stored reports matching the filters, newest first (without their evidence)."""
        c = AUDITS_TABLE.c
        pairs = ((c.node_id, node_id), (c.session_id, session_id), (c.verdict, verdict))
        where = [column == value for column, value in pairs if value is not None]
        query = sa.select(*[c[f] for f in _LISTED]).where(*where).order_by(c.id.desc()).limit(limit)
        with self._engine.connect() as conn:
            return [_listed(r) for r in conn.execute(query).mappings()]

    def failing_auditors(self, node_id: str) -> set[str]:
        """Every auditor whose statement a verified failed re-execution of ``node_id`` carried."""
        c = AUDITS_TABLE.c
        query = sa.select(c.auditors).where(c.node_id == node_id, c.kind == "reexecuted", c.verdict == "fail")
        with self._engine.connect() as conn:
            return {a for (raw,) in conn.execute(query) for a in json.loads(raw)}

    def suspensions(self) -> list[dict[str, Any]]:
        with self._engine.connect() as conn:
            rows = conn.execute(sa.select(_SUSPENSIONS).order_by(_SUSPENSIONS.c.since)).mappings().all()
        return [dict(r) for r in rows]

    def suspend(self, node_id: str, reason: str, audit_id: str) -> dict[str, Any]:
        """Suspend ``node_id``; its suspension (the first one stays when it already is suspended)."""
        value: dict[str, Any] = {"node_id": node_id, "reason": reason, "since": time.time(), "audit_id": audit_id}
        try:
            with self._engine.begin() as conn:
                conn.execute(sa.insert(_SUSPENSIONS).values(**value))
        except sa.exc.IntegrityError:
            with self._engine.connect() as conn:
                row = conn.execute(sa.select(_SUSPENSIONS).where(_SUSPENSIONS.c.node_id == node_id)).mappings().one()
            value = dict(row)
        self._suspended[node_id] = str(value["reason"])
        return value

    def lift(self, node_id: str) -> bool:
        """Lift ``node_id``'s suspension; False when it had none."""
        with self._engine.begin() as conn:
            lifted = bool(conn.execute(sa.delete(_SUSPENSIONS).where(_SUSPENSIONS.c.node_id == node_id)).rowcount)
        self._suspended.pop(node_id, None)
        return lifted


def _listed(row: Any) -> dict[str, Any]:
    return {**{f: row[f] for f in _LISTED}, "auditors": json.loads(row["auditors"])}
