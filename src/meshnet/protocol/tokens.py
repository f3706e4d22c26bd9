"""The encoding two signed tokens share: route tickets (``protocol.tickets``) and swarm invites
(``security.invites``) are both ``PREFIX.PAYLOAD.SIGNATURE``, the payload canonical JSON and both
parts canonical unpadded base64url, so exactly one string stands for a given token.

Each token module keeps its own framing, limits and error messages; this one only encodes and
decodes, and says why a text is refused (``ValueError``) for the caller to word as its error.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

__all__ = ["b64url_decode", "b64url_encode", "canonical_json"]

_B64URL = re.compile(r"[A-Za-z0-9_-]*")


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no spaces, ASCII only, no NaN or infinity: the bytes a signature covers."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def b64url_encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """The bytes of canonical unpadded base64url ``text``; ``ValueError`` saying why not (for the
    caller's message: "its payload " + reason)."""
    if not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        raise ValueError("is not base64url (A-Z a-z 0-9 - _, no padding)")
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))  # cannot fail: alphabet and length checked
    if b64url_encode(data) != text:
        raise ValueError("is not canonical base64url (stray bits in its last character)")
    return data
