"""The tracker's persistent state through SQLAlchemy: SQLite by default, PostgreSQL by URL.

Two tables here: ``sessions`` (each session's pinned route, its status and repairs) and
``billing_records`` (per session and node: the positions it computed and the billing units by
``meshnet.tracker.billing``; ``voided``: why a failed audit took its pay away, ``tracker.audits``);
two more, ``audits`` and ``suspensions``, in ``tracker.audit_store`` (``TrackerDB.audits``).
Every write is one committed transaction, so whatever the tracker acknowledged survives a
``kill -9``; ``(session_id, node_id)`` is unique, so a record resent by a gateway that never saw
the acknowledgement is recognised as a duplicate instead of billed twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from meshnet.tracker.audit_store import AUDIT_METADATA, AUDITS_TABLE, AuditStore, void_note
from meshnet.tracker.billing import bill

__all__ = ["BillingRow", "TrackerDB", "member"]

_metadata = sa.MetaData()
_sessions = sa.Table(
    "sessions",
    _metadata,
    sa.Column("session_id", sa.String(64), primary_key=True),
    sa.Column("route_id", sa.String(64), nullable=False),
    sa.Column("model", sa.String(512), nullable=False),
    sa.Column("hops", sa.Text, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("status", sa.String(16), nullable=False, server_default="open"),
    sa.Column("updated", sa.Float, nullable=False, server_default="0"),
    sa.Column("repairs", sa.Integer, nullable=False, server_default="0"),
    sa.Column("ended_reason", sa.Text, nullable=True),
    # Every "NODE_ID LAYERS" that was ever on the route (repairs add to it): whose work may be billed.
    sa.Column("members", sa.Text, nullable=False, server_default="[]"),
    # {"NODE_ID LAYERS": hop key} of every member that advertised one (protocol.signing): its
    # billing receipts are checked against it, after a repair replaced it too.
    sa.Column("hop_keys", sa.Text, nullable=False, server_default="{}"),
    # 1: the session's route and every repair of it take trusted nodes only (POST /v1/sessions).
    sa.Column("trusted_only", sa.Integer, nullable=False, server_default="0"),
    # The member (a private swarm's gateway) that opened it: only it repairs, reports, bills, closes.
    sa.Column("owner", sa.String(128), nullable=True),
    # The gateway's key (protocol.signing) pinned when it opened the session: its billing is countersigned.
    sa.Column("gateway_key", sa.String(64), nullable=True),
    # Every session open expires idle open sessions; closed ones stay (billing, audit), so the
    # expiry must not scan them all.
    sa.Index("sessions_status_updated", "status", "updated"),
)
_billing = sa.Table(
    "billing_records",
    _metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("session_id", sa.String(64), nullable=False),
    sa.Column("node_id", sa.String(128), nullable=False),
    sa.Column("route_id", sa.String(64), nullable=False),
    sa.Column("model", sa.String(512), nullable=False),
    sa.Column("layers", sa.String(32), nullable=False),
    sa.Column("prefill_tokens", sa.BigInteger, nullable=False),
    sa.Column("decode_tokens", sa.BigInteger, nullable=False),
    sa.Column("prefill_layer_tokens", sa.BigInteger, nullable=False),
    sa.Column("decode_layer_tokens", sa.BigInteger, nullable=False),
    sa.Column("units", sa.Float, nullable=False),
    sa.Column("outcome", sa.String(16), nullable=False),
    sa.Column("recorded_at", sa.Float, nullable=False),
    # The node's signed receipt for the work (tracker.receipts; JSON), checked when the record was taken.
    sa.Column("receipt", sa.Text, nullable=True),
    # The gateway's countersignature of the whole report (protocol.signing.countersign), checked.
    sa.Column("countersignature", sa.String(128), nullable=True),
    # Why the record is not paid (a failed audit of the node, tracker.audits); None: it is.
    sa.Column("voided", sa.Text, nullable=True),
    sa.UniqueConstraint("session_id", "node_id", name="billing_session_node"),
)
_BILLING_FIELDS = [c.name for c in _billing.columns if c.name != "id"]
_SCHEMAS = (_metadata, AUDIT_METADATA)


def _tables() -> list[sa.Table]:
    return [table for schema in _SCHEMAS for table in schema.sorted_tables]


@dataclass(frozen=True, slots=True)
class BillingRow:
    """One node's work for one session, as the gateway counted it."""

    node_id: str
    layers: str
    n_layers: int
    prefill_tokens: int
    decode_tokens: int
    receipt: str | None = None  # its signed receipt, as JSON
    countersignature: str | None = None  # the gateway's, over the report it came in


def _members(hops: Sequence[dict[str, Any]], before: Sequence[str]) -> list[str]:
    return sorted({*before, *(member(h["node_id"], h["layers"]) for h in hops)})


def _hop_keys(hops: Sequence[dict[str, Any]], before: dict[str, str]) -> dict[str, str]:
    keys = {member(h["node_id"], h["layers"]): h["hop_key"] for h in hops if isinstance(h.get("hop_key"), str)}
    return {**before, **keys}


def _stored_members(raw: str, hops: Sequence[dict[str, Any]]) -> list[str]:
    """A session's stored members; one written by an older tracker has none stored, and its current
    hops are all it knows."""
    return list(json.loads(raw)) or _members(hops, [])


def member(node_id: str, layers: str) -> str:
    """How a session's ``members`` name a node that served a layer range of it."""
    return f"{node_id} {layers}"


class TrackerDB:
    """Thread-safe (SQLAlchemy's pool); every write is its own committed transaction."""

    def __init__(self, url: str) -> None:
        for plain in ("postgresql://", "postgres://"):  # SQLAlchemy would look for psycopg2; we ship psycopg 3
            if url.startswith(plain):
                url = "postgresql+psycopg://" + url.removeprefix(plain)
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).expanduser().parent.mkdir(parents=True, exist_ok=True)
        try:
            self._engine = sa.create_engine(url, future=True, pool_pre_ping=True)
            for schema in _SCHEMAS:
                schema.create_all(self._engine)
            self._add_missing_columns()
        except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
            raise ValueError(f"--db {url!r} is not a usable database URL: {exc}") from None
        except sa.exc.OperationalError as exc:
            raise ValueError(f"cannot open database {url!r}: {exc.orig}") from None
        self.url_for_display = self._engine.url.render_as_string(hide_password=True)
        self.audits = AuditStore(self._engine)  # audit reports and suspensions (tracker.audits)

    def _add_missing_columns(self) -> None:
        """Bring a database written by an older tracker up to date (additive changes only)."""
        inspector = sa.inspect(self._engine)
        with self._engine.begin() as conn:
            for table in _tables():
                have = {c["name"] for c in inspector.get_columns(table.name)}
                for column in table.columns:
                    if column.name not in have:
                        kind = column.type.compile(dialect=self._engine.dialect)
                        default = column.server_default.arg if column.server_default is not None else None  # type: ignore[attr-defined]
                        tail = f" NOT NULL DEFAULT '{default}'" if default is not None else ""
                        conn.execute(sa.text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}{tail}'))
            for table in _tables():  # an index on a column just added, or new in this version
                for index in table.indexes:
                    index.create(conn, checkfirst=True)

    # -- sessions ------------------------------------------------------------------------------
    def save_session(self, session: dict[str, Any]) -> None:
        row = {**session, "hops": json.dumps(session["hops"]), "status": "open", "updated": session["created"]}
        row["trusted_only"] = int(bool(session.get("trusted_only")))
        row["members"] = json.dumps(_members(session["hops"], []))
        row["hop_keys"] = json.dumps(_hop_keys(session["hops"], {}))
        with self._engine.begin() as conn:
            conn.execute(sa.insert(_sessions).values(**row))

    def load_session(self, session_id: str) -> dict[str, Any] | None:
        with self._engine.connect() as conn:
            row = conn.execute(sa.select(_sessions).where(_sessions.c.session_id == session_id)).mappings().first()
        if row is None:
            return None
        hops = json.loads(row["hops"])
        members = _stored_members(row["members"], hops)
        keys = json.loads(row["hop_keys"]) or _hop_keys(hops, {})
        return {**row, "hops": hops, "members": members, "hop_keys": keys, "trusted_only": bool(row["trusted_only"])}

    def repin_session(self, session_id: str, hops: list[dict[str, Any]]) -> None:
        """A repaired route: the session's new hops (route id and session stay); the replaced hops stay
        members (their work is billed)."""
        with self._engine.begin() as conn:
            row = conn.execute(
                sa.select(_sessions.c.hops, _sessions.c.members, _sessions.c.hop_keys).where(
                    _sessions.c.session_id == session_id
                )
            ).first()
            before = _stored_members(row.members, json.loads(row.hops)) if row is not None else []
            keys = _hop_keys(hops, json.loads(row.hop_keys) if row is not None else {})
            conn.execute(
                sa.update(_sessions)
                .where(_sessions.c.session_id == session_id)
                .values(
                    hops=json.dumps(hops),
                    members=json.dumps(_members(hops, before)),
                    hop_keys=json.dumps(keys),
                    repairs=_sessions.c.repairs + 1,
                    updated=time.time(),
                )
            )

    def end_session(self, session_id: str, status: str, reason: str) -> bool:
        """Mark an open session ended (``closed`` / ``expired``); False if there is no open one."""
        with self._engine.begin() as conn:
            result = conn.execute(
                sa.update(_sessions)
                .where(_sessions.c.session_id == session_id, _sessions.c.status == "open")
                .values(status=status, ended_reason=reason, updated=time.time())
            )
        return bool(result.rowcount)

    def expire_sessions(self, idle_s: float) -> int:
        cutoff = time.time() - idle_s
        with self._engine.begin() as conn:
            result = conn.execute(
                sa.update(_sessions)
                .where(_sessions.c.status == "open", _sessions.c.updated < cutoff)
                .values(status="expired", ended_reason=f"no activity for {idle_s:g}s", updated=time.time())
            )
        return int(result.rowcount)

    def open_sessions_of(self, owner: str) -> int:
        """How many sessions the member ``owner`` holds open."""
        query = sa.select(sa.func.count()).where(_sessions.c.status == "open", _sessions.c.owner == owner)
        with self._engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def open_sessions(self) -> list[dict[str, Any]]:
        with self._engine.connect() as conn:
            rows = conn.execute(sa.select(_sessions).where(_sessions.c.status == "open")).mappings().all()
        return [{**row, "hops": json.loads(row["hops"]), "trusted_only": bool(row["trusted_only"])} for row in rows]

    # -- billing -------------------------------------------------------------------------------
    def record_billing(self, session: dict[str, Any], outcome: str, rows: Sequence[BillingRow]) -> bool:
        """Write a session's records in one transaction; False if they were already recorded. A record
        of a node a failed audit voids (``_void_reason``) is written voided."""
        now = time.time()
        values = []
        for row in rows:
            b = bill(prefill_tokens=row.prefill_tokens, decode_tokens=row.decode_tokens, layers=row.n_layers)
            values.append(
                {
                    "session_id": session["session_id"],
                    "node_id": row.node_id,
                    "route_id": session["route_id"],
                    "model": session["model"],
                    "layers": row.layers,
                    "prefill_tokens": row.prefill_tokens,
                    "decode_tokens": row.decode_tokens,
                    "prefill_layer_tokens": b.prefill_layer_tokens,
                    "decode_layer_tokens": b.decode_layer_tokens,
                    "units": b.units,
                    "outcome": outcome,
                    "recorded_at": now,
                    "receipt": row.receipt,
                    "countersignature": row.countersignature,
                }
            )
        try:
            with self._engine.begin() as conn:
                for value in values:
                    value["voided"] = _void_reason(conn, session, value["node_id"])
                conn.execute(sa.insert(_billing), values)
        except sa.exc.IntegrityError:
            return False
        return True

    def billing(
        self, *, session_id: str | None = None, node_id: str | None = None, limit: int = 100, offset: int = 0
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Records (oldest first) and totals over every record that matches the filters."""
        where = []
        if session_id is not None:
            where.append(_billing.c.session_id == session_id)
        if node_id is not None:
            where.append(_billing.c.node_id == node_id)
        query = sa.select(*[_billing.c[f] for f in _BILLING_FIELDS]).where(*where).order_by(_billing.c.id)
        paid = _billing.c.voided.is_(None)

        def total(column: Any, *, voided: bool = False) -> Any:
            kept = sa.case((sa.not_(paid) if voided else paid, column), else_=0)
            return sa.func.coalesce(sa.func.sum(kept), 0)

        totals_query = sa.select(
            sa.func.count(),
            sa.func.count(sa.distinct(_billing.c.session_id)),
            total(_billing.c.prefill_layer_tokens),
            total(_billing.c.decode_layer_tokens),
            total(_billing.c.units),
            total(sa.literal(1), voided=True),
            total(_billing.c.units, voided=True),
        ).where(*where)
        with self._engine.connect() as conn:
            rows = [dict(r) for r in conn.execute(query.limit(limit).offset(offset)).mappings()]
            count, sessions, prefill, decode, units, voided, voided_units = conn.execute(totals_query).one()
        totals = {
            "records": int(count),  # every matching record, voided ones too (what limit/offset page over)
            "sessions": int(sessions),
            # What is paid: voided records (a failed audit of their node) are left out, and counted apart.
            "prefill_layer_tokens": int(prefill),
            "decode_layer_tokens": int(decode),
            "units": round(float(units), 6),
            "voided_records": int(voided),
            "voided_units": round(float(voided_units), 6),
        }
        return rows, totals

    def void_billing(self, node_id: str, note: str, *, session_id: str | None = None) -> int:
        """Void the records of ``node_id`` not voided yet (of ``session_id`` only, when given); how many."""
        where = [_billing.c.node_id == node_id, _billing.c.voided.is_(None)]
        if session_id is not None:
            where.append(_billing.c.session_id == session_id)
        with self._engine.begin() as conn:
            return int(conn.execute(sa.update(_billing).where(*where).values(voided=note)).rowcount)

    def close(self) -> None:
        self._engine.dispose()


def _void_reason(conn: sa.Connection, session: dict[str, Any], node_id: str) -> str | None:
    """Why ``node_id``'s work for ``session`` is not paid: a failed audit of it about this session, or a
    failed re-execution of it recorded after the session started (its pay until the verdict is void)."""
    a = AUDITS_TABLE.c
    query = (
        sa.select(a.audit_id, a.kind, a.reason)
        .where(
            a.node_id == node_id,
            a.verdict == "fail",
            sa.or_(
                a.session_id == session["session_id"],
                sa.and_(a.kind == "reexecuted", a.recorded_at >= float(session["created"])),
            ),
        )
        .order_by(a.id)
        .limit(1)
    )
    found = conn.execute(query).first()
    return None if found is None else void_note(found.audit_id, found.kind, found.reason)
