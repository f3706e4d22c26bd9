"""Swarm identity: the certificate authority a private swarm is, and the certificates its members hold.

A private swarm is one ECDSA P-256 key pair, its CA. Every member (node, gateway, tracker, admin)
holds a certificate that CA issued, and the certificate *is* the membership: it names the swarm,
the member's role and whether it is trusted, so a peer learns all three from the TLS handshake
alone (``tls.peer_member``), with no call to the tracker and nothing to keep in sync.

What a member certificate says, the one encoding :func:`member_of` reads back:

- subject CN: the member id (1..64 of ``[A-Za-z0-9._-]``, not ``.`` or ``..``);
- SAN URI ``meshnet://<swarm_id>/<role>/<member_id>``: swarm, role (``node``, ``gateway``,
  ``tracker`` or ``admin``) and id;
- SAN URI ``meshnet://<swarm_id>/trust/trusted`` or ``meshnet://<swarm_id>/trust/untrusted``:
  the trust bit (always written, so a reader never guesses from an absence);
- SAN DNS names and IP addresses the member asked for, so the same certificate serves TLS;
- ExtendedKeyUsage clientAuth + serverAuth, BasicConstraints ca=False, KeyUsage digitalSignature.

The CA certificate carries its swarm id the same way, as SAN URI ``meshnet://<swarm_id>``, so a
member that holds only ``ca.pem`` knows which swarm it belongs to. (Its subject repeats the id in
OU for people reading it with openssl; the URI is what is parsed.)

Validity starts ``CLOCK_SKEW`` before issue unless the request says otherwise: members' clocks
disagree by seconds, and a certificate that is "not yet valid" on a slow peer fails a handshake
for no reason anyone could see.

Files are PEM, written atomically (a temporary file in the same directory, fsync, ``os.replace``,
fsync of the directory): a crash leaves the old file or the new one, never half of one. Private
keys are written 0600 and unencrypted; the directory's permissions are what protect them.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshnet.errors import InvalidRequest, NotFound, Unauthorized
from meshnet.fsutil import PRIVATE_MODE, PUBLIC_MODE, write_atomic

__all__ = [
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "CA_VALIDITY",
    "CLOCK_SKEW",
    "DIRECTORY_MODE",
    "MEMBER_VALIDITY",
    "ROLES",
    "CertificateLike",
    "Member",
    "MemberRequest",
    "SwarmCA",
    "as_certificate",
    "check_member_id",
    "check_role",
    "csr_member_id",
    "fingerprint",
    "key_matches",
    "key_pem",
    "load_certificate",
    "load_private_key",
    "make_csr",
    "member_of",
    "new_member_key",
    "swarm_id_of",
]

CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
CA_VALIDITY = timedelta(days=3650)
MEMBER_VALIDITY = timedelta(days=365)
CLOCK_SKEW = timedelta(minutes=5)
ROLES = ("node", "gateway", "tracker", "admin")
URI_SCHEME = "meshnet://"
TRUST_SEGMENT = "trust"
TRUSTED = "trusted"
UNTRUSTED = "untrusted"
SWARM_ID_PREFIX = "swm-"
SWARM_ID_HEX_BYTES = 8
MAX_NAME_CHARS = 64  # the X.509 upper bound on a common name
MAX_SANS = 16
DIRECTORY_MODE = 0o700
_MEMBER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SWARM_ID = re.compile(rf"{SWARM_ID_PREFIX}[0-9a-f]{{{2 * SWARM_ID_HEX_BYTES}}}")
_DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_MAX_DNS_CHARS = 253
_CURVE = ec.SECP256R1
_SIGNATURE_HASH = hashes.SHA256

CertificateLike = x509.Certificate | bytes
"""A certificate object, or its PEM or DER bytes."""


@dataclass(frozen=True, slots=True)
class Member:
    """Who a certificate says its holder is, once :func:`member_of` has checked it."""

    swarm_id: str
    member_id: str
    role: str
    trusted: bool
    expires: datetime
    serial: str = ""  # the certificate's serial number, hex (what a revocation names)

    @property
    def uri(self) -> str:
        return _member_uri(self.swarm_id, self.role, self.member_id)


@dataclass(frozen=True, slots=True)
class MemberRequest:
    """What the CA needs to issue a member certificate: the member's CSR (PEM, from :func:`make_csr`;
    its CN is the member id) and what the CA grants. ``sans`` are DNS names or IP addresses the
    member serves TLS on; ``not_before``/``expires`` default to now - ``CLOCK_SKEW`` and now +
    ``MEMBER_VALIDITY`` (no later than the CA's own expiry)."""

    csr_pem: bytes
    role: str
    trusted: bool = False
    sans: tuple[str, ...] = ()
    not_before: datetime | None = None
    expires: datetime | None = None


def check_member_id(member_id: str) -> str:
    """``member_id`` if it is 1..64 of ``[A-Za-z0-9._-]`` (and not ``.`` or ``..``: ids end up in
    URIs and file names, where those mean something else), else ``InvalidRequest``."""
    if not isinstance(member_id, str) or not _MEMBER_ID.fullmatch(member_id) or member_id in (".", ".."):
        raise InvalidRequest(
            f"member id {member_id!r} is not valid: use 1 to 64 letters, digits, '.', '_' or '-' (not '.' or '..')",
            param="member_id",
        )
    return member_id


def check_role(role: str) -> str:
    if role not in ROLES:
        raise InvalidRequest(f"role {role!r} is not one of {', '.join(ROLES)}", param="role")
    return role


def new_member_key() -> ec.EllipticCurvePrivateKey:
    """A fresh ECDSA P-256 private key for a member (it never leaves the member)."""
    return ec.generate_private_key(_CURVE())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """The key as unencrypted PKCS#8 PEM (written 0600; see the module docstring)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_csr(key: ec.EllipticCurvePrivateKey, member_id: str) -> bytes:
    """A certificate signing request (PEM) for ``member_id``, signed by ``key`` to prove it holds it."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, check_member_id(member_id))])
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, _SIGNATURE_HASH())
    return csr.public_bytes(serialization.Encoding.PEM)


def csr_member_id(csr_pem: bytes) -> str:
    """The member id a CSR asks for, once its signature verifies, else ``InvalidRequest``."""
    return _member_id_of_csr(_load_csr(csr_pem))


def fingerprint(cert: CertificateLike) -> str:
    """SHA-256 of the certificate's DER, lowercase hex: what an invite pins the CA by."""
    der = as_certificate(cert).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def key_matches(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    """Whether ``cert`` is a certificate for ``key`` (their public keys are the same)."""
    theirs = _public_der(cert.public_key())
    return theirs is not None and theirs == _public_der(key.public_key())


def as_certificate(value: CertificateLike, *, what: str = "certificate") -> x509.Certificate:
    """A certificate from an object or its PEM or DER bytes, else ``InvalidRequest``."""
    if isinstance(value, x509.Certificate):
        return value
    if not isinstance(value, bytes | bytearray | memoryview):
        raise InvalidRequest(f"{what} must be a certificate or its PEM or DER bytes, not {type(value).__name__}")
    data = bytes(value)
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)
    except ValueError as exc:
        raise InvalidRequest(f"{what} is not a PEM or DER X.509 certificate ({exc})") from exc


def swarm_id_of(ca_cert: CertificateLike) -> str:
    """The swarm id a CA certificate carries (SAN URI ``meshnet://<swarm_id>``)."""
    cert = as_certificate(ca_cert, what="CA certificate")
    ids = [
        uri.removeprefix(URI_SCHEME)
        for uri in _san_values(cert, x509.UniformResourceIdentifier)
        if uri.startswith(URI_SCHEME) and _SWARM_ID.fullmatch(uri.removeprefix(URI_SCHEME))
    ]
    if len(ids) != 1 or not _is_ca(cert):
        raise InvalidRequest(f"{_describe(cert)} is not a Meshnet swarm CA certificate (it needs one swarm id URI)")
    return ids[0]


def member_of(cert: CertificateLike, ca_cert: CertificateLike, *, now: datetime | None = None) -> Member:
    """Who ``cert`` says its holder is, once it is checked against this swarm's CA.

    ``Unauthorized`` (saying what is wrong) unless the CA signed it, it is within its validity
    window at ``now`` (default: the current time), and it names this CA's swarm, a known role, and
    a member id equal to its CN.
    """
    ca = as_certificate(ca_cert, what="CA certificate")
    swarm_id = swarm_id_of(ca)
    try:
        member_cert = as_certificate(cert, what="member certificate")
    except InvalidRequest as exc:
        raise Unauthorized(exc.message) from exc
    when = now or datetime.now(UTC)
    _check_issued_by(member_cert, ca, swarm_id)
    _check_window(ca, when, f"the CA certificate of swarm {swarm_id}")
    _check_window(member_cert, when, _describe(member_cert))
    member = _claims(member_cert)
    if member.swarm_id != swarm_id:
        raise Unauthorized(f"{member.member_id} is not a member of swarm {swarm_id}: it names swarm {member.swarm_id}")
    if _common_name(member_cert) != member.member_id:
        raise Unauthorized(f"{_describe(member_cert)} does not match the member id {member.member_id!r} it claims")
    return member


@dataclass(frozen=True, slots=True)
class SwarmCA:
    """A swarm's certificate authority: its key and self-signed certificate, kept in ``directory``
    as ``ca.key`` (0600) and ``ca.pem``. Only the tracker (or an admin's machine) holds one."""

    directory: Path
    name: str
    swarm_id: str
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey = field(repr=False)

    @classmethod
    def init(cls, directory: Path, *, name: str, valid_for: timedelta = CA_VALIDITY) -> SwarmCA:
        """Create a new swarm in ``directory``: a fresh key, a self-signed CA certificate for
        ``valid_for`` (10 years) and a random swarm id. Refuses a directory that holds a swarm."""
        directory = Path(directory)
        name = _check_swarm_name(name)
        existing = [directory / f for f in (CA_CERT_FILE, CA_KEY_FILE) if (directory / f).exists()]
        if existing:
            raise InvalidRequest(
                f"{directory} already holds a swarm ({', '.join(map(str, existing))}); "
                "load it, or choose an empty directory"
            )
        swarm_id = SWARM_ID_PREFIX + secrets.token_hex(SWARM_ID_HEX_BYTES)
        key = ec.generate_private_key(_CURVE())
        cert = _ca_certificate(key, name, swarm_id, datetime.now(UTC), valid_for)
        directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
        write_atomic(directory / CA_KEY_FILE, key_pem(key), mode=PRIVATE_MODE)
        write_atomic(directory / CA_CERT_FILE, cert.public_bytes(serialization.Encoding.PEM), mode=PUBLIC_MODE)
        return cls(directory, name, swarm_id, cert, key)

    @classmethod
    def load(cls, directory: Path) -> SwarmCA:
        """The swarm in ``directory``; ``NotFound`` or ``InvalidRequest`` naming the file at fault."""
        directory = Path(directory)
        cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
        cert = load_certificate(cert_path)
        key = load_private_key(key_path)
        if not isinstance(key.curve, _CURVE):
            raise InvalidRequest(f"{key_path} is a {key.curve.name} key; a swarm CA key is P-256 ({_CURVE.name})")
        if not key_matches(cert, key):
            raise InvalidRequest(f"{key_path} is not the key of the certificate {cert_path}")
        try:
            swarm_id = swarm_id_of(cert)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{cert_path}: {exc.message}") from exc
        return cls(directory, _common_name(cert) or "", swarm_id, cert, key)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert)

    def issue(self, member: MemberRequest) -> bytes:
        """A member certificate (PEM) for the CSR in ``member``, with the role and trust it grants.
        ``InvalidRequest`` for a bad CSR, role, SAN or validity window; nothing is recorded."""
        csr = _load_csr(member.csr_pem)
        member_id = _member_id_of_csr(csr)
        role = check_role(member.role)
        sans = _parse_sans(member.sans)
        not_before, expires = self._window(member)
        public_key = csr.public_key()
        if not isinstance(public_key, ec.EllipticCurvePublicKey):
            raise InvalidRequest(f"the CSR of {member_id} has a {type(public_key).__name__}; members use EC keys")
        trust = TRUSTED if member.trusted else UNTRUSTED
        uris: list[x509.GeneralName] = [
            x509.UniformResourceIdentifier(_member_uri(self.swarm_id, role, member_id)),
            x509.UniformResourceIdentifier(_member_uri(self.swarm_id, TRUST_SEGMENT, trust)),
        ]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, member_id)]))
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(expires)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(digital_signature=True), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName([*uris, *sans]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )
        return builder.sign(self.key, _SIGNATURE_HASH()).public_bytes(serialization.Encoding.PEM)

    def _window(self, member: MemberRequest) -> tuple[datetime, datetime]:
        now = datetime.now(UTC)
        ca_expires = self.cert.not_valid_after_utc
        not_before = _utc(member.not_before, "not_before") if member.not_before else now - CLOCK_SKEW
        expires = _utc(member.expires, "expires") if member.expires else min(now + MEMBER_VALIDITY, ca_expires)
        if expires <= not_before:
            raise InvalidRequest(f"a certificate must expire after it starts ({expires} <= {not_before})")
        if expires > ca_expires:
            raise InvalidRequest(f"a member certificate cannot outlive its CA (the CA expires at {_iso(ca_expires)})")
        return not_before, expires


def load_certificate(path: Path) -> x509.Certificate:
    """The PEM certificate at ``path``; ``NotFound``/``InvalidRequest`` naming the path."""
    data = _read(Path(path), "certificate")
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise InvalidRequest(f"{path} is not a PEM certificate (corrupt or truncated?)") from exc


def load_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """The unencrypted PEM EC private key at ``path``; ``NotFound``/``InvalidRequest`` naming the path."""
    data = _read(Path(path), "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        reason = "it is encrypted" if isinstance(exc, TypeError) else "corrupt or truncated?"
        raise InvalidRequest(f"{path} is not an unencrypted PEM private key ({reason})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidRequest(f"{path} holds a {type(key).__name__}; Meshnet keys are ECDSA (P-256)")
    return key


# -- helpers ----------------------------------------------------------------------------------------


def _ca_certificate(
    key: ec.EllipticCurvePrivateKey, name: str, swarm_id: str, now: datetime, valid_for: timedelta
) -> x509.Certificate:
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Meshnet swarm"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, swarm_id),
        ]
    )
    public_key = key.public_key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + valid_for)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(URI_SCHEME + swarm_id)]), False)
    )
    return builder.sign(key, _SIGNATURE_HASH())


def _key_usage(
    *, digital_signature: bool = False, key_cert_sign: bool = False, crl_sign: bool = False
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _member_uri(swarm_id: str, segment: str, leaf: str) -> str:
    return f"{URI_SCHEME}{swarm_id}/{segment}/{leaf}"


def _claims(cert: x509.Certificate) -> Member:
    """The member and trust URIs of a certificate, parsed; ``Unauthorized`` if they are not exactly
    one of each, well formed."""
    who = _describe(cert)
    members: list[list[str]] = []
    trusts: list[list[str]] = []
    for uri in _san_values(cert, x509.UniformResourceIdentifier):
        if not uri.startswith(URI_SCHEME):
            continue
        parts = uri.removeprefix(URI_SCHEME).split("/")
        if len(parts) != 3:
            raise Unauthorized(f"{who} carries a malformed Meshnet URI {uri!r}")
        (trusts if parts[1] == TRUST_SEGMENT else members).append(parts)
    if len(members) != 1 or len(trusts) != 1:
        raise Unauthorized(f"{who} is not a Meshnet member certificate (it needs one member URI and one trust URI)")
    (swarm_id, role, member_id), (trust_swarm, _, trust) = members[0], trusts[0]
    if trust_swarm != swarm_id or trust not in (TRUSTED, UNTRUSTED):
        raise Unauthorized(f"{who} carries a malformed trust URI")
    if role not in ROLES or not _MEMBER_ID.fullmatch(member_id):
        raise Unauthorized(f"{who} names an unknown role {role!r} or a malformed member id {member_id!r}")
    return Member(
        swarm_id, member_id, role, trust == TRUSTED, cert.not_valid_after_utc, format(cert.serial_number, "x")
    )


def _check_issued_by(cert: x509.Certificate, ca: x509.Certificate, swarm_id: str) -> None:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise Unauthorized(
            f"{_describe(cert)} is signed by another CA ({cert.issuer.rfc4514_string()}), not by swarm {swarm_id}'s"
        ) from exc
    if _is_ca(cert):
        raise Unauthorized(f"{_describe(cert)} is a CA certificate, not a member's")


def _check_window(cert: x509.Certificate, now: datetime, what: str) -> None:
    if now < cert.not_valid_before_utc:
        raise Unauthorized(f"{what} is not valid until {_iso(cert.not_valid_before_utc)}")
    if now > cert.not_valid_after_utc:
        raise Unauthorized(f"{what} expired at {_iso(cert.not_valid_after_utc)}")


def _load_csr(csr_pem: bytes) -> x509.CertificateSigningRequest:
    try:
        csr = x509.load_pem_x509_csr(bytes(csr_pem))
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"not a PEM certificate signing request: {exc}", param="csr") from exc
    if not csr.is_signature_valid:
        raise InvalidRequest("the CSR's signature does not verify: it was not signed by its own key", param="csr")
    return csr


def _member_id_of_csr(csr: x509.CertificateSigningRequest) -> str:
    names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1 or not isinstance(names[0].value, str):
        raise InvalidRequest("the CSR must name exactly one member id (its subject CN)", param="csr")
    return check_member_id(names[0].value)


def _parse_sans(sans: Sequence[str]) -> list[x509.GeneralName]:
    if isinstance(sans, str):
        raise InvalidRequest("sans must be a list of names or addresses, not one string", param="sans")
    if len(sans) > MAX_SANS:
        raise InvalidRequest(f"at most {MAX_SANS} DNS names and IP addresses, got {len(sans)}", param="sans")
    names: list[x509.GeneralName] = []
    for san in sans:
        if not isinstance(san, str):
            raise InvalidRequest(f"{san!r} is neither an IP address nor a DNS name", param="sans")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            labels = san.split(".")
            if len(san) > _MAX_DNS_CHARS or not all(_DNS_LABEL.fullmatch(label) for label in labels):
                raise InvalidRequest(f"{san!r} is neither an IP address nor a DNS name", param="sans") from None
            names.append(x509.DNSName(san.lower()))
    return names


def _san_values(cert: x509.Certificate, kind: type[x509.UniformResourceIdentifier]) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(san.get_values_for_type(kind))


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def _common_name(cert: x509.Certificate) -> str | None:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = names[0].value if len(names) == 1 else None
    return value if isinstance(value, str) else None


def _describe(cert: x509.Certificate) -> str:
    name = _common_name(cert)
    return f"certificate {name!r}" if name else f"certificate {cert.subject.rfc4514_string()!r}"


def _check_swarm_name(name: str) -> str:
    if (
        not isinstance(name, str)
        or not 0 < len(name) <= MAX_NAME_CHARS
        or not name.isprintable()
        or name != name.strip()
    ):
        raise InvalidRequest(
            f"swarm name {name!r} is not valid: use 1 to {MAX_NAME_CHARS} printable characters", param="name"
        )
    return name


def _public_der(key: object) -> bytes | None:
    if not isinstance(key, ec.EllipticCurvePublicKey):
        return None
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise NotFound(f"{what} file {path} does not exist") from exc
    except OSError as exc:
        raise InvalidRequest(f"cannot read {what} file {path}: {exc.strerror}") from exc


def _utc(when: datetime, what: str) -> datetime:
    if when.tzinfo is None:
        raise InvalidRequest(f"{what} must be timezone-aware ({when!r} is naive)", param=what)
    return when.astimezone(UTC)


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat(timespec="seconds")
