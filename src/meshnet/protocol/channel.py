"""Frames of the decode channel: the kept-open WebSocket between a gateway and each hop of its
routes, and between neighbouring hops (docs/protocol.md, "Decode channel").

Every WebSocket *binary* message is one frame::

    b"MN" | version u8 (1) | kind u8 | header length u32 little-endian | header (UTF-8 JSON) | body

The header is small (a session id, a step number and the same ``X-Meshnet-*`` fields a
``decode-step`` request carries); the body is the raw tensor, exactly the bytes the HTTP binding
sends, so nothing large is ever parsed as JSON. Kinds:

- ``HELLO`` (server → dialer, once, first): ``{"channel": id, "node": node_id, "version": 1}``.
  The id names this connection as a return address.
- ``STEP`` (gateway → head, hop → next hop): ``{"session", "seq", "verb": "decode-step"|"verify",
  "headers": {X-Meshnet-*: str}, "returns": [channel id per hop from the receiver on],
  "hops": [the entries of the hops before it]}`` + the step's body.
- ``TOKEN`` (tail → gateway, on the gateway's own channel to the tail): ``{"session", "seq",
  "answer": {...}}`` — the answer a ``decode-step``/``verify`` request would get, with every hop's entry.
- ``ERROR`` (any hop → gateway, on the gateway's channel to that hop): ``{"session", "seq",
  "status", "error": {...}}`` — the error body the HTTP binding would send.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from meshnet.errors import InvalidRequest, MeshnetError
from meshnet.httputil import error_body

__all__ = [
    "CHANNEL_PATH",
    "MAX_HEADER_BYTES",
    "VERSION",
    "ChannelFrame",
    "Kind",
    "decode_frame",
    "encode_frame",
    "error_frame",
    "ws_url",
]

CHANNEL_PATH = "/v1/channel"
MAGIC = b"MN"
VERSION = 1
MAX_HEADER_BYTES = 1 << 20
_PREFIX = struct.Struct("<2sBBI")


class Kind(IntEnum):
    HELLO = 1
    STEP = 2
    TOKEN = 3
    ERROR = 4


@dataclass(frozen=True, slots=True)
class ChannelFrame:
    kind: Kind
    header: dict[str, Any]
    body: bytes = b""


def encode_frame(kind: Kind, header: dict[str, Any], body: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, int(kind), len(raw)) + raw + body


def decode_frame(data: bytes) -> ChannelFrame:
    """One frame, or ``InvalidRequest`` saying what is wrong with it."""
    if len(data) < _PREFIX.size:
        raise InvalidRequest(f"a channel frame is at least {_PREFIX.size} bytes, got {len(data)}")
    magic, version, kind, size = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise InvalidRequest(f"not a Meshnet channel frame: it starts with {magic!r}, not {MAGIC!r}")
    if version != VERSION:
        raise InvalidRequest(f"channel frame version {version}; this node speaks version {VERSION}")
    if kind not in Kind._value2member_map_:
        raise InvalidRequest(f"unknown channel frame kind {kind}")
    if size > MAX_HEADER_BYTES or _PREFIX.size + size > len(data):
        raise InvalidRequest(f"channel frame header of {size} bytes does not fit the {len(data)}-byte frame")
    try:
        header = json.loads(data[_PREFIX.size : _PREFIX.size + size])
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"channel frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidRequest("channel frame header must be a JSON object")
    return ChannelFrame(Kind(kind), header, bytes(data[_PREFIX.size + size :]))


def error_frame(session: str | None, seq: int | None, error: MeshnetError) -> bytes:
    return encode_frame(Kind.ERROR, {"session": session, "seq": seq, "status": error.status, **error_body(error)})


def ws_url(http_url: str) -> str:
    """The channel's address on a node advertised at ``http_url``."""
    scheme, sep, rest = http_url.rstrip("/").partition("://")
    if not sep or scheme not in ("http", "https"):
        raise ValueError(f"a node URL must be http:// or https://, got {http_url!r}")
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest}{CHANNEL_PATH}"
