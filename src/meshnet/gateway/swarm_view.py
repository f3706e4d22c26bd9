"""What ``GET /v1/swarm`` shows of the swarm: the tracker's node list and each node's own health,
read as answers from members that may lie.

Every member of a private swarm can register a node, so a node's ``/v1/health`` is a stranger's
answer (issue 28): one that sent 200 MiB grew the gateway from 130 MiB to 1.3 GiB, and one whose
URL pointed at some other port made the gateway print the connection error (a port scanner reading
the dashboard). Here every answer is read

- within a byte budget (``MAX_HEALTH_BYTES`` for a node, ``MAX_NODES_BYTES`` for the tracker's
  list), streamed and abandoned past it, and within ``PROBE_S`` overall (a slow trickle counts);
- into the known fields only, each of its type (strings cut to ``MAX_TEXT``): ``HEALTH_FIELDS``;
- with one fixed reason when it fails, whatever the failure was (``UNREACHABLE``).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any

import httpx

__all__ = ["HEALTH_FIELDS", "MAX_HEALTH_BYTES", "UNREACHABLE", "fetch_json", "node_health"]

MAX_HEALTH_BYTES = 64 * 1024  # a node's real health answer is under 2 KiB
MAX_NODES_BYTES = 8 * 2**20  # the tracker's node list: a few hundred bytes a node
MAX_TEXT = 256
PROBE_S = 5.0
# One reason for every failure: refused, timed out, TLS, not JSON, too large, an error status.
UNREACHABLE = "no valid health answer"


def _text(value: object) -> str | None:
    return value[:MAX_TEXT] if isinstance(value, str) else None


def _count(value: object) -> int | None:
    # bool is an int to Python, never a count; a count is a sane non-negative integer
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63 else None


def _flag(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _number(value: object) -> float | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    return float(value) if math.isfinite(value) and abs(value) < 1e18 else None


def _counts(value: object) -> list[int] | None:
    if not isinstance(value, list) or len(value) > 8:
        return None
    counts = [_count(v) for v in value]
    return None if None in counts else [c for c in counts if c is not None]


def _count_map(value: object) -> dict[str, int] | None:
    if not isinstance(value, dict) or len(value) > 32:
        return None
    return {k[:64]: c for k, v in value.items() if isinstance(k, str) and (c := _count(v)) is not None}


# The fields of a node's /v1/health (node.app) the dashboard reads, each with its reader.
HEALTH_FIELDS: dict[str, Callable[[object], object]] = {
    "node_id": _text, "url": _text, "model": _text, "architecture": _text, "backend": _text, "layers": _text,
    "total_layers": _count, "sessions": _count, "max_sessions": _count, "max_positions": _count,
    "kv_bytes_used": _count, "kv_bytes_free": _count, "kv_bytes_parked": _count, "kv_bytes_per_token": _count,
    "weight_bytes": _count, "seam": _counts, "max_verify": _count, "verify_batched": _flag,
    "verify_batched_below": _count, "decode_batch": _count, "decode_batch_below": _count,
    "prefix_cache": _count_map, "started": _number,
}  # fmt: skip


def node_health(answer: object) -> dict[str, Any]:
    """The known fields of a node's health answer, each of its type; anything else is dropped. A
    node is ``ok`` only when it says exactly that."""
    if not isinstance(answer, dict):
        return {"status": "unreachable", "reason": UNREACHABLE}
    kept: dict[str, Any] = {"status": "ok" if answer.get("status") == "ok" else "unknown"}
    for name, read in HEALTH_FIELDS.items():
        value = read(answer.get(name))
        if value is not None:
            kept[name] = value
    return kept


async def fetch_json(client: httpx.AsyncClient, url: str, limit: int) -> object | None:
    """The JSON of a 200 answer at ``url``, read within ``limit`` bytes and ``PROBE_S`` seconds;
    ``None`` for anything else (the caller says ``UNREACHABLE``, never why)."""
    try:
        return await asyncio.wait_for(_read(client, url, limit), PROBE_S)
    except (TimeoutError, httpx.HTTPError, ValueError, RecursionError):
        return None


async def _read(client: httpx.AsyncClient, url: str, limit: int) -> object | None:
    async with client.stream("GET", url) as response:
        if response.status_code != 200:
            return None
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return None
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > limit:
                return None
    parsed: object = json.loads(bytes(body))
    return parsed
