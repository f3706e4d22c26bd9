"""The joining host's side of a join, and the TLS settings a member process runs with.

:func:`join_swarm` makes the member's key pair on this host (the key never leaves it), reads the
tracker URL and the CA fingerprint from the invite, fetches the CA certificate from the tracker
and checks it has that fingerprint (the invite, handed over out of band, is what pins the CA:
the first request cannot verify the tracker yet, so nothing it answers is trusted until the
fingerprint matches), verifies the invite against it, then sends invite + CSR over TLS verified
against that CA and writes key (0600), certificate and CA atomically (``tls.save_member``).

:class:`MemberTLS` is what ``meshnet node`` and ``meshnet gateway`` load from ``--swarm-dir`` or
``--cert/--key/--ca``: the server context (client certificates required) and the client context
every outgoing connection presents.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from cryptography import x509

from meshnet.errors import InvalidRequest, MeshnetError, Unauthorized
from meshnet.httputil import error_message
from meshnet.protocol.tickets import TicketVerifier
from meshnet.security.identity import (
    check_member_id,
    fingerprint,
    load_certificate,
    make_csr,
    member_of,
    new_member_key,
)
from meshnet.security.invites import peek_invite, read_invite
from meshnet.security.membership import CA_PATH, JOIN_PATH
from meshnet.security.tls import TICKET_KEY_FILE, Credentials, client_context, save_member, server_context

__all__ = ["JoinError", "MemberTLS", "default_sans", "join_swarm"]

JOIN_TIMEOUT_S = 30.0


class JoinError(MeshnetError):
    """A join that did not happen; the message says what to fix. ``unreachable``: the tracker did
    not answer at all (try again), rather than refusing."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def default_sans(extra: Sequence[str] = ()) -> list[str]:
    """The names a member's certificate lists unless told otherwise: loopback, this host's name,
    and ``extra`` (the addresses other hosts dial it at), without duplicates."""
    names = ["127.0.0.1", "::1", "localhost"]
    hostname = socket.gethostname()
    if hostname and all(part.replace("-", "").isalnum() for part in hostname.split(".")):
        names.append(hostname)
    for name in extra:
        if name not in names:
            names.append(name)
    return names


def join_swarm(
    token: str,
    directory: Path,
    *,
    member_id: str | None = None,
    sans: Sequence[str] | None = None,
    tracker_url: str | None = None,
    timeout_s: float = JOIN_TIMEOUT_S,
) -> Credentials:
    """Join the swarm ``token`` invites to; the new credentials, written to ``directory``. The
    certificate lists ``sans`` (default: :func:`default_sans`, loopback and this host's name)."""
    invite = peek_invite(token.strip())
    member_id = member_id or invite.member_id
    if member_id is None:
        raise InvalidRequest("this invite pins no member id: give one with --id", param="member_id")
    check_member_id(member_id)
    if invite.member_id is not None and invite.member_id != member_id:
        raise InvalidRequest(f"this invite is for member {invite.member_id!r}, not {member_id!r}", param="member_id")
    tracker = (tracker_url or invite.tracker_url or "").rstrip("/")
    if not tracker:
        raise InvalidRequest("this invite names no tracker: give its URL with --tracker https://HOST:PORT")
    if urlsplit(tracker).scheme != "https":
        raise InvalidRequest(f"a swarm's tracker serves https, not {tracker!r}: give its https:// URL")
    credentials = Credentials.at(directory)
    if credentials.exists():
        raise InvalidRequest(f"{directory} already holds member credentials; join into an empty directory")
    ca_pem = _fetch_ca(tracker, invite.ca_fingerprint, timeout_s)
    read_invite(token.strip(), ca_pem)  # expired, altered or for another swarm: say so before asking
    key = new_member_key()
    body = {
        "token": token.strip(),
        "csr": make_csr(key, member_id).decode("ascii"),
        "member_id": member_id,
        "sans": list(default_sans() if sans is None else sans),
    }
    context = ssl.create_default_context(cadata=ca_pem.decode("ascii"))
    try:
        with httpx.Client(verify=context, timeout=timeout_s) as client:
            answer = client.post(f"{tracker}{JOIN_PATH}", json=body)
    except httpx.HTTPError as exc:
        raise JoinError(f"cannot reach the tracker at {tracker}: {exc}", unreachable=True) from None
    if answer.status_code != 201:
        raise JoinError(f"the tracker refused the join (HTTP {answer.status_code}): {error_message(answer)}")
    try:
        cert_pem = answer.json()["certificate"].encode("ascii")
        ticket_key = answer.json()["ticket_key"].encode("ascii")
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        raise JoinError(f"the tracker's answer holds no certificate and ticket key: {exc}") from None
    return save_member(directory, cert_pem, key, ca_pem=ca_pem, ticket_key_pem=ticket_key)


def _fetch_ca(tracker: str, want: str, timeout_s: float) -> bytes:
    """The CA certificate the tracker serves, once it is the one the invite pins."""
    unverified = ssl.create_default_context()
    unverified.check_hostname = False
    unverified.verify_mode = ssl.CERT_NONE  # checked below, by the fingerprint the invite carries
    try:
        with httpx.Client(verify=unverified, timeout=timeout_s) as client:
            answer = client.get(f"{tracker}{CA_PATH}")
    except httpx.HTTPError as exc:
        raise JoinError(f"cannot reach the tracker at {tracker}: {exc}", unreachable=True) from None
    if answer.status_code != 200:
        raise JoinError(f"the tracker at {tracker} serves no swarm CA (HTTP {answer.status_code})")
    try:
        got = fingerprint(answer.content)
    except InvalidRequest:
        got = ""
    if got != want:
        raise JoinError(
            f"the tracker at {tracker} serves another swarm's CA than the invite names (fingerprint "
            f"{got[:16] or '?'}…, expected {want[:16]}…): is this the right tracker?"
        )
    return answer.content


@dataclass(frozen=True, slots=True)
class MemberTLS:
    """A member's TLS: its credential files, and who they make it."""

    cert_path: Path
    key_path: Path
    ca_path: Path
    member_id: str
    role: str
    ca_cert: x509.Certificate
    ticket_key: bytes | None = None  # the tracker's route-ticket public key, beside the certificate

    @classmethod
    def load(cls, cert: Path, key: Path, ca: Path) -> MemberTLS:
        """``InvalidRequest``/``NotFound``/``Unauthorized`` naming what is wrong with the files."""
        ca_cert = load_certificate(Path(ca))
        member = member_of(load_certificate(Path(cert)), ca_cert)
        client_context(cert, key, ca)  # the key fits the certificate, the CA is PEM: fail now, not per request
        ticket_key = Credentials.at(Path(cert).parent).ticket_key()
        return cls(Path(cert), Path(key), Path(ca), member.member_id, member.role, ca_cert, ticket_key)

    def ticket_verifier(self) -> TicketVerifier:
        """What a node checks route tickets with; ``InvalidRequest`` for credentials without the key."""
        if self.ticket_key is None:
            raise InvalidRequest(
                f"no {TICKET_KEY_FILE} (the tracker's route-ticket key) beside {self.cert_path}: join the swarm "
                "again (meshnet swarm join) to get it"
            )
        try:
            return TicketVerifier(self.ticket_key)
        except ValueError as exc:
            raise InvalidRequest(f"{TICKET_KEY_FILE} beside {self.cert_path}: {exc}") from None

    @classmethod
    def from_directory(cls, directory: Path) -> MemberTLS:
        credentials = Credentials.at(directory)
        return cls.load(credentials.cert_path, credentials.key_path, credentials.ca_path)

    def server_context(self) -> ssl.SSLContext:
        return server_context(self.cert_path, self.key_path, self.ca_path, require_client_cert=True)

    def client_context(self) -> ssl.SSLContext:
        return client_context(self.cert_path, self.key_path, self.ca_path)

    def check_role(self, role: str, who: str) -> None:
        if self.role != role:
            raise Unauthorized(
                f"{who} needs a {role} certificate; {self.cert_path} is for {self.role} {self.member_id!r}"
            )
