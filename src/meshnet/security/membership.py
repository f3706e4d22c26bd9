"""Membership enforced on a server: who may call what, and the tracker's side of a join.

``RequireMember`` is ASGI middleware in front of a server's app that speaks TLS with
``security.transport``'s protocols. It reads the client certificate of each request's connection,
checks it against the swarm CA (``identity.member_of``) and asks a policy which roles may make the
request: ``None`` means anyone (the join endpoint: a joining host has no certificate yet), else
the roles allowed. A request from no member is a 401, from a member of the wrong role a 403, both
in the error shape of every Meshnet server. The member is left in the scope for the handler
(:func:`scope_member`), which checks what only it can (a node registers as itself).

``SwarmAuthority`` is a swarm directory as the tracker holds it (``meshnet tracker --swarm DIR``):
the CA, the invite ledger (``invites.json``) and the member registry (``members.json``), both
written atomically next to the CA before a join is answered. The registry is what keeps ids
bound to keys: an id whose certificate is still valid cannot be joined again with another key.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from meshnet.errors import Conflict, Forbidden, InvalidRequest, MeshnetError, Unauthorized
from meshnet.fsutil import PRIVATE_MODE, write_atomic
from meshnet.httputil import error_response
from meshnet.protocol.tickets import TicketSigner
from meshnet.security.identity import (
    ROLES,
    Member,
    MemberRequest,
    SwarmCA,
    as_certificate,
    check_member_id,
    csr_member_id,
    make_csr,
    member_of,
    new_member_key,
)
from meshnet.security.invites import InviteLedger, admit
from meshnet.security.revocation import RevocationList, revoked_error
from meshnet.security.tls import Credentials, save_member
from meshnet.security.transport import ASGIApp, Scope, over_tls, peer_certificate_pem

__all__ = [
    "ADMIN_DIR",
    "ANY_MEMBER",
    "JOIN_PATH",
    "LEDGER_FILE",
    "MEMBERS_FILE",
    "TRACKER_DIR",
    "Policy",
    "RequireMember",
    "SwarmAuthority",
    "require_node",
    "require_url_in_certificate",
    "scope_member",
    "tracker_policy",
]

JOIN_PATH = "/v1/swarm/join"
CA_PATH = "/v1/swarm/ca"
LEDGER_FILE = "invites.json"
MEMBERS_FILE = "members.json"
TICKET_SIGNING_KEY_FILE = "ticket.key"  # the tracker's route-ticket signing key (protocol.tickets)
TRACKER_DIR = "tracker"
ADMIN_DIR = "admin"
MAX_JOIN_BODY_BYTES = 64 * 1024
ANY_MEMBER = frozenset(ROLES)
_MEMBER_KEY = "meshnet.member"
_CACHE_SIZE = 1024
_REGISTRY_VERSION = 1

Policy = Callable[[str, str], frozenset[str] | None]
"""(method, path) -> the roles that may make the request, or ``None`` for anyone."""


def tracker_policy(method: str, path: str) -> frozenset[str] | None:
    """Who may call what on a tracker: anyone may join; only nodes register; only gateways (and
    admins) open, repair and close sessions, report failures and bill; any member may read."""
    if path in (JOIN_PATH, CA_PATH):
        return None
    if method in ("GET", "HEAD"):
        return ANY_MEMBER
    # registration; the manifest a node serves from, handed over; a --layers auto node asking for its range
    if path in ("/v1/nodes", "/v1/manifests", "/v1/placement"):
        return frozenset({"node"})
    return frozenset({"gateway", "admin"})


def scope_member(scope: Scope) -> Member | None:
    """The member ``RequireMember`` found on this request's connection (``None`` on an open path)."""
    member = scope.get(_MEMBER_KEY)
    return member if isinstance(member, Member) else None


def require_node(scope: Scope, node_id: str) -> None:
    """A node registers as itself: its certificate's role is node and its id is ``node_id``."""
    member = scope_member(scope)
    if member is None:
        raise Unauthorized("registering a node needs the node's swarm certificate", code="certificate_required")
    if member.role != "node" or member.member_id != node_id:
        raise Forbidden(
            f"your certificate is for {member.role} {member.member_id!r}; only node {node_id!r} may register "
            f"node_id {node_id!r}",
            param="node_id",
        )


def require_url_in_certificate(scope: Scope, url: str) -> None:
    """A node advertises a URL whose host its own certificate lists (a DNS name or IP address SAN).
    Peers dial the URL and check the host against the certificate of whoever answers there, so a URL
    naming another host aims every route at a service that is not this node (another member's port,
    say): 400 naming ``url``, before anything is recorded."""
    pem = peer_certificate_pem(scope)
    host = urlsplit(url).hostname or ""
    names: set[str] = set()
    addresses: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    if pem is not None:
        try:
            san = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(x509.SubjectAlternativeName)
            names = {name.lower() for name in san.value.get_values_for_type(x509.DNSName)}
            ips = san.value.get_values_for_type(x509.IPAddress)
            addresses = {a for a in ips if isinstance(a, ipaddress.IPv4Address | ipaddress.IPv6Address)}
        except (ValueError, x509.ExtensionNotFound):
            pass
    try:
        covered = ipaddress.ip_address(host) in addresses
    except ValueError:
        covered = host.lower() in names
    if not covered:
        listed = ", ".join(sorted(names | {str(a) for a in addresses})) or "no host"
        raise InvalidRequest(
            f"this node's certificate lists {listed}, not {host!r}, the host of the url it registers ({url}): "
            f"advertise one of those, or join again with --san {host}",
            param="url",
        )


class RequireMember:
    """ASGI middleware: each request must come, over TLS, from a member of the swarm whose CA is
    ``ca_cert`` and of a role ``policy`` allows (default: any member, on every path)."""

    def __init__(
        self,
        app: ASGIApp,
        ca_cert: x509.Certificate,
        *,
        policy: Policy | None = None,
        revoked: Callable[[], frozenset[str]] | None = None,
    ) -> None:
        self.app = app
        self.ca_cert = ca_cert
        self.policy = policy or (lambda _method, _path: ANY_MEMBER)
        self.revoked = revoked  # the revoked certificate serials (hex), asked on every request
        self._known: dict[bytes, Member] = {}  # verified certificates, by PEM (bounded)

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        roles = self.policy(scope.get("method", "GET"), scope["path"])
        if roles is not None:
            try:
                member = self._member(scope)
                if self.revoked is not None and member.serial in self.revoked():
                    raise revoked_error(member.member_id)
                if member.role not in roles:
                    raise Forbidden(
                        f"{scope.get('method', 'GET')} {scope['path']} is for {' or '.join(sorted(roles))} members; "
                        f"your certificate is for {member.role} {member.member_id!r}"
                    )
            except MeshnetError as exc:
                await self._refuse(exc, scope, receive, send)
                return
            scope[_MEMBER_KEY] = member
        await self.app(scope, receive, send)

    def _member(self, scope: Scope) -> Member:
        if not over_tls(scope):
            raise Unauthorized("this server takes swarm members over TLS only", code="certificate_required")
        pem = peer_certificate_pem(scope)
        if pem is None:
            raise Unauthorized(
                "this server needs a swarm member certificate: join the swarm (meshnet swarm join) and connect "
                "with its credentials",
                code="certificate_required",
            )
        member = self._known.get(pem)
        if member is not None and member.expires > datetime.now(UTC):
            return member
        try:
            member = member_of(pem, self.ca_cert)
        except Unauthorized as exc:
            raise Unauthorized(exc.message, code="certificate_refused") from exc
        if len(self._known) >= _CACHE_SIZE:
            self._known.clear()
        self._known[pem] = member
        return member

    @staticmethod
    async def _refuse(
        exc: MeshnetError, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] == "websocket":
            from starlette.websockets import WebSocketClose

            await WebSocketClose(code=1008, reason=exc.message[:120])(scope, receive, send)
            return
        await error_response(exc)(scope, receive, send)


class SwarmAuthority:
    """A swarm directory as the tracker holds it: CA, invite ledger and member registry."""

    def __init__(self, ca: SwarmCA) -> None:
        self.ca = ca
        self.directory = ca.directory
        self._lock = threading.Lock()
        ledger_path = self.directory / LEDGER_FILE
        self.ledger = InviteLedger.from_json(ledger_path.read_bytes()) if ledger_path.exists() else InviteLedger()
        self.members: dict[str, dict[str, Any]] = _read_registry(self.directory / MEMBERS_FILE)
        self.signer = _ticket_signer(self.directory / TICKET_SIGNING_KEY_FILE)
        self.revocations = RevocationList(self.directory)

    def revoked_ids(self) -> frozenset[str]:
        """Members whose current certificate is revoked (a node among them leaves the routes)."""
        serials = self.revocations.serials()
        if not serials:
            return frozenset()
        return frozenset(mid for mid, entry in self.members.items() if entry.get("serial") in serials)

    @classmethod
    def load(cls, directory: Path) -> SwarmAuthority:
        return cls(SwarmCA.load(Path(directory)))

    def issue_own(self, role: str, member_id: str, sans: Sequence[str], directory: Path) -> Credentials:
        """Credentials the CA's holder issues itself (the tracker's, the admin's), bypassing invites:
        a fresh key, a certificate for ``sans``, written to ``directory`` and recorded."""
        key = new_member_key()
        csr = make_csr(key, member_id)
        cert_pem = self.ca.issue(MemberRequest(csr, role=role, trusted=True, sans=tuple(sans)))
        credentials = save_member(
            directory, cert_pem, key, ca_pem=self.ca.cert_pem, ticket_key_pem=self.signer.public_pem()
        )
        with self._lock:
            self._record(as_certificate(cert_pem), role)
        return credentials

    def join(self, body: bytes, *, now: float | None = None) -> dict[str, Any]:
        """The answer to ``POST /v1/swarm/join``: ``{"certificate", "ca", "member_id", "role", ...}``.
        ``InvalidRequest``/``Unauthorized``/``Conflict`` (an id another key holds) for a refused join,
        which leaves the invite unused."""
        token, csr_pem, member_id, sans = _parse_join(body)
        with self._lock:
            self._check_takeover(member_id, csr_pem, now)
            cert_pem = admit(self.ca, self.ledger, token, csr_pem, requested_id=member_id, sans=sans, now=now)
            write_atomic(self.directory / LEDGER_FILE, self.ledger.to_json().encode())
            member = self._record(as_certificate(cert_pem), None)
        return {
            "certificate": cert_pem.decode("ascii"),
            "ca": self.ca.cert_pem.decode("ascii"),
            "swarm_id": self.ca.swarm_id,
            "member_id": member_id,
            "role": member["role"],
            "trusted": member["trusted"],
            "expires": member["expires"],
            "ticket_key": self.signer.public_pem().decode("ascii"),
        }

    def _check_takeover(self, member_id: str, csr_pem: bytes, now: float | None) -> None:
        held = self.members.get(member_id)
        if held is None:
            return
        csr_member_id(csr_pem)  # a malformed CSR is a 400 before anything else
        same_key = _key_digest(x509.load_pem_x509_csr(csr_pem).public_key()) == held["key"]
        if held.get("serial") in self.revocations.serials():
            if same_key:  # a revoked member does not come back with its old key, invite or not
                raise revoked_error(member_id)
            return  # a new invite and a new key may take the id again
        if held["expires"] <= (time.time() if now is None else now):
            return
        if not same_key:
            until = datetime.fromtimestamp(held["expires"], UTC).isoformat(timespec="seconds")
            raise Conflict(
                f"member id {member_id!r} is held by another key (its certificate is valid until {until}); "
                "join with another --id",
                param="member_id",
            )

    def _record(self, cert: x509.Certificate, role: str | None) -> dict[str, Any]:
        member = member_of(cert, self.ca.cert)
        entry = {
            "role": role or member.role,
            "trusted": member.trusted,
            "key": _key_digest(cert.public_key()),
            "serial": format(cert.serial_number, "x"),
            "expires": int(member.expires.timestamp()),
        }
        self.members[member.member_id] = entry
        body = {"v": _REGISTRY_VERSION, "members": dict(sorted(self.members.items()))}
        write_atomic(self.directory / MEMBERS_FILE, json.dumps(body, indent=1).encode())
        return entry


def _ticket_signer(path: Path) -> TicketSigner:
    """The tracker's route-ticket key (Ed25519), made on first use and kept beside the CA (0600)."""
    if path.is_file():
        return TicketSigner.from_pem(path.read_bytes())
    signer = TicketSigner.generate()
    write_atomic(path, signer.private_pem(), mode=PRIVATE_MODE)
    return signer


def _key_digest(public_key: Any) -> str:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _read_registry(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_bytes())
        members = data["members"] if data.get("v") == _REGISTRY_VERSION else None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequest(f"{path} is not a Meshnet member registry: {exc}") from exc
    if not isinstance(members, dict):
        raise InvalidRequest(f"{path} is not a Meshnet member registry (version {_REGISTRY_VERSION})")
    return members


def _parse_join(body: bytes) -> tuple[str, bytes, str, list[str]]:
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise InvalidRequest(f"the join request is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest('the join request must be {"token", "csr", "member_id", "sans"}')
    token, csr, member_id, sans = (data.get(k) for k in ("token", "csr", "member_id", "sans"))
    if not isinstance(token, str) or not token:
        raise InvalidRequest("the join request needs the invite as 'token'", param="token")
    if not isinstance(csr, str) or not csr:
        raise InvalidRequest("the join request needs a PEM certificate signing request as 'csr'", param="csr")
    if not isinstance(member_id, str):
        raise InvalidRequest("the join request needs the member id as 'member_id'", param="member_id")
    if sans is None:
        sans = []
    if not isinstance(sans, list) or not all(isinstance(s, str) for s in sans):
        raise InvalidRequest("'sans' must be a list of DNS names and IP addresses", param="sans")
    return token, csr.encode("ascii", "replace"), check_member_id(member_id), sans
