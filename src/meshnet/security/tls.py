"""Mutual TLS between a swarm's members, and the credential directory each member keeps.

Both sides of a connection present their member certificate and verify the other's against the
swarm CA, and only the swarm CA: the system's trust store is never loaded, so a certificate any
public CA issued is worth nothing here, and a member of another swarm fails the handshake itself.
TLS 1.2 is the floor and OpenSSL's strict X.509 checks are on (the swarm's own certificates meet
them; anything sloppier has no business in a swarm).

TLS authenticates; deciding what a member may do is the caller's, from :func:`peer_member`, which
reads the role, trust and id out of the peer's certificate (checked again against the CA, so a
caller that got the DER some other way is just as safe).

A member's credentials live in one directory (:class:`Credentials`): ``ca.pem`` (the swarm CA
certificate), ``member.pem`` (its certificate) and ``member.key`` (its private key, 0600).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from meshnet.errors import InvalidRequest, NotFound, Unauthorized
from meshnet.fsutil import PRIVATE_MODE, PUBLIC_MODE, write_atomic
from meshnet.protocol.tickets import TicketVerifier
from meshnet.security.identity import (
    CA_CERT_FILE,
    DIRECTORY_MODE,
    CertificateLike,
    Member,
    as_certificate,
    key_matches,
    key_pem,
    load_certificate,
    member_of,
)

__all__ = [
    "MEMBER_CERT_FILE",
    "MEMBER_KEY_FILE",
    "MIN_TLS_VERSION",
    "Credentials",
    "client_context",
    "peer_member",
    "save_member",
    "server_context",
]

MEMBER_CERT_FILE = "member.pem"
MEMBER_KEY_FILE = "member.key"
TICKET_KEY_FILE = "ticket-key.pem"  # the tracker's route-ticket public key
MIN_TLS_VERSION = ssl.TLSVersion.TLSv1_2

PathLike = str | os.PathLike[str]


def server_context(
    cert_pem_path: PathLike, key_path: PathLike, ca_cert_path: PathLike, *, require_client_cert: bool = True
) -> ssl.SSLContext:
    """A server-side context presenting the member certificate at ``cert_pem_path``. With
    ``require_client_cert`` every client must present a certificate of the swarm CA; without it a
    client may connect anonymously (one that presents a certificate is still verified)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _configure(context, Path(cert_pem_path), Path(key_path), Path(ca_cert_path))
    context.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return context


def client_context(cert_pem_path: PathLike, key_path: PathLike, ca_cert_path: PathLike) -> ssl.SSLContext:
    """A client-side context presenting the member certificate at ``cert_pem_path`` and verifying the
    server against the swarm CA, host name included (pass ``server_hostname``: a DNS name or IP
    address the server's certificate lists)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _configure(context, Path(cert_pem_path), Path(key_path), Path(ca_cert_path))
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def peer_member(
    peer: ssl.SSLSocket | ssl.SSLObject | bytes, ca_cert: CertificateLike, *, now: datetime | None = None
) -> Member:
    """Who the other side of a connection is: its certificate (from the socket or object, or its DER
    bytes as ``getpeercert(binary_form=True)`` gives them), checked by :func:`member_of`.
    ``Unauthorized`` if it presented none or it is not a member of this swarm."""
    der = peer if isinstance(peer, bytes) else peer.getpeercert(binary_form=True)
    if not der:
        raise Unauthorized("the peer presented no certificate")
    return member_of(der, ca_cert, now=now)


@dataclass(frozen=True, slots=True)
class Credentials:
    """A member's credential directory: ``ca.pem``, ``member.pem`` and ``member.key``."""

    directory: Path

    @classmethod
    def at(cls, directory: PathLike) -> Credentials:
        return cls(Path(directory))

    @property
    def ca_path(self) -> Path:
        return self.directory / CA_CERT_FILE

    @property
    def cert_path(self) -> Path:
        return self.directory / MEMBER_CERT_FILE

    @property
    def key_path(self) -> Path:
        return self.directory / MEMBER_KEY_FILE

    @property
    def ticket_key_path(self) -> Path:
        """The tracker's route-ticket public key (protocol.tickets): what a node verifies tickets with."""
        return self.directory / TICKET_KEY_FILE

    def exists(self) -> bool:
        return all(path.is_file() for path in (self.ca_path, self.cert_path, self.key_path))

    def ticket_key(self) -> bytes | None:
        return self.ticket_key_path.read_bytes() if self.ticket_key_path.is_file() else None

    def ca_cert(self) -> x509.Certificate:
        return load_certificate(self.ca_path)

    def member(self, *, now: datetime | None = None) -> Member:
        """Who these credentials make their holder (``Unauthorized`` if the certificate is not valid)."""
        return member_of(load_certificate(self.cert_path), self.ca_cert(), now=now)

    def server_context(self, *, require_client_cert: bool = True) -> ssl.SSLContext:
        return server_context(self.cert_path, self.key_path, self.ca_path, require_client_cert=require_client_cert)

    def client_context(self) -> ssl.SSLContext:
        return client_context(self.cert_path, self.key_path, self.ca_path)


def save_member(
    directory: PathLike,
    cert_pem: bytes,
    key: ec.EllipticCurvePrivateKey | bytes,
    *,
    ca_pem: bytes | None = None,
    ticket_key_pem: bytes | None = None,
) -> Credentials:
    """Write a member's credentials into ``directory`` (created 0700): the key (0600), then the
    certificate, then ``ca_pem`` if given, each atomically. ``InvalidRequest`` if the certificate is
    not the key's, or (with ``ca_pem``) not a valid member certificate of that CA."""
    credentials = Credentials.at(directory)
    if isinstance(key, bytes):
        try:
            loaded = serialization.load_pem_private_key(key, password=None)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"the member key is not an unencrypted PEM private key: {exc}") from exc
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise InvalidRequest(f"the member key is a {type(loaded).__name__}; Meshnet keys are ECDSA (P-256)")
        key = loaded
    cert = as_certificate(cert_pem, what="member certificate")
    if not key_matches(cert, key):
        raise InvalidRequest("the member certificate is not for this key")
    if ca_pem is not None:
        try:
            member_of(cert, ca_pem)
        except Unauthorized as exc:
            raise InvalidRequest(f"not saving the member certificate: {exc.message}") from exc
    credentials.directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    write_atomic(credentials.key_path, key_pem(key), mode=PRIVATE_MODE)
    write_atomic(credentials.cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=PUBLIC_MODE)
    if ca_pem is not None:
        write_atomic(credentials.ca_path, as_certificate(ca_pem).public_bytes(serialization.Encoding.PEM))
    if ticket_key_pem is not None:
        try:
            TicketVerifier(ticket_key_pem)
        except ValueError as exc:
            raise InvalidRequest(f"not saving the tracker's ticket key: {exc}") from None
        write_atomic(credentials.ticket_key_path, ticket_key_pem)
    return credentials


def _configure(context: ssl.SSLContext, cert_path: Path, key_path: Path, ca_path: Path) -> None:
    context.minimum_version = MIN_TLS_VERSION
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    for path, what in ((cert_path, "member certificate"), (key_path, "member key"), (ca_path, "CA certificate")):
        if not path.is_file():
            raise NotFound(f"{what} file {path} does not exist")
    try:
        context.load_verify_locations(cafile=str(ca_path))
    except (ssl.SSLError, OSError) as exc:
        raise InvalidRequest(f"{ca_path} is not a PEM CA certificate: {exc}") from exc
    try:
        context.load_cert_chain(certfile=str(cert_path), keyfile=str(key_path))
    except (ssl.SSLError, OSError) as exc:
        raise InvalidRequest(f"cannot use the certificate {cert_path} with the key {key_path}: {exc}") from exc
