"""Route tickets: the tracker's signed word on which nodes serve a session, in which order.

The threat it closes (docs/security.md, "No route tickets"). Without tickets, anyone who can reach
a node's port and learns a session id can drive that session: session and route ids are the only
capability, and they show up in the gateway's generation list. A node forwards activations
(and so the prompt's hidden states) to whatever URLs the client names in ``X-Meshnet-Next-Hops``,
and accepts ``POST /v1/sessions/{id}/reroute`` (and the replay it starts) from any caller, so one
request can point a live session at a host of the caller's choosing. With tickets:

- **ids stop being capabilities**: a node opens a session only for a request that carries a valid
  ticket (``X-Meshnet-Ticket``) for that session id and naming this node;
- **nodes stop forwarding to client-chosen URLs**: the next hops are :meth:`RouteTicket.onward_urls`
  of the ticket, never a header;
- **reroute needs the tracker**: reroute and replay are accepted only with a tracker-signed
  ``repair`` ticket for the same session and route id (:func:`repair_ticket`).

Token format (ASCII, safe in an HTTP header, at most :data:`MAX_TICKET_BYTES` bytes)::

    mnt1.<payload>.<signature>

- ``mnt1``: the format's name and version (4 bytes); another version is refused by name;
- ``.``: separator (never inside either base64url part);
- ``<payload>``: base64url (``A-Z a-z 0-9 - _``, no ``=`` padding) of the ticket as canonical JSON:
  one object with exactly the fields of :class:`RouteTicket` (``hops`` a list of
  ``{"layers", "node_id", "url"}`` objects, ``repair_from`` ``null`` on a route ticket), keys
  sorted, separators ``,`` and ``:``, ASCII only (``\\uXXXX`` escapes), no NaN or infinity;
- ``.``: separator;
- ``<signature>``: base64url, no padding, of the 64-byte Ed25519 signature over the ASCII bytes
  ``mnt1.<payload>`` exactly as they appear in the token (prefix, dot and encoded payload).

Both base64url parts must be canonical (re-encoding the decoded bytes gives the same text), so
exactly one string stands for a given ticket: no spare-bit or padding variants.

Verification (:meth:`TicketVerifier.verify`): the shape of the token (prefix, parts, size,
base64url), then the payload's ``tracker_key_id`` (read from the not yet trusted JSON only to
choose a key) picks one of the trusted tracker keys (several during a key rotation); an unknown
key id or a signature that does not verify is ``Unauthorized``.
Only a payload whose signature verified is read field by field: exact types and field set, then
expiry (with :data:`CLOCK_SKEW_S` of allowance), then that the ticket is for the session (and
route) the request names, that the verifying node is on the route, and its kind. A missing,
forged, expired or misdirected ticket is ``Unauthorized``; a token that is not shaped like a
ticket at all is ``InvalidRequest``. Nothing else escapes, whatever the input.

Beyond the signature, a ticket names the session's ``owner`` (the gateway that opened it) and a
route ``epoch`` (one more at every repair). Nodes bind the *drivers* a ticket implies
(:meth:`RouteTicket.drivers`: the owner, and the hop before the node) and serve later requests on
the session only from their member certificates (``node.authority``); they refuse a ticket older
than the newest epoch they verified, and tickets of sessions that ended on them.

What a ticket does not do: it is a capability for one session on one route until it expires, and
every hop of the route sees it (each forwards it to the next). Holding it is not enough to drive
a session (the drivers are checked by certificate), but it still opens a session where the holder
is a driver. Keep the lifetime short: nodes check a ticket when a session opens, on every
reroute/replay and once per epoch on each hop, and a session outlives the ticket it opened with.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshnet.errors import InvalidRequest, Unauthorized
from meshnet.httputil import service_url
from meshnet.ids import RouteId, SessionId
from meshnet.protocol.tokens import b64url_decode, b64url_encode, canonical_json
from meshnet.routes import Hop

__all__ = [
    "CLOCK_SKEW_S",
    "CODE_CLOSED",
    "CODE_EXPIRED",
    "CODE_INVALID",
    "CODE_MALFORMED",
    "CODE_MISMATCH",
    "CODE_MISSING",
    "CODE_SUPERSEDED",
    "MAX_TICKET_BYTES",
    "REPAIR",
    "ROUTE",
    "TICKET_HEADER",
    "TOKEN_PREFIX",
    "RouteTicket",
    "TicketHop",
    "TicketKind",
    "TicketSigner",
    "TicketVerifier",
    "key_id_of",
    "repair_ticket",
    "route_ticket",
]

TICKET_HEADER = "X-Meshnet-Ticket"  # the route (or, on reroute/replay, repair) ticket, verbatim
TOKEN_PREFIX = "mnt1"  # format name and version: the first part of every token
MAX_TICKET_BYTES = 16 * 1024  # a longer token is refused before any decoding
CLOCK_SKEW_S = 30.0  # how far the tracker's and a node's clocks may disagree
KEY_ID_HEX_CHARS = 16  # a key id: this many hex digits of SHA-256 over the raw 32-byte public key
SIGNATURE_BYTES = 64  # Ed25519
MAX_ID_CHARS = 128  # session, route and node ids (the tracker's registration limit for node ids)
MAX_URL_CHARS = 300  # the tracker's registration limit for node URLs
MAX_DIGEST_CHARS = 256

# Stable ``code`` values of the errors ``verify`` raises.
CODE_MISSING = "route_ticket_missing"  # 401: no ticket on a request that needs one
CODE_INVALID = "route_ticket_invalid"  # 401: unknown signing key, or the signature does not verify
CODE_EXPIRED = "route_ticket_expired"  # 401: past its expiry, or issued in the future
CODE_MISMATCH = "route_ticket_mismatch"  # 401: genuine, but for another session/route/node/kind
CODE_MALFORMED = "route_ticket_malformed"  # 400: not shaped like a ticket at all
CODE_SUPERSEDED = "route_ticket_superseded"  # 401: genuine, but a later repair (higher epoch) replaced it
CODE_CLOSED = "route_ticket_closed"  # 401: genuine, but its session was closed on this node
MAX_EPOCH = 2**31 - 1  # a route's repairs: far more than any session lives through

TicketKind = Literal["route", "repair"]
ROUTE: TicketKind = "route"  # issued when the tracker opens a session
REPAIR: TicketKind = "repair"  # issued when the tracker repairs a session's route

_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # as meshnet.ids
_LAYERS_PATTERN = re.compile(r"(0|[1-9][0-9]{0,8}):(0|[1-9][0-9]{0,8})")
_KEY_ID_PATTERN = re.compile(rf"[0-9a-f]{{{KEY_ID_HEX_CHARS}}}")
_HOP_FIELDS = frozenset({"node_id", "url", "layers"})
_TICKET_FIELDS = frozenset(
    {
        "kind",
        "session_id",
        "route_id",
        "model_digest",
        "hops",
        "issued_at",
        "expires_at",
        "repair_from",
        "tracker_key_id",
        "epoch",
        "owner",
    }
)


@dataclass(frozen=True, slots=True)
class TicketHop:
    """One hop of a ticket's route: the node, where to reach it and its ``"start:stop"`` layers.

    ``url`` is exactly a registered node URL (``http(s)://HOST:PORT``, no trailing ``/``): what a
    node compares and dials. Invalid values raise ``ValueError`` saying what is wrong.
    """

    node_id: str
    url: str
    layers: str

    def __post_init__(self) -> None:
        _check_text("a hop's node id", self.node_id, MAX_ID_CHARS)
        if len(self.url) > MAX_URL_CHARS or _canonical_url(self.url) != self.url:
            raise ValueError(
                f"hop {self.node_id}: url {self.url[:MAX_URL_CHARS]!r} must be a node's base URL exactly as it "
                f"registered: http(s)://HOST:PORT, at most {MAX_URL_CHARS} characters, no trailing '/'"
            )
        _layer_bounds(self.node_id, self.layers)

    @classmethod
    def from_hop(cls, hop: Hop) -> TicketHop:
        return cls(hop.node, hop.url, str(hop.layers))

    @property
    def start(self) -> int:
        return _layer_bounds(self.node_id, self.layers)[0]

    @property
    def stop(self) -> int:
        return _layer_bounds(self.node_id, self.layers)[1]

    def as_json(self) -> dict[str, str]:
        return {"node_id": self.node_id, "url": self.url, "layers": self.layers}


@dataclass(frozen=True, slots=True)
class RouteTicket:
    """What the tracker signs: a session's route, head first, valid ``issued_at..expires_at``.

    ``repair_from`` is ``None`` on a ``route`` ticket and, on a ``repair`` ticket, the index of the
    first replaced hop (the hops before it are the old route's). ``tracker_key_id`` names the
    signing key; it is empty on a ticket not signed yet (:meth:`TicketSigner.sign` fills it in).
    ``epoch`` counts the route's repairs (0 on the route ticket, one more on each repair): a node
    that saw an epoch refuses every older ticket of the session. ``owner`` is the member id of
    the gateway that opened the session (empty: the tracker knows none), which alone may drive
    the session's head (:meth:`drivers`). Invalid values raise ``ValueError`` saying what is wrong.
    """

    kind: TicketKind
    session_id: SessionId
    route_id: RouteId
    model_digest: str
    hops: tuple[TicketHop, ...]
    issued_at: float
    expires_at: float
    repair_from: int | None = None
    tracker_key_id: str = ""
    epoch: int = 0
    owner: str = ""

    def __post_init__(self) -> None:
        if self.kind not in (ROUTE, REPAIR):
            raise ValueError(f"a ticket's kind is {ROUTE!r} or {REPAIR!r}, not {self.kind!r}")
        _check_id("session id", self.session_id)
        _check_id("route id", self.route_id)
        _check_text("model digest", self.model_digest, MAX_DIGEST_CHARS)
        _check_hops(self.hops)
        _check_times(self.issued_at, self.expires_at)
        _check_repair_from(self.kind, self.repair_from, len(self.hops))
        if self.tracker_key_id and not _KEY_ID_PATTERN.fullmatch(self.tracker_key_id):
            raise ValueError(f"a tracker key id is {KEY_ID_HEX_CHARS} lowercase hex digits, or empty before signing")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or not 0 <= self.epoch <= MAX_EPOCH:
            raise ValueError(f"a ticket's epoch is an integer 0..{MAX_EPOCH}, got {self.epoch!r}")
        if self.owner:
            _check_text("owner", self.owner, MAX_ID_CHARS)

    def index_of(self, node_id: str) -> int:
        """This node's place on the route (0: the head); ``Unauthorized`` when it is not on it."""
        for i, hop in enumerate(self.hops):
            if hop.node_id == node_id:
                return i
        raise Unauthorized(
            f"node {node_id} is not on this route ({self.kind} ticket of session {self.session_id}, route "
            f"{self.route_id}: {', '.join(h.node_id for h in self.hops)}); send this node the ticket of a "
            "route it serves",
            param=TICKET_HEADER,
            code=CODE_MISMATCH,
        )

    def drivers(self, node_id: str) -> frozenset[str]:
        """The members that may drive this node's part of the session: the gateway that opened it
        (``owner``) and, past the head, the hop before this node on the route (it forwards the
        steps). ``Unauthorized`` when the node is not on the route."""
        i = self.index_of(node_id)
        upstream = {self.hops[i - 1].node_id} if i > 0 else set()
        return frozenset({self.owner} if self.owner else set()) | upstream

    def next_hop_after(self, node_id: str) -> TicketHop | None:
        """The hop this node forwards to, or ``None`` at the tail."""
        i = self.index_of(node_id)
        return self.hops[i + 1] if i + 1 < len(self.hops) else None

    def onward_urls(self, node_id: str) -> tuple[str, ...]:
        """The URLs of every hop after this node, in order (empty at the tail): its next hops."""
        return tuple(h.url for h in self.hops[self.index_of(node_id) + 1 :])

    def as_json(self) -> dict[str, Any]:
        """The payload a token carries (every field, always)."""
        return {
            "kind": self.kind,
            "session_id": self.session_id,
            "route_id": self.route_id,
            "model_digest": self.model_digest,
            "hops": [h.as_json() for h in self.hops],
            "issued_at": float(self.issued_at),
            "expires_at": float(self.expires_at),
            "repair_from": self.repair_from,
            "tracker_key_id": self.tracker_key_id,
            "epoch": self.epoch,
            "owner": self.owner,
        }


def route_ticket(
    session_id: SessionId,
    route_id: RouteId,
    model_digest: str,
    hops: Sequence[TicketHop],
    *,
    ttl_s: float,
    now: float | None = None,
    owner: str = "",
    epoch: int = 0,
) -> RouteTicket:
    """The ``route`` ticket of a session the tracker just opened, valid ``ttl_s`` from ``now``;
    ``owner``: the gateway that opened it; ``epoch``: the repairs its route went through."""
    issued = time.time() if now is None else now
    _check_ttl(ttl_s)
    return RouteTicket(
        ROUTE, session_id, route_id, model_digest, tuple(hops), issued, issued + ttl_s, epoch=epoch, owner=owner
    )


def repair_ticket(
    old: RouteTicket,
    new_hops: Sequence[TicketHop],
    *,
    repair_from: int,
    ttl_s: float,
    now: float | None = None,
    epoch: int | None = None,
) -> RouteTicket:
    """The ``repair`` ticket that replaces ``old``'s hops from index ``repair_from`` on.

    ``new_hops`` is the whole repaired route, head first (the tracker's ``repair``: the hops before
    the replaced run, the new run, the hops after it). What stays: the session id, the route id
    (a repaired route keeps its id: nodes pinned it) and the model digest; the hops before
    ``repair_from`` must be ``old``'s, unchanged — they are the nodes that accept the reroute. What
    changes: the kind (``repair``), the hops from ``repair_from`` on, the validity window (``ttl_s``
    from ``now``), the epoch (``old``'s + 1 unless ``epoch`` says: a standby's contingency ticket
    keeps the current one) and the key id (emptied: whichever key signs the repair names itself). ``old`` may
    itself be a repair ticket (a route repaired twice). ``ValueError`` on a repair that breaks this.
    """
    if not 0 <= repair_from < len(new_hops):
        raise ValueError(f"repair_from {repair_from} must index the new route's {len(new_hops)} hops")
    if tuple(new_hops[:repair_from]) != old.hops[:repair_from]:
        raise ValueError(
            f"a repair from hop {repair_from} keeps the hops before it: the new route starts "
            f"{[h.node_id for h in new_hops[:repair_from]]}, the old one "
            f"{[h.node_id for h in old.hops[:repair_from]]}"
        )
    issued = time.time() if now is None else now
    _check_ttl(ttl_s)
    return RouteTicket(
        REPAIR,
        old.session_id,
        old.route_id,
        old.model_digest,
        tuple(new_hops),
        issued,
        issued + ttl_s,
        repair_from=repair_from,
        epoch=old.epoch + 1 if epoch is None else epoch,
        owner=old.owner,
    )


def key_id_of(public_key: Ed25519PublicKey) -> str:
    """A key's short fingerprint: the first 16 hex digits of SHA-256 over its raw 32 bytes."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:KEY_ID_HEX_CHARS]


class TicketSigner:
    """The tracker's signing key (Ed25519)."""

    __slots__ = ("_key", "_key_id")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self._key_id = key_id_of(private_key.public_key())

    @classmethod
    def generate(cls) -> TicketSigner:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, data: bytes) -> TicketSigner:
        """A signer from an unencrypted PKCS#8 PEM private key (what :meth:`private_pem` writes)."""
        key = serialization.load_pem_private_key(data, password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"a ticket signing key is Ed25519, this PEM holds a {type(key).__name__}")
        return cls(key)

    @property
    def key_id(self) -> str:
        return self._key_id

    def private_pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def public_pem(self) -> bytes:
        return self._key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def sign(self, ticket: RouteTicket) -> str:
        """The token of ``ticket``, naming this signer's key (``ValueError`` if it names another)."""
        if ticket.tracker_key_id not in ("", self._key_id):
            raise ValueError(f"the ticket names tracker key {ticket.tracker_key_id}; this signer holds {self._key_id}")
        payload = {**ticket.as_json(), "tracker_key_id": self._key_id}
        signed = f"{TOKEN_PREFIX}.{b64url_encode(canonical_json(payload))}"
        token = f"{signed}.{b64url_encode(self._key.sign(signed.encode('ascii')))}"
        if len(token) > MAX_TICKET_BYTES:
            raise ValueError(f"a {len(token)}-byte ticket is over the {MAX_TICKET_BYTES}-byte limit nodes accept")
        return token


class TicketVerifier:
    """Checks tokens against the trusted tracker keys (several while a key is rotated)."""

    __slots__ = ("_keys",)

    def __init__(self, *public_pems: bytes) -> None:
        if not public_pems:
            raise ValueError("a ticket verifier needs at least one tracker public key")
        self._keys: dict[str, Ed25519PublicKey] = {}
        for pem in public_pems:
            key = serialization.load_pem_public_key(pem)
            if not isinstance(key, Ed25519PublicKey):
                raise ValueError(f"a tracker ticket key is Ed25519, this PEM holds a {type(key).__name__}")
            self._keys[key_id_of(key)] = key

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def verify(
        self,
        token: str | None,
        *,
        now: float | None = None,
        session_id: str | None = None,
        node_id: str | None = None,
        kind: TicketKind | None = None,
        route_id: str | None = None,
        current: bool = True,
    ) -> RouteTicket:
        """The ticket ``token`` carries, once it is genuine, current and for this request.

        Each keyword given is checked: the ticket is for ``session_id`` (and ``route_id``), names
        ``node_id`` on its route and is of ``kind``. ``now`` defaults to the clock; ``current=False``
        skips the validity window (a ``DELETE`` may come long after the session opened). Raises
        ``Unauthorized`` (missing, forged, unknown key, expired, for another request) or
        ``InvalidRequest`` (not shaped like a ticket), never anything else.
        """
        if token is None or token == "":
            raise Unauthorized(
                f"this request carries no route ticket ({TICKET_HEADER}); send the ticket the tracker issued "
                "with the session's route",
                param=TICKET_HEADER,
                code=CODE_MISSING,
            )
        signed, payload, signature = _split(token)
        obj = _load_json(payload)
        key_id = _claimed_key_id(obj)
        key = self._keys.get(key_id)
        if key is None:
            raise _denied(
                f"the ticket is signed by tracker key {key_id}, which this node does not trust (it trusts "
                f"{', '.join(self._keys)}); configure this node with the tracker's current public key",
                CODE_INVALID,
            )
        try:
            key.verify(signature, signed)
        except InvalidSignature:
            raise _denied(
                f"the ticket's signature does not verify under tracker key {key_id}: it was altered or "
                "forged; send the token exactly as the tracker issued it",
                CODE_INVALID,
            ) from None
        ticket = _parse(obj)
        if current:
            _check_current(ticket, time.time() if now is None else now)
        _check_request(ticket, session_id=session_id, route_id=route_id, kind=kind)
        if node_id is not None:
            ticket.index_of(node_id)
        return ticket


# -- token encoding ---------------------------------------------------------------------------


def _b64decode(text: str, what: str) -> bytes:
    """Canonical unpadded base64url only: one text per byte string."""
    try:
        return b64url_decode(text)
    except ValueError as exc:
        raise _malformed(f"the ticket's {what} {exc}") from None


def _split(token: object) -> tuple[bytes, bytes, bytes]:
    """(signed bytes ``mnt1.<payload>``, payload, signature) of a well-shaped token."""
    if not isinstance(token, str):
        raise _malformed(f"a ticket is a string, not {type(token).__name__}")
    if len(token) > MAX_TICKET_BYTES:
        raise _malformed(f"a {len(token)}-character ticket is over the {MAX_TICKET_BYTES}-byte limit")
    if not token.isascii():
        raise _malformed("a ticket is ASCII only; send the token exactly as the tracker issued it")
    parts = token.split(".")
    if parts[0] != TOKEN_PREFIX:
        if re.fullmatch(r"mnt[0-9]+", parts[0]):
            raise _malformed(f"ticket format {parts[0]!r}; this node reads {TOKEN_PREFIX!r}: upgrade one side")
        raise _malformed(f"not a route ticket: a ticket starts with {TOKEN_PREFIX!r}.")
    if len(parts) != 3:
        raise _malformed(f"a ticket has 3 dot-separated parts ({TOKEN_PREFIX}.PAYLOAD.SIGNATURE), got {len(parts)}")
    payload = _b64decode(parts[1], "payload")
    signature = _b64decode(parts[2], "signature")
    if len(signature) != SIGNATURE_BYTES:
        raise _malformed(f"a ticket's signature is {SIGNATURE_BYTES} bytes, got {len(signature)}")
    return f"{parts[0]}.{parts[1]}".encode("ascii"), payload, signature


def _load_json(payload: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(payload.decode("ascii"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _malformed(f"the ticket's payload is not ASCII JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise _malformed("the ticket's payload must be a JSON object")
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a ticket holds")


def _claimed_key_id(obj: dict[str, Any]) -> str:
    """The key id the (not yet verified) payload names: it only picks the key to verify with."""
    key_id = obj.get("tracker_key_id")
    if not isinstance(key_id, str) or not _KEY_ID_PATTERN.fullmatch(key_id):
        raise _malformed(f"the ticket's tracker_key_id must be {KEY_ID_HEX_CHARS} lowercase hex digits")
    return key_id


# -- reading a verified payload -----------------------------------------------------------------


def _parse(obj: dict[str, Any]) -> RouteTicket:
    """The ticket a verified payload holds; ``InvalidRequest`` for any field that is not exact."""
    try:
        _check_fields("ticket", obj, _TICKET_FIELDS)
        raw_hops = obj["hops"]
        if not isinstance(raw_hops, list):
            raise ValueError("the ticket's hops must be a list")
        hops = tuple(_parse_hop(h) for h in raw_hops)
        repair_from = obj["repair_from"]
        if repair_from is not None and (isinstance(repair_from, bool) or not isinstance(repair_from, int)):
            raise ValueError("the ticket's repair_from must be an integer or null")
        epoch = obj["epoch"]
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise ValueError("the ticket's epoch must be an integer")
        kind = _string(obj, "kind")
        if kind not in (ROUTE, REPAIR):
            raise ValueError(f"a ticket's kind is {ROUTE!r} or {REPAIR!r}, not {kind[:40]!r}")
        return RouteTicket(
            kind=REPAIR if kind == REPAIR else ROUTE,
            session_id=SessionId(_string(obj, "session_id")),
            route_id=RouteId(_string(obj, "route_id")),
            model_digest=_string(obj, "model_digest"),
            hops=hops,
            issued_at=_number(obj, "issued_at"),
            expires_at=_number(obj, "expires_at"),
            repair_from=repair_from,
            tracker_key_id=_string(obj, "tracker_key_id"),
            epoch=epoch,
            owner=_string(obj, "owner"),
        )
    except ValueError as exc:
        raise _malformed(f"the ticket's payload is not a valid ticket: {exc}") from None


def _parse_hop(raw: object) -> TicketHop:
    if not isinstance(raw, dict):
        raise ValueError("every hop must be a JSON object")
    _check_fields("hop", raw, _HOP_FIELDS)
    return TicketHop(_string(raw, "node_id"), _string(raw, "url"), _string(raw, "layers"))


def _check_fields(what: str, obj: dict[str, Any], expected: frozenset[str]) -> None:
    if missing := sorted(expected - set(obj)):
        raise ValueError(f"a {what} needs the fields {', '.join(missing)}")
    if extra := sorted(set(obj) - expected):
        raise ValueError(f"a {what} has no fields {', '.join(extra)[:200]}")


def _string(obj: dict[str, Any], name: str) -> str:
    value = obj[name]
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string")
    return value


def _number(obj: dict[str, Any], name: str) -> float:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} is out of range") from None


# -- checks -------------------------------------------------------------------------------------


def _check_current(ticket: RouteTicket, now: float) -> None:
    if now > ticket.expires_at + CLOCK_SKEW_S:
        raise _denied(
            f"{ticket.kind} ticket of session {ticket.session_id} expired {now - ticket.expires_at:.0f} s ago; "
            f"ask the tracker for a fresh {'route' if ticket.kind == ROUTE else 'repair'}",
            CODE_EXPIRED,
        )
    if ticket.issued_at > now + CLOCK_SKEW_S:
        raise _denied(
            f"{ticket.kind} ticket of session {ticket.session_id} is issued {ticket.issued_at - now:.0f} s in the "
            f"future (more than the {CLOCK_SKEW_S:.0f} s of clock skew allowed); sync this node's and the "
            "tracker's clocks (NTP)",
            CODE_EXPIRED,
        )


def _check_request(
    ticket: RouteTicket, *, session_id: str | None, route_id: str | None, kind: TicketKind | None
) -> None:
    if session_id is not None and ticket.session_id != session_id:
        raise _denied(
            f"the ticket is for session {ticket.session_id}, not session {session_id}; send the ticket the "
            "tracker issued for this session",
            CODE_MISMATCH,
        )
    if route_id is not None and ticket.route_id != route_id:
        raise _denied(
            f"the ticket is for route {ticket.route_id} of session {ticket.session_id}, but the session is "
            f"pinned to route {route_id}; send the ticket of the pinned route",
            CODE_MISMATCH,
        )
    if kind is not None and ticket.kind != kind:
        use = "open a session and forward" if kind == ROUTE else "reroute or replay"
        raise _denied(
            f"this is a {ticket.kind} ticket; to {use} a node needs a {kind} ticket"
            + ("; ask the tracker to repair the route (POST /v1/sessions/{id}/repair)" if kind == REPAIR else ""),
            CODE_MISMATCH,
        )


def _check_text(what: str, value: str, limit: int) -> None:
    if not 0 < len(value) <= limit or not value.isprintable():
        raise ValueError(f"{what} must be 1-{limit} printable characters, got {value[:limit]!r}")


def _check_id(what: str, value: str) -> None:
    if not _ID_PATTERN.fullmatch(value):
        raise ValueError(
            f"a ticket's {what} must be 1-{MAX_ID_CHARS} characters of letters, digits, '.', '_', ':' or '-', "
            f"starting with a letter or digit; got {value[:MAX_ID_CHARS]!r}"
        )


def _canonical_url(url: str) -> str | None:
    try:
        return service_url(url)
    except ValueError:
        return None


def _layer_bounds(node_id: str, layers: str) -> tuple[int, int]:
    match = _LAYERS_PATTERN.fullmatch(layers)
    if match is None or int(match[1]) >= int(match[2]):
        raise ValueError(f"hop {node_id}: layers {layers[:40]!r} must be START:STOP with 0 <= START < STOP")
    return int(match[1]), int(match[2])


def _check_hops(hops: tuple[TicketHop, ...]) -> None:
    if not hops:
        raise ValueError("a ticket's route has at least one hop")
    if len({h.node_id for h in hops}) != len(hops):
        raise ValueError("a node appears twice on the ticket's route")
    if hops[0].start != 0:
        raise ValueError(f"the head {hops[0].node_id} must start at layer 0, not {hops[0].start}")
    for prev, hop in itertools.pairwise(hops):
        if hop.start != prev.stop:
            raise ValueError(
                f"hop {hop.node_id} starts at layer {hop.start}, but the hop before it stops at {prev.stop}: "
                "a route's layer ranges are contiguous"
            )


def _check_times(issued_at: float, expires_at: float) -> None:
    if not (math.isfinite(issued_at) and math.isfinite(expires_at)) or issued_at < 0:
        raise ValueError("a ticket's issued_at and expires_at are finite unix times")
    if expires_at <= issued_at:
        raise ValueError(f"a ticket expires after it is issued: expires_at {expires_at} <= issued_at {issued_at}")


def _check_ttl(ttl_s: float) -> None:
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(f"a ticket's lifetime is a positive number of seconds, not {ttl_s}")


def _check_repair_from(kind: str, repair_from: int | None, hop_count: int) -> None:
    if kind == ROUTE and repair_from is not None:
        raise ValueError("a route ticket has no repair_from; only a repair ticket names the first replaced hop")
    if kind == REPAIR and (repair_from is None or not 0 <= repair_from < hop_count):
        raise ValueError(f"a repair ticket's repair_from indexes its {hop_count} hops, got {repair_from}")


def _denied(message: str, code: str) -> Unauthorized:
    return Unauthorized(message, param=TICKET_HEADER, code=code)


def _malformed(message: str) -> InvalidRequest:
    return InvalidRequest(message, param=TICKET_HEADER, code=CODE_MALFORMED)
