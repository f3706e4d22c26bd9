"""Signed hop entries: no hop of a route can answer for another (docs/security.md, "Signed entries").

Every node holds an Ed25519 *hop key*, made at start-up; it registers the public half with the
tracker (``hop_key`` in its advertisement), which hands it to the gateway with every route. Each
entry a hop puts in an answer (protocol.messages.HopEntry: its layers, the positions it holds, the
digests of what it computed from and sent on, its compute time) carries the hop's signature over
that entry and the session id; the tail's signature also covers what it answered (the token and
its logprob, or a verify chunk's tokens). The gateway checks every entry against the key the
tracker pinned for that hop: an entry another hop made up, or a token a hop in between changed,
fails the check, and the generation stops (``RouteInconsistent``) instead of streaming it.

The signed bytes are ``b"meshnet-hop-entry/1\\n"`` and the compact JSON of ``{"session", "entry",
"answer"}`` with sorted keys: ``entry`` is the entry's JSON without its signature, ``answer`` the
tail's answer without its ``hops`` (``null`` for other hops). Python writes a float as the shortest
text that reads back as the same float, so the gateway, which parsed the answer, writes the same bytes.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from meshnet.errors import RouteInconsistent
from meshnet.protocol.ledger import check_answered_by
from meshnet.protocol.messages import AnswerKind, HopAnswer, HopEntry
from meshnet.routes import Hop

__all__ = [
    "CLAIMED_KINDS",
    "COUNTERSIGNATURE",
    "HOP_KEY_CHARS",
    "HopKey",
    "b64",
    "billing_bytes",
    "check_public_key",
    "check_signatures",
    "claim_of",
    "countersign",
    "countersigned_by",
    "public_key",
    "signed_by",
    "signed_bytes",
    "unb64",
]

_DOMAIN = b"meshnet-hop-entry/1\n"
_BILLING_DOMAIN = b"meshnet-billing/1\n"
COUNTERSIGNATURE = "countersignature"  # the billing report's field that carries the gateway's
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")
HOP_KEY_CHARS = 43  # an Ed25519 public key (32 bytes), base64url without padding
CLAIMED_KINDS = frozenset({AnswerKind.TOKEN, AnswerKind.TOKENS})  # answers whose content the tail signs (Sampled)
_A = TypeVar("_A", bound=HopAnswer)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    """Strict base64url without padding: a character outside its alphabet is an error, not skipped."""
    if not _BASE64URL.fullmatch(text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def claim_of(answer: HopAnswer) -> dict[str, Any] | None:
    """What the tail signs of its own answer: the answer without its entries (``None``: an answer whose
    content no hop vouches for beyond its entry)."""
    if answer.kind not in CLAIMED_KINDS:
        return None
    claim = answer.to_json()
    del claim["hops"]
    return claim


def signed_bytes(session: str, entry: HopEntry, claim: dict[str, Any] | None) -> bytes:
    raw = entry.to_json()
    raw.pop("sig", None)  # the entry as signed: without its signature
    body = {"session": session, "entry": raw, "answer": claim}
    return _DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


class HopKey:
    """A node's signing key for its entries; ``public`` goes into its advertisement."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        raw = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.public = b64(raw)

    @classmethod
    def generate(cls) -> HopKey:
        return cls(Ed25519PrivateKey.generate())

    def sign_bytes(self, data: bytes) -> bytes:
        """The raw signature over ``data`` (for records other than entries: protocol.audits)."""
        return self._key.sign(data)

    def sign(self, session: str, entry: HopEntry, answer: HopAnswer | None = None) -> HopEntry:
        """``entry`` with this key's signature over it, the session and (at the tail) ``answer``'s content."""
        claim = None if answer is None else claim_of(answer)
        return entry.signed(b64(self._key.sign(signed_bytes(session, entry, claim))))

    def sign_answer(self, session: str, answer: _A) -> _A:
        """``answer`` with its last entry (the tail's own) signed over the answer's content too."""
        *before, own = answer.hops
        return dataclasses.replace(answer, hops=(*before, self.sign(session, own, answer)))


def check_public_key(text: str) -> str:
    """``text`` if it is an Ed25519 public key as ``HopKey.public`` writes one; else ``ValueError``."""
    if len(text) != HOP_KEY_CHARS:
        raise ValueError(f"a hop key is {HOP_KEY_CHARS} characters of base64url (an Ed25519 public key)")
    try:
        Ed25519PublicKey.from_public_bytes(unb64(text))
    except ValueError:  # binascii.Error is one
        raise ValueError("a hop key is an Ed25519 public key in base64url") from None
    return text


_KEYS: dict[str, Ed25519PublicKey] = {}  # parsed once per key: a route's keys are checked at every step


def public_key(text: str) -> Ed25519PublicKey:
    key = _KEYS.get(text)
    if key is None:
        if len(_KEYS) > 4096:
            _KEYS.clear()
        key = _KEYS[text] = Ed25519PublicKey.from_public_bytes(unb64(text))
    return key


def signed_by(key: str, session: str, entry: HopEntry, claim: dict[str, Any] | None) -> bool:
    """Whether ``entry`` carries the signature of ``key`` over itself, ``session`` and ``claim``."""
    if entry.signature is None:
        return False
    try:
        public_key(key).verify(unb64(entry.signature), signed_bytes(session, entry, claim))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def billing_bytes(report: dict[str, Any]) -> bytes:
    """What a gateway countersigns of a billing report: the report as sent, less the countersignature,
    as compact JSON with sorted keys (the tracker reads it back from the same JSON: the same bytes)."""
    body = {k: v for k, v in report.items() if k != COUNTERSIGNATURE}
    return _BILLING_DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def countersign(key: HopKey, report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with ``key``'s countersignature: the gateway vouches for its count and the receipts."""
    return {**report, COUNTERSIGNATURE: b64(key.sign_bytes(billing_bytes(report)))}


def countersigned_by(key: str, report: dict[str, Any]) -> bool:
    signature = report.get(COUNTERSIGNATURE)
    if not isinstance(signature, str):
        return False
    try:
        public_key(key).verify(unb64(signature), billing_bytes(report))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def check_signatures(session: str, route: Sequence[Hop], answer: HopAnswer, *, tail_only: bool = False) -> None:
    """Raise ``RouteInconsistent`` unless ``answer`` has one entry per hop of ``route``, in order, each
    signed by the key the tracker pinned for its hop (a hop pinned without a key, an in-process
    route, is not checked), the last one also over the answer's content. (Without the count, a hop
    could answer alone, sign the answer itself and have the tail blamed for its token.)

    ``tail_only``: verify only the last entry's signature (the tail's, over the answer: what protects
    the tokens), and of the others only that they carry one. Their signatures are an account of
    work, checked where that account is used (``gateway.billing_outbox.Usage.check_receipts``):
    an Ed25519 check is ~80 µs, and checking every hop's at every decode step was the largest
    part of a gateway's own time per token."""
    check_answered_by(route, answer.hops)
    last = len(answer.hops) - 1
    for i, (hop, entry) in enumerate(zip(route, answer.hops, strict=True)):
        if hop.key is None:
            continue
        where = f"the entry of node {hop.node} (layers {hop.layers})"
        if entry.signature is None:
            raise RouteInconsistent(f"{where} is not signed: a hop answered for it, or it runs an older Meshnet")
        if tail_only and i != last:
            continue
        claim = claim_of(answer) if i == last else None
        if not signed_by(hop.key, session, entry, claim):
            what = f"{where} and the answer it vouches for" if claim is not None else where
            raise RouteInconsistent(f"{what} does not carry its signature: another hop made it up or changed it")
