"""Private swarms: the CA and member certificates, invites and joins, and mutual TLS on loopback."""

from __future__ import annotations

import base64
import json
import re
import socket
import ssl
import stat
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtendedKeyUsageOID

from meshnet.errors import InvalidRequest, NotFound, Unauthorized
from meshnet.security import (
    Credentials,
    InviteLedger,
    Member,
    MemberRequest,
    SwarmCA,
    admit,
    make_csr,
    member_of,
    mint_invite,
    new_member_key,
    peek_invite,
    peer_member,
    read_invite,
    save_member,
)
from meshnet.security.identity import CA_CERT_FILE, CA_KEY_FILE, check_member_id, swarm_id_of
from meshnet.security.invites import LEDGER_GRACE_S

WAIT_S = 5.0


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> SwarmCA:
    return SwarmCA.init(tmp_path_factory.mktemp("swarm"), name="lab")


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> SwarmCA:
    return SwarmCA.init(tmp_path_factory.mktemp("other"), name="lab")  # same name: only the key differs


def _issue(ca: SwarmCA, member_id: str, role: str = "node", **kwargs: Any) -> bytes:
    csr = make_csr(new_member_key(), member_id)
    return ca.issue(MemberRequest(csr, role=role, **kwargs))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# -- the CA -----------------------------------------------------------------------------------------


def test_init_and_load_round_trip(tmp_path: Path):
    directory = tmp_path / "swarm"
    ca = SwarmCA.init(directory, name="lab swarm")
    assert ca.swarm_id.startswith("swm-") and len(ca.swarm_id) == 4 + 16
    assert stat.S_IMODE((directory / CA_KEY_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert sorted(p.name for p in directory.iterdir()) == sorted([CA_CERT_FILE, CA_KEY_FILE])  # no temporary left

    cert = ca.cert
    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
    assert timedelta(days=3649) < cert.not_valid_after_utc - cert.not_valid_before_utc < timedelta(days=3651)
    assert swarm_id_of(cert) == ca.swarm_id

    loaded = SwarmCA.load(directory)
    assert (loaded.swarm_id, loaded.name, loaded.fingerprint) == (ca.swarm_id, "lab swarm", ca.fingerprint)
    assert loaded.cert_pem == ca.cert_pem
    assert "PrivateKey" not in repr(loaded)  # the key is never in a repr


def test_init_refuses_a_directory_that_holds_a_swarm(tmp_path: Path):
    ca = SwarmCA.init(tmp_path, name="lab")
    with pytest.raises(InvalidRequest, match="already holds a swarm"):
        SwarmCA.init(tmp_path, name="lab")
    assert SwarmCA.load(tmp_path).swarm_id == ca.swarm_id  # untouched


def test_load_names_the_corrupt_or_missing_file(tmp_path: Path):
    SwarmCA.init(tmp_path, name="lab")
    cert_path, key_path = tmp_path / CA_CERT_FILE, tmp_path / CA_KEY_FILE
    cert_path.write_bytes(cert_path.read_bytes()[:100])  # truncated
    with pytest.raises(InvalidRequest, match=re.escape(str(cert_path))):
        SwarmCA.load(tmp_path)
    key_path.unlink()
    SwarmCA.init(tmp_path / "fresh", name="lab")
    (tmp_path / "fresh" / CA_KEY_FILE).write_text("not a key")
    with pytest.raises(InvalidRequest, match=re.escape(str(tmp_path / "fresh" / CA_KEY_FILE))):
        SwarmCA.load(tmp_path / "fresh")
    with pytest.raises(NotFound, match=re.escape(str(tmp_path / "nowhere" / CA_CERT_FILE))):
        SwarmCA.load(tmp_path / "nowhere")


def test_load_refuses_a_key_that_is_not_the_certificates(tmp_path: Path, other_ca: SwarmCA):
    SwarmCA.init(tmp_path, name="lab")
    (tmp_path / CA_KEY_FILE).write_bytes((other_ca.directory / CA_KEY_FILE).read_bytes())
    with pytest.raises(InvalidRequest, match="is not the key of the certificate"):
        SwarmCA.load(tmp_path)


# -- member certificates ----------------------------------------------------------------------------


@pytest.mark.parametrize(("role", "trusted"), [("node", True), ("gateway", False), ("admin", False)])
def test_issue_and_member_of_round_trip(ca: SwarmCA, role: str, trusted: bool):
    pem = _issue(ca, "node-1.a_b", role, trusted=trusted, sans=("127.0.0.1", "localhost", "::1"))
    member = member_of(pem, ca.cert)
    assert member == Member(ca.swarm_id, "node-1.a_b", role, trusted, member.expires, member.serial)
    assert member.serial == format(x509.load_pem_x509_certificate(pem).serial_number, "x")
    assert timedelta(days=364) < member.expires - datetime.now(UTC) <= timedelta(days=365)
    assert member.uri == f"meshnet://{ca.swarm_id}/{role}/node-1.a_b"

    cert = x509.load_pem_x509_certificate(pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    trust = "trusted" if trusted else "untrusted"
    assert set(san.get_values_for_type(x509.UniformResourceIdentifier)) == {
        member.uri,
        f"meshnet://{ca.swarm_id}/trust/{trust}",
    }
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}
    assert member_of(cert.public_bytes(Encoding.DER), ca.cert_pem) == member  # DER and PEM forms too


def test_a_certificate_of_another_swarm_is_refused(ca: SwarmCA, other_ca: SwarmCA):
    pem = _issue(other_ca, "intruder")
    with pytest.raises(Unauthorized, match="signed by another CA"):
        member_of(pem, ca.cert)


def test_an_expired_certificate_is_refused(ca: SwarmCA):
    now = datetime.now(UTC)
    pem = _issue(ca, "old", not_before=now - timedelta(days=2), expires=now - timedelta(days=1))
    with pytest.raises(Unauthorized, match="expired at"):
        member_of(pem, ca.cert)
    future = _issue(ca, "early", not_before=now + timedelta(days=1), expires=now + timedelta(days=2))
    with pytest.raises(Unauthorized, match="not valid until"):
        member_of(future, ca.cert)


def test_the_ca_certificate_itself_is_no_member(ca: SwarmCA):
    with pytest.raises(Unauthorized, match="CA certificate"):
        member_of(ca.cert, ca.cert)


@pytest.mark.parametrize("bad", ["", "a" * 65, "has space", "slash/es", "ümlaut", ".", ".."])
def test_member_id_rules(bad: str):
    with pytest.raises(InvalidRequest, match="member id"):
        check_member_id(bad)
    with pytest.raises(InvalidRequest):
        make_csr(new_member_key(), bad)


def test_issue_refuses_bad_requests(ca: SwarmCA):
    csr = make_csr(new_member_key(), "n1")
    with pytest.raises(InvalidRequest, match="role"):
        ca.issue(MemberRequest(csr, role="root"))
    with pytest.raises(InvalidRequest, match="neither an IP address nor a DNS name"):
        ca.issue(MemberRequest(csr, role="node", sans=("bad host!",)))
    with pytest.raises(InvalidRequest, match="outlive its CA"):
        ca.issue(MemberRequest(csr, role="node", expires=datetime.now(UTC) + timedelta(days=20 * 365)))
    with pytest.raises(InvalidRequest, match="certificate signing request"):
        ca.issue(MemberRequest(b"garbage", role="node"))


# -- invites ----------------------------------------------------------------------------------------


def test_invite_round_trip(ca: SwarmCA):
    token = mint_invite(ca, role="node", trusted=True, member_id="n7", tracker_url="https://10.0.0.2:8400")
    prefix, payload, _ = token.split(".")
    assert prefix == "mninv1"
    raw = _unb64(payload)
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()  # canonical
    invite = read_invite(token, ca.cert)
    assert (invite.swarm_id, invite.role, invite.trusted, invite.member_id) == (ca.swarm_id, "node", True, "n7")
    assert invite.tracker_url == "https://10.0.0.2:8400"
    assert invite.ca_fingerprint == ca.fingerprint and len(invite.nonce) == 32
    assert 86400 - 5 <= invite.expires_at - time.time() <= 86400 + 1
    assert peek_invite(token) == invite
    assert read_invite(mint_invite(ca, role="gateway"), ca.cert_pem).member_id is None


def test_a_tampered_invite_is_refused(ca: SwarmCA):
    token = mint_invite(ca, role="node")
    prefix, payload, signature = token.split(".")
    claims = json.loads(_unb64(payload))
    claims.update(role="admin", trusted=True)
    forged = f"{prefix}.{_b64(json.dumps(claims, sort_keys=True, separators=(',', ':')).encode())}.{signature}"
    assert peek_invite(forged).role == "admin"  # it parses...
    with pytest.raises(Unauthorized, match="bad signature"):
        read_invite(forged, ca.cert)  # ...but does not verify
    sig = bytearray(_unb64(signature))
    sig[10] ^= 0x01
    with pytest.raises(Unauthorized, match="bad signature"):
        read_invite(f"{prefix}.{payload}.{_b64(bytes(sig))}", ca.cert)


def test_an_invite_of_another_swarm_is_refused(ca: SwarmCA, other_ca: SwarmCA):
    with pytest.raises(Unauthorized, match="not for swarm"):
        read_invite(mint_invite(other_ca, role="node"), ca.cert)


@pytest.mark.parametrize(
    "token",
    [
        "",
        "mninv1",
        "mninv2.e30.AA",
        "mninv1.e30",
        "mninv1.!!!.AA",
        "mninv1.e31.AA",  # not canonical base64url: unused bits set
        "mninv1.bm90IGpzb24.AA",  # "not json"
        "mninv1.e30.AA",  # {}: no version
        "mninv1.eyJ2IjoyfQ.AA",  # {"v":2}
        "mninv1.eyJ2IjoxfQ.AA",  # {"v":1} and nothing else
    ],
)
def test_a_malformed_invite_is_refused(ca: SwarmCA, token: str):
    with pytest.raises(InvalidRequest, match="invite"):
        read_invite(token, ca.cert)


def test_an_expired_invite_is_refused(ca: SwarmCA):
    token = mint_invite(ca, role="node", expires_in_s=60, now=time.time() - 3600)
    with pytest.raises(Unauthorized, match="expired at"):
        read_invite(token, ca.cert)
    fresh = mint_invite(ca, role="node", expires_in_s=60)
    with pytest.raises(Unauthorized, match="expired at"):
        read_invite(fresh, ca.cert, now=time.time() + 61)


def test_an_invite_is_single_use_and_the_ledger_persists(ca: SwarmCA):
    ledger = InviteLedger()
    invite = read_invite(mint_invite(ca, role="node"), ca.cert)
    ledger.redeem(invite)
    with pytest.raises(Unauthorized, match="invite already used"):
        ledger.redeem(invite)
    restored = InviteLedger.from_json(ledger.to_json())
    assert invite.nonce in restored
    with pytest.raises(Unauthorized, match="invite already used"):
        restored.redeem(invite)
    assert restored.prune(now=invite.expires_at + LEDGER_GRACE_S + 1) == 1 and len(restored) == 0
    with pytest.raises(InvalidRequest, match="ledger"):
        InviteLedger.from_json('{"v": 1, "used": []}')


# -- joining ----------------------------------------------------------------------------------------


def test_admit_refuses_a_csr_for_another_id_and_keeps_the_invite(ca: SwarmCA):
    ledger = InviteLedger()
    token = mint_invite(ca, role="node", trusted=True)
    key = new_member_key()
    with pytest.raises(InvalidRequest, match="the CSR is for member 'someone-else'"):
        admit(ca, ledger, token, make_csr(key, "someone-else"), requested_id="n1", sans=["127.0.0.1"])
    with pytest.raises(InvalidRequest, match="neither an IP address"):
        admit(ca, ledger, token, make_csr(key, "n1"), requested_id="n1", sans=["bad host!"])
    assert len(ledger) == 0  # not consumed: the same invite still admits
    cert = admit(ca, ledger, token, make_csr(key, "n1"), requested_id="n1", sans=["127.0.0.1"])
    member = member_of(cert, ca.cert)
    assert member == Member(ca.swarm_id, "n1", "node", True, member.expires, member.serial)
    with pytest.raises(Unauthorized, match="invite already used"):
        admit(ca, ledger, token, make_csr(key, "n1"), requested_id="n1", sans=[])


def test_admit_honours_a_pinned_member(ca: SwarmCA):
    ledger = InviteLedger()
    token = mint_invite(ca, role="gateway", member_id="gw-1")
    with pytest.raises(Unauthorized, match="this invite is for member 'gw-1'"):
        admit(ca, ledger, token, make_csr(new_member_key(), "gw-2"), requested_id="gw-2", sans=[])
    assert len(ledger) == 0
    member = member_of(
        admit(ca, ledger, token, make_csr(new_member_key(), "gw-1"), requested_id="gw-1", sans=[]), ca.cert
    )
    assert (member.member_id, member.role, member.trusted) == ("gw-1", "gateway", False)


# -- mutual TLS -------------------------------------------------------------------------------------


def _credentials(
    ca: SwarmCA, directory: Path, member_id: str, role: str, trusted_by: SwarmCA | None = None
) -> Credentials:
    """Credentials of ``member_id`` issued by ``ca``, trusting ``trusted_by``'s CA (default: ``ca``)."""
    key = new_member_key()
    cert = ca.issue(MemberRequest(make_csr(key, member_id), role=role, sans=("127.0.0.1",)))
    creds = save_member(directory, cert, key)
    (directory / CA_CERT_FILE).write_bytes((trusted_by or ca).cert_pem)
    return creds


@dataclass
class _Server:
    """A one-connection TLS server on 127.0.0.1: handshake, identify the client, answer, close."""

    context: ssl.SSLContext
    ca: SwarmCA
    clients: list[Member] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(WAIT_S)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, name="tls-test-server", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            raw, _ = self.listener.accept()
            raw.settimeout(WAIT_S)
            with self.context.wrap_socket(raw, server_side=True) as conn:
                self.clients.append(peer_member(conn, self.ca.cert))
                conn.sendall(b"hello " + self.clients[-1].member_id.encode())
        except (OSError, Unauthorized) as exc:  # ssl.SSLError is an OSError
            self.errors.append(exc)
        finally:
            self.listener.close()

    def join(self) -> None:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


def _talk(context: ssl.SSLContext, port: int) -> tuple[bytes, bytes]:
    """Connect, return (what the server said, the server's certificate DER)."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        der = conn.getpeercert(binary_form=True)
        assert der is not None
        return conn.recv(64), der


def test_mutual_tls_handshake_identifies_both_sides(ca: SwarmCA, tmp_path: Path):
    server_creds = _credentials(ca, tmp_path / "tracker", "tracker-1", "tracker")
    client_creds = _credentials(ca, tmp_path / "node", "node-1", "node")
    server = _Server(server_creds.server_context(), ca)
    try:
        answer, server_der = _talk(client_creds.client_context(), server.port)
    finally:
        server.join()
    assert server.errors == []
    assert [(m.member_id, m.role) for m in server.clients] == [("node-1", "node")]
    assert answer == b"hello node-1"
    assert peer_member(server_der, ca.cert).role == "tracker"
    assert client_creds.member().member_id == "node-1"


def test_mutual_tls_refuses_a_client_of_another_swarm(ca: SwarmCA, other_ca: SwarmCA, tmp_path: Path):
    server_creds = _credentials(ca, tmp_path / "tracker", "tracker-1", "tracker")
    intruder = _credentials(other_ca, tmp_path / "intruder", "node-1", "node", trusted_by=ca)
    server = _Server(server_creds.server_context(), ca)
    try:
        answer, _ = _talk(intruder.client_context(), server.port)
    except OSError:  # TLS 1.3: the client learns on its first read (ssl.SSLError, a reset, or just EOF)
        answer = b""
    finally:
        server.join()
    assert answer == b"", "the server must not talk to a member of another swarm"
    assert server.clients == []
    assert len(server.errors) == 1 and isinstance(server.errors[0], ssl.SSLError)


def test_save_member_writes_the_layout(ca: SwarmCA, tmp_path: Path):
    key = new_member_key()
    cert = ca.issue(MemberRequest(make_csr(key, "n1"), role="node"))
    creds = save_member(tmp_path / "creds", cert, key, ca_pem=ca.cert_pem)
    assert creds == Credentials.at(tmp_path / "creds") and creds.exists()
    assert stat.S_IMODE(creds.key_path.stat().st_mode) == 0o600
    assert creds.member().member_id == "n1"
    with pytest.raises(InvalidRequest, match="not for this key"):
        save_member(tmp_path / "other", cert, new_member_key())
    with pytest.raises(NotFound, match=re.escape("member.pem")):
        Credentials.at(tmp_path / "missing").client_context()
