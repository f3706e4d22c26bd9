"""The tracker's persistent state through SQLAlchemy: SQLite by default, PostgreSQL by URL.

Today: sessions with their pinned routes. Billing records join them with the tracker issue.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import sqlalchemy as sa

__all__ = ["TrackerDB"]

_metadata = sa.MetaData()
_sessions = sa.Table(
    "sessions",
    _metadata,
    sa.Column("session_id", sa.String(64), primary_key=True),
    sa.Column("route_id", sa.String(64), nullable=False),
    sa.Column("model", sa.String(512), nullable=False),
    sa.Column("hops", sa.Text, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
)


class TrackerDB:
    """Thread-safe (SQLAlchemy's pool); every write is its own committed transaction."""

    def __init__(self, url: str) -> None:
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).expanduser().parent.mkdir(parents=True, exist_ok=True)
        try:
            self._engine = sa.create_engine(url, future=True, pool_pre_ping=True)
            _metadata.create_all(self._engine)
        except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
            raise ValueError(f"--db {url!r} is not a usable database URL: {exc}") from None
        except sa.exc.OperationalError as exc:
            raise ValueError(f"cannot open database {url!r}: {exc.orig}") from None
        self.url_for_display = self._engine.url.render_as_string(hide_password=True)

    def save_session(self, session: dict[str, Any]) -> None:
        row = {**session, "hops": json.dumps(session["hops"])}
        with self._engine.begin() as conn:
            conn.execute(sa.insert(_sessions).values(**row))

    def load_session(self, session_id: str) -> dict[str, Any] | None:
        with self._engine.connect() as conn:
            row = conn.execute(sa.select(_sessions).where(_sessions.c.session_id == session_id)).mappings().first()
        if row is None:
            return None
        return {**row, "hops": json.loads(row["hops"])}

    def delete_session(self, session_id: str) -> bool:
        with self._engine.begin() as conn:
            result = conn.execute(sa.delete(_sessions).where(_sessions.c.session_id == session_id))
        return bool(result.rowcount)

    def close(self) -> None:
        self._engine.dispose()
