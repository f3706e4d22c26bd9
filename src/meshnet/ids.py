"""Distinct ID types, so a session id can never be passed where a route id belongs."""

from __future__ import annotations

import re
import secrets
from typing import NewType

__all__ = [
    "GenerationId",
    "NodeId",
    "RouteId",
    "SessionId",
    "new_generation_id",
    "new_route_id",
    "new_session_id",
    "parse_generation_id",
]

GenerationId = NewType("GenerationId", str)
SessionId = NewType("SessionId", str)
RouteId = NewType("RouteId", str)
NodeId = NewType("NodeId", str)

# Client-proposed ids travel in headers and URLs: keep them short and URL-safe.
_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def _token() -> str:
    return secrets.token_hex(12)


def new_generation_id() -> GenerationId:
    return GenerationId(f"gen-{_token()}")


def new_session_id() -> SessionId:
    return SessionId(f"ses-{_token()}")


def new_route_id() -> RouteId:
    return RouteId(f"rte-{_token()}")


def parse_generation_id(raw: str) -> GenerationId:
    """Validate a client-proposed generation id; raises ``ValueError`` with the rule."""
    if not _ID_PATTERN.fullmatch(raw):
        raise ValueError(
            "a generation id must be 1-128 characters of letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit"
        )
    return GenerationId(raw)
