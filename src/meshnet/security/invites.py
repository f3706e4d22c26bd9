"""Invites: the single-use join tokens a swarm's CA signs, and the tracker's side of a join.

An operator mints an invite with the CA key and hands it, out of band, to whoever runs the new
member. The member makes its own key and CSR (its key never leaves it), reads the tracker URL
and the CA fingerprint from the invite with :func:`peek_invite`, fetches the CA certificate,
checks that its fingerprint is the one the invite names, and sends invite + CSR to the tracker.
The tracker (:func:`admit`) verifies the invite, marks it used and issues a certificate with the
role and trust the invite grants. The invite is the authorisation; the certificate is the
membership from then on.

A token is ``mninv1.<payload>.<signature>``, both parts base64url without padding:

- payload: canonical JSON (sorted keys, no spaces) of ``{"v": 1, "swarm", "role", "trusted",
  "exp" (unix seconds), "nonce" (128 random bits, hex), "member" (a pinned member id or null),
  "tracker" (URL or null), "ca_fp" (SHA-256 of the CA certificate's DER, hex)}``;
- signature: ECDSA P-256 SHA-256 by the CA key, as the 64 bytes r‖s (JWS ES256), over the ASCII
  text ``mninv1.<payload>``. Signing the encoded text, prefix included, means nothing else the CA
  key signs can pass as an invite, and no other encoding of the same payload verifies.

Single use is the :class:`InviteLedger`'s: the nonces of redeemed invites, kept until their
invite has been expired for ``LEDGER_GRACE_S`` (a redeemed invite past its expiry is refused for
being expired, so its nonce need not be kept forever; the grace covers a clock stepping back).
"""

from __future__ import annotations

import json
import math
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature

from meshnet.errors import InvalidRequest, Unauthorized
from meshnet.protocol.tokens import b64url_decode, b64url_encode, canonical_json
from meshnet.security.identity import (
    ROLES,
    CertificateLike,
    MemberRequest,
    SwarmCA,
    as_certificate,
    check_member_id,
    check_role,
    csr_member_id,
    fingerprint,
    swarm_id_of,
)

__all__ = [
    "DEFAULT_INVITE_TTL_S",
    "INVITE_VERSION",
    "LEDGER_GRACE_S",
    "TOKEN_PREFIX",
    "Invite",
    "InviteLedger",
    "admit",
    "mint_invite",
    "peek_invite",
    "read_invite",
]

TOKEN_PREFIX = "mninv1"
INVITE_VERSION = 1
DEFAULT_INVITE_TTL_S = 86400.0
LEDGER_GRACE_S = 3600.0
NONCE_BYTES = 16
MAX_TOKEN_CHARS = 4096
MAX_URL_CHARS = 2048
_COORDINATE_BYTES = 32  # one P-256 signature coordinate
_SIGNATURE_BYTES = 2 * _COORDINATE_BYTES
_FINGERPRINT_CHARS = 64
_LEDGER_VERSION = 1
_PAYLOAD_KEYS = frozenset({"v", "swarm", "role", "trusted", "exp", "nonce", "member", "tracker", "ca_fp"})
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class Invite:
    """What an invite grants. From :func:`read_invite` it is verified; from :func:`peek_invite` it
    is only what the token claims."""

    swarm_id: str
    role: str
    trusted: bool
    expires_at: int
    nonce: str
    member_id: str | None
    tracker_url: str | None
    ca_fingerprint: str
    version: int = INVITE_VERSION

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at

    @property
    def expires(self) -> datetime:
        return datetime.fromtimestamp(self.expires_at, UTC)

    def payload(self) -> dict[str, Any]:
        return {
            "v": self.version,
            "swarm": self.swarm_id,
            "role": self.role,
            "trusted": self.trusted,
            "exp": self.expires_at,
            "nonce": self.nonce,
            "member": self.member_id,
            "tracker": self.tracker_url,
            "ca_fp": self.ca_fingerprint,
        }


def mint_invite(
    ca: SwarmCA,
    *,
    role: str,
    trusted: bool = False,
    expires_in_s: float = DEFAULT_INVITE_TTL_S,
    member_id: str | None = None,
    tracker_url: str | None = None,
    now: float | None = None,
) -> str:
    """A signed, single-use invite to ``ca``'s swarm as ``role`` (pinned to ``member_id`` if given),
    valid for ``expires_in_s`` seconds from ``now`` (default: the current time)."""
    if not (math.isfinite(expires_in_s) and expires_in_s > 0):
        raise InvalidRequest(
            f"an invite must last a positive number of seconds, not {expires_in_s}", param="expires_in_s"
        )
    invite = Invite(
        swarm_id=ca.swarm_id,
        role=check_role(role),
        trusted=bool(trusted),
        expires_at=math.ceil((time.time() if now is None else now) + expires_in_s),
        nonce=secrets.token_hex(NONCE_BYTES),
        member_id=None if member_id is None else check_member_id(member_id),
        tracker_url=None if tracker_url is None else _check_url(tracker_url),
        ca_fingerprint=ca.fingerprint,
    )
    signed = f"{TOKEN_PREFIX}.{b64url_encode(canonical_json(invite.payload()))}"
    return f"{signed}.{b64url_encode(_sign(ca.key, signed.encode('ascii')))}"


def peek_invite(token: str) -> Invite:
    """What ``token`` claims, WITHOUT verifying its signature or expiry.

    A joining member uses it to learn the tracker URL and the CA fingerprint before it has the CA
    certificate. Nothing it returns may be trusted until the CA certificate it then fetches has
    the fingerprint the invite names and :func:`read_invite` with that certificate succeeds.
    ``InvalidRequest`` for a malformed token.
    """
    return _decode_payload(_split(token)[1])


def read_invite(token: str, ca_cert: CertificateLike, *, now: float | None = None) -> Invite:
    """The invite in ``token``, verified against the swarm CA ``ca_cert``.

    ``InvalidRequest`` for a malformed token or an unknown version; ``Unauthorized`` for an invite
    to another swarm, a bad signature (altered, or not signed by this CA) or one expired at ``now``.
    """
    signed, payload, signature = _split(token)
    invite = _decode_payload(payload)
    ca = as_certificate(ca_cert, what="CA certificate")
    swarm_id = swarm_id_of(ca)
    if invite.swarm_id != swarm_id or invite.ca_fingerprint != fingerprint(ca):
        raise Unauthorized(f"this invite is for swarm {invite.swarm_id} (another CA), not for swarm {swarm_id}")
    public_key = ca.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or not _verify(public_key, signed, signature):
        raise Unauthorized(f"the invite has a bad signature: it was altered, or not signed by swarm {swarm_id}'s CA")
    if invite.expired(now):
        raise Unauthorized(f"the invite expired at {invite.expires.isoformat(timespec='seconds')}")
    return invite


class InviteLedger:
    """The nonces of redeemed invites, so that each invite admits one member.

    In memory and thread-safe; the tracker persists it with :meth:`to_json` / :meth:`from_json`
    (after each redeem, before it answers the join, so a restart cannot make an invite new again).
    """

    def __init__(self, used: Mapping[str, int] | None = None) -> None:
        self._used: dict[str, int] = dict(used or {})
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._used)

    def __contains__(self, nonce: object) -> bool:
        with self._lock:
            return nonce in self._used

    def redeem(self, invite: Invite, *, now: float | None = None) -> None:
        """Mark ``invite`` used; ``Unauthorized("invite already used")`` if it was, or if it expired."""
        if invite.expired(now):
            raise Unauthorized(f"the invite expired at {invite.expires.isoformat(timespec='seconds')}")
        with self._lock:
            self._prune_locked(time.time() if now is None else now)
            if invite.nonce in self._used:
                raise Unauthorized("invite already used")
            self._used[invite.nonce] = invite.expires_at

    def prune(self, now: float | None = None) -> int:
        """Forget nonces whose invite expired over ``LEDGER_GRACE_S`` ago; how many were forgotten."""
        with self._lock:
            return self._prune_locked(time.time() if now is None else now)

    def to_json(self) -> str:
        with self._lock:
            return json.dumps({"v": _LEDGER_VERSION, "used": dict(sorted(self._used.items()))}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> InviteLedger:
        """A ledger from :meth:`to_json`'s output; ``InvalidRequest`` if it is not one."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise InvalidRequest(f"the invite ledger is not JSON: {exc}") from exc
        used = data.get("used") if isinstance(data, dict) and data.get("v") == _LEDGER_VERSION else None
        if not isinstance(used, dict) or not all(
            isinstance(nonce, str) and type(exp) is int for nonce, exp in used.items()
        ):
            raise InvalidRequest(f'the invite ledger must be {{"v": {_LEDGER_VERSION}, "used": {{nonce: exp}}}}')
        return cls(used)

    def _prune_locked(self, now: float) -> int:
        stale = [nonce for nonce, exp in self._used.items() if exp + LEDGER_GRACE_S < now]
        for nonce in stale:
            del self._used[nonce]
        return len(stale)


def admit(
    ca: SwarmCA,
    ledger: InviteLedger,
    token: str,
    csr_pem: bytes,
    *,
    requested_id: str,
    sans: Sequence[str],
    now: float | None = None,
) -> bytes:
    """The tracker's side of a join: a member certificate (PEM) for ``csr_pem``, with the role and
    trust ``token`` grants, and the invite marked used.

    All or nothing: the invite, the CSR (its signature, its CN equal to ``requested_id`` and to the
    member the invite pins, if any) and the SANs are all checked, and the certificate made, before
    the invite is redeemed; a refused join leaves the invite as it was.
    """
    invite = read_invite(token, ca.cert, now=now)
    check_member_id(requested_id)
    csr_id = csr_member_id(csr_pem)
    if csr_id != requested_id:
        raise InvalidRequest(f"the CSR is for member {csr_id!r}, but the join asks for {requested_id!r}", param="csr")
    if invite.member_id is not None and invite.member_id != requested_id:
        raise Unauthorized(f"this invite is for member {invite.member_id!r}, not {requested_id!r}")
    if isinstance(sans, str):
        raise InvalidRequest("sans must be a list of names or addresses, not one string", param="sans")
    cert_pem = ca.issue(MemberRequest(csr_pem, role=invite.role, trusted=invite.trusted, sans=tuple(sans)))
    ledger.redeem(invite, now=now)
    return cert_pem


# -- encoding ---------------------------------------------------------------------------------------


def _b64decode(text: str, what: str) -> bytes:
    try:
        return b64url_decode(text)
    except ValueError as exc:
        raise InvalidRequest(f"malformed invite: its {what} {exc}") from None


def _split(token: str) -> tuple[bytes, bytes, bytes]:
    """``(signed text, payload bytes, signature bytes)`` of a token, else ``InvalidRequest``."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise InvalidRequest(f"malformed invite: expected a token of at most {MAX_TOKEN_CHARS} characters")
    parts = token.strip().split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise InvalidRequest(f"malformed invite: expected {TOKEN_PREFIX}.<payload>.<signature>")
    payload, signature = _b64decode(parts[1], "payload"), _b64decode(parts[2], "signature")
    return f"{parts[0]}.{parts[1]}".encode("ascii"), payload, signature


def _decode_payload(raw: bytes) -> Invite:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest("malformed invite: its payload is not JSON") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("malformed invite: its payload is not a JSON object")
    if type(data.get("v")) is not int or data["v"] != INVITE_VERSION:
        raise InvalidRequest(f"invite version {data.get('v')!r}: this Meshnet reads version {INVITE_VERSION}")
    if set(data) != _PAYLOAD_KEYS:
        raise InvalidRequest(f"malformed invite: payload fields {sorted(data)}, expected {sorted(_PAYLOAD_KEYS)}")
    swarm, role, trusted, exp = data["swarm"], data["role"], data["trusted"], data["exp"]
    nonce, member, tracker, ca_fp = data["nonce"], data["member"], data["tracker"], data["ca_fp"]
    if not (
        isinstance(swarm, str)
        and role in ROLES
        and isinstance(trusted, bool)
        and type(exp) is int
        and _is_hex(nonce, 2 * NONCE_BYTES)
        and (member is None or isinstance(member, str))
        and (tracker is None or isinstance(tracker, str))
        and _is_hex(ca_fp, _FINGERPRINT_CHARS)
    ):
        raise InvalidRequest("malformed invite: a payload field has the wrong type or form")
    try:
        member = None if member is None else check_member_id(member)
        tracker = None if tracker is None else _check_url(tracker)
    except InvalidRequest as exc:
        raise InvalidRequest(f"malformed invite: {exc.message}") from exc
    return Invite(swarm, role, trusted, exp, nonce, member, tracker, ca_fp)


def _is_hex(value: object, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and set(value) <= _HEX


def _check_url(url: str) -> str:
    parts = urlsplit(url) if isinstance(url, str) and len(url) <= MAX_URL_CHARS else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidRequest(f"tracker URL {url!r} is not an http(s) URL", param="tracker_url")
    return url


# -- signatures -------------------------------------------------------------------------------------


def _sign(key: ec.EllipticCurvePrivateKey, message: bytes) -> bytes:
    r, s = decode_dss_signature(key.sign(message, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(_COORDINATE_BYTES, "big") + s.to_bytes(_COORDINATE_BYTES, "big")


def _verify(public_key: ec.EllipticCurvePublicKey, message: bytes, signature: bytes) -> bool:
    if len(signature) != _SIGNATURE_BYTES:
        return False
    r = int.from_bytes(signature[:_COORDINATE_BYTES], "big")
    s = int.from_bytes(signature[_COORDINATE_BYTES:], "big")
    try:
        public_key.verify(encode_dss_signature(r, s), message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True
