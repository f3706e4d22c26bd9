"""Route tickets (meshnet.protocol.tickets): the golden token, sign/verify, every refusal, key
rotation, repair tickets, and a seeded fuzz loop that may only ever raise Meshnet errors."""

from __future__ import annotations

import base64
import dataclasses
import json
import random
import string
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet.errors import InvalidRequest, MeshnetError, Unauthorized
from meshnet.ids import RouteId, SessionId
from meshnet.layers import LayerRange
from meshnet.protocol.tickets import (
    CLOCK_SKEW_S,
    CODE_EXPIRED,
    CODE_INVALID,
    CODE_MALFORMED,
    CODE_MISMATCH,
    CODE_MISSING,
    MAX_TICKET_BYTES,
    REPAIR,
    ROUTE,
    TICKET_HEADER,
    RouteTicket,
    TicketHop,
    TicketSigner,
    TicketVerifier,
    repair_ticket,
    route_ticket,
)
from meshnet.routes import Hop

# RFC 8032, section 7.1, TEST 1: a published Ed25519 key pair.
RFC8032_SEED = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC8032_PUBLIC = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
OTHER_SEED = bytes(range(32))

NOW = 1_700_000_000.0
TTL_S = 300.0
SID = SessionId("ses-0123")
RID = RouteId("rte-4567")
HEAD = TicketHop("node-a", "http://10.0.0.1:7001", "0:8")
MIDDLE = TicketHop("node-b", "http://10.0.0.2:7002", "8:16")
TAIL = TicketHop("node-c", "http://10.0.0.3:7003", "16:24")
SPARE = TicketHop("node-d", "http://10.0.0.4:7004", "8:16")

GOLDEN_KEY_ID = "21fe31dfa154a261"
GOLDEN_PAYLOAD = (
    '{"epoch":0,"expires_at":1700000300.0,"hops":['
    '{"layers":"0:8","node_id":"node-a","url":"http://10.0.0.1:7001"},'
    '{"layers":"8:16","node_id":"node-b","url":"http://10.0.0.2:7002"},'
    '{"layers":"16:24","node_id":"node-c","url":"http://10.0.0.3:7003"}],'
    '"issued_at":1700000000.0,"kind":"route","model_digest":"sha256:abcd","owner":"","repair_from":null,'
    '"route_id":"rte-4567","session_id":"ses-0123","tracker_key_id":"21fe31dfa154a261"}'
)
GOLDEN_TOKEN = (
    "mnt1.eyJlcG9jaCI6MCwiZXhwaXJlc19hdCI6MTcwMDAwMDMwMC4wLCJob3BzIjpbeyJsYXllcnMiOiIwOjgiLCJub2RlX2lkIjo"
    "ibm9kZS1hIiwidXJsIjoiaHR0cDovLzEwLjAuMC4xOjcwMDEifSx7ImxheWVycyI6Ijg6MTYiLCJub2RlX2lkIjoibm9kZS1iIiw"
    "idXJsIjoiaHR0cDovLzEwLjAuMC4yOjcwMDIifSx7ImxheWVycyI6IjE2OjI0Iiwibm9kZV9pZCI6Im5vZGUtYyIsInVybCI6Imh"
    "0dHA6Ly8xMC4wLjAuMzo3MDAzIn1dLCJpc3N1ZWRfYXQiOjE3MDAwMDAwMDAuMCwia2luZCI6InJvdXRlIiwibW9kZWxfZGlnZXN"
    "0Ijoic2hhMjU2OmFiY2QiLCJvd25lciI6IiIsInJlcGFpcl9mcm9tIjpudWxsLCJyb3V0ZV9pZCI6InJ0ZS00NTY3Iiwic2Vzc2l"
    "vbl9pZCI6InNlcy0wMTIzIiwidHJhY2tlcl9rZXlfaWQiOiIyMWZlMzFkZmExNTRhMjYxIn0.slaxBtLrHzKw9Tgz6brm4OmBmdG"
    "2az-W5_jIorNgUDDb0OT8yB0erUGakobv9IH-DLChpaew482ehig6ZeFxDA"
)


def _signer(seed: bytes = RFC8032_SEED) -> TicketSigner:
    return TicketSigner(Ed25519PrivateKey.from_private_bytes(seed))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign_raw(payload: bytes, seed: bytes = RFC8032_SEED) -> str:
    """A token over any payload bytes, signed by the key of ``seed`` (bypassing TicketSigner)."""
    signed = f"mnt1.{_b64(payload)}"
    return f"{signed}.{_b64(Ed25519PrivateKey.from_private_bytes(seed).sign(signed.encode()))}"


def _payload_json(token: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(_unb64(token.split(".")[1]))
    return loaded


@pytest.fixture
def signer() -> TicketSigner:
    return _signer()


@pytest.fixture
def verifier(signer: TicketSigner) -> TicketVerifier:
    return TicketVerifier(signer.public_pem())


@pytest.fixture
def ticket() -> RouteTicket:
    return route_ticket(SID, RID, "sha256:abcd", (HEAD, MIDDLE, TAIL), ttl_s=TTL_S, now=NOW)


@pytest.fixture
def token(signer: TicketSigner, ticket: RouteTicket) -> str:
    return signer.sign(ticket)


# -- the golden token ---------------------------------------------------------------------------


def test_the_key_is_rfc8032_test_1(signer: TicketSigner) -> None:
    public = serialization.load_pem_public_key(signer.public_pem())
    assert public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) == RFC8032_PUBLIC
    assert signer.key_id == GOLDEN_KEY_ID


def test_golden_token(token: str) -> None:
    """Ed25519 is deterministic: a fixed key and ticket give one token. A change is a format change."""
    assert token == GOLDEN_TOKEN
    prefix, payload, signature = token.split(".")
    assert prefix == "mnt1"
    assert _unb64(payload).decode("ascii") == GOLDEN_PAYLOAD
    assert len(_unb64(signature)) == 64


# -- round trips --------------------------------------------------------------------------------


def test_sign_verify_round_trip(signer: TicketSigner, verifier: TicketVerifier, ticket: RouteTicket) -> None:
    token = signer.sign(ticket)
    assert len(token) < MAX_TICKET_BYTES
    got = verifier.verify(token, now=NOW + 1, session_id=SID, node_id="node-b", kind=ROUTE, route_id=RID)
    assert got == dataclasses.replace(ticket, tracker_key_id=signer.key_id)
    assert signer.sign(got) == token  # a verified ticket signs back to the same token


def test_pem_round_trip(signer: TicketSigner, token: str) -> None:
    again = TicketSigner.from_pem(signer.private_pem())
    assert again.key_id == signer.key_id
    assert TicketVerifier(again.public_pem()).verify(token, now=NOW).session_id == SID
    fresh = TicketSigner.generate()
    assert fresh.key_id != signer.key_id and len(fresh.key_id) == 16


def test_keys_that_are_not_ed25519_are_refused() -> None:
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ec_pem = ec_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(ValueError, match="Ed25519"):
        TicketSigner.from_pem(ec_pem)
    public_pem = ec_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with pytest.raises(ValueError, match="Ed25519"):
        TicketVerifier(public_pem)
    with pytest.raises(ValueError, match="at least one"):
        TicketVerifier()


def test_a_signer_refuses_a_ticket_naming_another_key(signer: TicketSigner, ticket: RouteTicket) -> None:
    other = _signer(OTHER_SEED)
    with pytest.raises(ValueError, match="this signer holds"):
        signer.sign(dataclasses.replace(ticket, tracker_key_id=other.key_id))


def test_hops_from_a_route_plan() -> None:
    hop = Hop("node-a", "http://10.0.0.1:7001", LayerRange(0, 8, 24))
    assert TicketHop.from_hop(hop) == HEAD
    assert (HEAD.start, HEAD.stop, TAIL.as_json()) == (0, 8, {"node_id": "node-c", "url": TAIL.url, "layers": "16:24"})


# -- refusals -----------------------------------------------------------------------------------


def test_a_missing_ticket(verifier: TicketVerifier) -> None:
    for missing in (None, ""):
        with pytest.raises(Unauthorized, match=TICKET_HEADER) as info:
            verifier.verify(missing, now=NOW)
        assert info.value.code == CODE_MISSING and info.value.param == TICKET_HEADER


def test_a_tampered_payload(verifier: TicketVerifier, token: str) -> None:
    prefix, _, signature = token.split(".")
    payload = _payload_json(token)
    payload["hops"][1]["url"] = "http://evil.example:7002"
    raw = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(Unauthorized, match="does not verify") as info:
        verifier.verify(f"{prefix}.{_b64(raw)}.{signature}", now=NOW)
    assert info.value.code == CODE_INVALID


def test_a_signature_from_another_key(signer: TicketSigner, verifier: TicketVerifier, ticket: RouteTicket) -> None:
    """Another key's signature over a payload naming the trusted key id."""
    payload = json.dumps(
        {**ticket.as_json(), "tracker_key_id": signer.key_id}, sort_keys=True, separators=(",", ":")
    ).encode()
    with pytest.raises(Unauthorized, match="does not verify under tracker key"):
        verifier.verify(_sign_raw(payload, OTHER_SEED), now=NOW)


def test_an_unknown_key_id(verifier: TicketVerifier, ticket: RouteTicket) -> None:
    other = _signer(OTHER_SEED)
    with pytest.raises(Unauthorized, match=f"tracker key {other.key_id}, which this node does not trust") as info:
        verifier.verify(other.sign(ticket), now=NOW)
    assert info.value.code == CODE_INVALID


def test_expiry_with_clock_skew(verifier: TicketVerifier, token: str) -> None:
    expires = NOW + TTL_S
    assert verifier.verify(token, now=expires + CLOCK_SKEW_S).session_id == SID
    with pytest.raises(Unauthorized, match="expired 42 s ago; ask the tracker for a fresh route") as info:
        verifier.verify(token, now=expires + 42)
    assert info.value.code == CODE_EXPIRED
    assert verifier.verify(token, now=NOW - CLOCK_SKEW_S).session_id == SID
    with pytest.raises(Unauthorized, match=r"61 s in the future.*clocks") as info:
        verifier.verify(token, now=NOW - 61)
    assert info.value.code == CODE_EXPIRED


def test_a_ticket_for_another_request(verifier: TicketVerifier, token: str) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"session_id": "ses-other"}, "for session ses-0123, not session ses-other"),
        ({"route_id": "rte-other"}, "pinned to route rte-other"),
        ({"node_id": "node-x"}, "node node-x is not on this route"),
        ({"kind": REPAIR}, "this is a route ticket; to reroute or replay a node needs a repair ticket"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(Unauthorized, match=needle) as info:
            verifier.verify(token, now=NOW, **kwargs)
        assert info.value.code == CODE_MISMATCH


@pytest.mark.parametrize(
    ("token", "needle"),
    [
        ("garbage", "not a route ticket"),
        ("mnt2.AAAA.AAAA", "ticket format 'mnt2'"),
        ("mnt1.AAAA", "3 dot-separated parts"),
        ("mnt1.AA.AA.AA", "3 dot-separated parts"),
        ("mnt1.AA=A.AAAA", "payload is not base64url"),
        ("mnt1.AAAAA.AAAA", "payload is not base64url"),
        ("mnt1.AB.AAAA", "not canonical base64url"),
        ("mnt1.e30.AAAA", "signature is 64 bytes, got 3"),
        ("mnt1.bm9wZQ." + "A" * 86, "not ASCII JSON"),
        ("mnt1.W10." + "A" * 86, "must be a JSON object"),
        ("mnt1.e30." + "A" * 86, "tracker_key_id must be 16 lowercase hex digits"),
        ("mnt1.é.AAAA", "ASCII only"),
        ("mnt1." + "A" * MAX_TICKET_BYTES + ".AAAA", "over the 16384-byte limit"),
    ],
)
def test_a_malformed_token_says_what_is_wrong(verifier: TicketVerifier, token: str, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle) as info:
        verifier.verify(token, now=NOW)
    assert info.value.code == CODE_MALFORMED and info.value.param == TICKET_HEADER


def test_a_token_that_is_not_a_string(verifier: TicketVerifier) -> None:
    with pytest.raises(InvalidRequest, match="string, not bytes"):
        verifier.verify(b"mnt1.AA.AA", now=NOW)  # type: ignore[arg-type]


def test_a_non_canonical_signature_encoding_is_refused(verifier: TicketVerifier, token: str) -> None:
    """The last base64url character of a 64-byte signature carries 4 spare bits: set one of them."""
    alphabet = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"
    last = alphabet.index(token[-1])
    assert last & 0b1111 == 0
    with pytest.raises(InvalidRequest, match="not canonical"):
        verifier.verify(token[:-1] + alphabet[last | 1], now=NOW)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"kind": "admin"}, "kind is 'route' or 'repair'"),
        ({"kind": 1}, "kind must be a string"),
        ({"hops": "node-a"}, "hops must be a list"),
        ({"hops": [["node-a"]]}, "every hop must be a JSON object"),
        ({"hops": []}, "at least one hop"),
        ({"hops": [{"node_id": "n", "url": "http://a:1"}]}, "needs the fields layers"),
        ({"hops": [{"node_id": "n", "url": "http://a:1", "layers": "0:1", "x": 1}]}, "has no fields x"),
        ({"hops": [{"node_id": "n", "url": "http://a:1/", "layers": "0:1"}]}, "no trailing"),
        ({"hops": [{"node_id": "n", "url": "http://a:1", "layers": "1:1"}]}, "0 <= START < STOP"),
        ({"issued_at": "yesterday"}, "issued_at must be a number"),
        ({"issued_at": True}, "issued_at must be a number"),
        ({"expires_at": 10**400}, "expires_at is out of range"),
        ({"expires_at": 1e308 * 10}, "Infinity is not a number a ticket holds"),
        ({"issued_at": -1.0}, "finite unix times"),
        ({"expires_at": 1.0}, "expires after it is issued"),
        ({"repair_from": 0}, "a route ticket has no repair_from"),
        ({"repair_from": "0"}, "repair_from must be an integer or null"),
        ({"session_id": "ses 1"}, "session id must be"),
        ({"route_id": None}, "route_id must be a string"),
        ({"model_digest": ""}, "model digest must be 1-256"),
        ({"extra": 1}, "has no fields extra"),
    ],
)
def test_a_signed_payload_with_bad_fields(
    signer: TicketSigner, verifier: TicketVerifier, ticket: RouteTicket, change: dict[str, Any], needle: str
) -> None:
    """Even a payload the trusted key signed is read field by field: a tracker bug is a clear 400."""
    payload = {**ticket.as_json(), "tracker_key_id": signer.key_id, **change}
    raw = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()  # 1e309 -> Infinity
    with pytest.raises(InvalidRequest, match=needle):
        verifier.verify(_sign_raw(raw), now=NOW)


def test_a_signed_payload_without_fields(signer: TicketSigner, verifier: TicketVerifier) -> None:
    raw = json.dumps({"tracker_key_id": signer.key_id}).encode()
    with pytest.raises(InvalidRequest, match="needs the fields epoch, expires_at, hops, issued_at, kind"):
        verifier.verify(_sign_raw(raw), now=NOW)


# -- the route ----------------------------------------------------------------------------------


def test_next_hops_at_head_middle_and_tail(ticket: RouteTicket) -> None:
    assert [ticket.index_of(h.node_id) for h in (HEAD, MIDDLE, TAIL)] == [0, 1, 2]
    assert ticket.next_hop_after("node-a") == MIDDLE
    assert ticket.next_hop_after("node-b") == TAIL
    assert ticket.next_hop_after("node-c") is None
    assert ticket.onward_urls("node-a") == ("http://10.0.0.2:7002", "http://10.0.0.3:7003")
    assert ticket.onward_urls("node-b") == ("http://10.0.0.3:7003",)
    assert ticket.onward_urls("node-c") == ()
    for call in (ticket.index_of, ticket.next_hop_after, ticket.onward_urls):
        with pytest.raises(Unauthorized, match="node node-x is not on this route"):
            call("node-x")


@pytest.mark.parametrize(
    ("hops", "needle"),
    [
        ((HEAD, SPARE, MIDDLE), "node-b starts at layer 8, but the hop before it stops at 16"),
        ((MIDDLE, TAIL), "must start at layer 0"),
        ((HEAD, dataclasses.replace(MIDDLE, node_id="node-a")), "appears twice"),
    ],
)
def test_a_route_is_contiguous_and_distinct(hops: tuple[TicketHop, ...], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        route_ticket(SID, RID, "sha256:abcd", hops, ttl_s=TTL_S, now=NOW)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (("", "http://a:1", "0:1"), "node id must be 1-128"),
        (("n", "ftp://a:1", "0:1"), "http\\(s\\)://HOST:PORT"),
        (("n", "http://a:1,http://b:2", "0:1"), "http\\(s\\)://HOST:PORT"),
        (("n", "http://0.0.0.0:1", "0:1"), "http\\(s\\)://HOST:PORT"),
        (("n", "http://a:1", "01:2"), "START:STOP"),
        (("n", "http://a:1", ":2"), "START:STOP"),
    ],
)
def test_a_hop_is_validated(fields: tuple[str, str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TicketHop(*fields)


def test_route_ticket_arguments_are_validated(ticket: RouteTicket) -> None:
    with pytest.raises(ValueError, match="positive number of seconds"):
        route_ticket(SID, RID, "sha256:abcd", (HEAD, MIDDLE, TAIL), ttl_s=0, now=NOW)
    with pytest.raises(ValueError, match="lowercase hex"):
        dataclasses.replace(ticket, tracker_key_id="NOT-A-KEY-ID")
    with pytest.raises(ValueError, match="repair_from indexes its 3 hops"):
        dataclasses.replace(ticket, kind=REPAIR)


# -- repair tickets -----------------------------------------------------------------------------


def test_a_repair_ticket(signer: TicketSigner, verifier: TicketVerifier, token: str) -> None:
    old = verifier.verify(token, now=NOW)
    repair = repair_ticket(old, (HEAD, SPARE, TAIL), repair_from=1, ttl_s=60, now=NOW + 100)
    assert (repair.kind, repair.session_id, repair.route_id, repair.model_digest) == (REPAIR, SID, RID, "sha256:abcd")
    assert (repair.repair_from, repair.issued_at, repair.expires_at, repair.tracker_key_id) == (
        1,
        NOW + 100,
        NOW + 160,
        "",
    )
    repair_token = signer.sign(repair)
    got = verifier.verify(repair_token, now=NOW + 101, session_id=SID, route_id=RID, node_id="node-a", kind=REPAIR)
    assert got.onward_urls("node-a") == (SPARE.url, TAIL.url)
    assert got.next_hop_after("node-d") == TAIL
    with pytest.raises(Unauthorized, match="this is a repair ticket; to open a session and forward"):
        verifier.verify(repair_token, now=NOW + 101, kind=ROUTE)
    with pytest.raises(Unauthorized, match="node node-b is not on this route"):
        verifier.verify(repair_token, now=NOW + 101, node_id="node-b")
    twice = repair_ticket(got, (HEAD, MIDDLE, TAIL), repair_from=1, ttl_s=60, now=NOW + 200)
    assert verifier.verify(signer.sign(twice), now=NOW + 200, kind=REPAIR).hops == (HEAD, MIDDLE, TAIL)


def test_a_repair_keeps_the_hops_before_it(ticket: RouteTicket) -> None:
    with pytest.raises(ValueError, match="keeps the hops before it"):
        repair_ticket(ticket, (dataclasses.replace(HEAD, node_id="node-z"), MIDDLE, TAIL), repair_from=1, ttl_s=60)
    with pytest.raises(ValueError, match="must index the new route's 3 hops"):
        repair_ticket(ticket, (HEAD, MIDDLE, TAIL), repair_from=3, ttl_s=60)
    with pytest.raises(ValueError, match="positive number of seconds"):
        repair_ticket(ticket, (HEAD, SPARE, TAIL), repair_from=1, ttl_s=float("nan"))
    head_replaced = repair_ticket(
        ticket, (dataclasses.replace(HEAD, node_id="node-z"), MIDDLE, TAIL), repair_from=0, ttl_s=60
    )
    assert head_replaced.repair_from == 0 and head_replaced.hops[0].node_id == "node-z"


# -- key rotation -------------------------------------------------------------------------------


def test_key_rotation(signer: TicketSigner, ticket: RouteTicket) -> None:
    new = _signer(OTHER_SEED)
    both = TicketVerifier(signer.public_pem(), new.public_pem())
    assert both.key_ids == (signer.key_id, new.key_id)
    for s in (signer, new):
        assert both.verify(s.sign(ticket), now=NOW).tracker_key_id == s.key_id
    retired = TicketVerifier(new.public_pem())
    with pytest.raises(Unauthorized, match="does not trust"):
        retired.verify(signer.sign(ticket), now=NOW)


# -- fuzz ---------------------------------------------------------------------------------------

FUZZ_ALPHABET = string.ascii_letters + string.digits + '-_.=+/ é\x00{}[]":,'


def _mutate(rng: random.Random, token: str) -> str:
    i = rng.randrange(len(token))
    op = rng.randrange(6)
    if op == 0:  # replace one character
        return token[:i] + rng.choice(FUZZ_ALPHABET) + token[i + 1 :]
    if op == 1:  # delete a run
        return token[:i] + token[i + rng.randint(1, 8) :]
    if op == 2:  # insert
        return token[:i] + "".join(rng.choices(FUZZ_ALPHABET, k=rng.randint(1, 4))) + token[i:]
    if op == 3:  # truncate
        return token[:i]
    if op == 4:  # flip one bit of the decoded payload or signature, re-encoded
        _, payload, signature = token.split(".")
        part = rng.choice((payload, signature))
        data = bytearray(_unb64(part))
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return token.replace(part, _b64(bytes(data)))
    parts = token.split(".")  # swap or duplicate parts
    rng.shuffle(parts)
    return ".".join(parts + parts[: rng.randint(0, 1)])


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    choices: list[Any] = [
        None,
        True,
        rng.randint(-(10**30), 10**30),
        rng.uniform(-1e300, 1e300),
        "".join(rng.choices(FUZZ_ALPHABET, k=rng.randint(0, 12))),
    ]
    if depth < 3:
        choices += [
            [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            {rng.choice(["kind", "hops", "url", "layers", "node_id", "x"]): _random_json(rng, depth + 1)},
        ]
    return rng.choice(choices)


def _expect_no_crash(verifier: TicketVerifier, token: str) -> None:
    """A token the trusted key signed may hold any payload: a ticket or a Meshnet error, nothing else."""
    try:
        verifier.verify(token, now=NOW)
    except MeshnetError as exc:
        assert isinstance(exc, Unauthorized | InvalidRequest), repr(exc)


def _expect_refusal(verifier: TicketVerifier, token: str) -> None:
    try:
        verifier.verify(token, now=NOW, session_id=SID, node_id="node-b", kind=ROUTE)
    except MeshnetError as exc:
        assert isinstance(exc, Unauthorized | InvalidRequest), repr(exc)
        assert exc.message
    else:
        raise AssertionError(f"a mutated token was accepted: {token!r}")


def test_fuzz_only_meshnet_errors_and_no_mutant_accepted(
    signer: TicketSigner, verifier: TicketVerifier, ticket: RouteTicket, token: str
) -> None:
    rng = random.Random(20240611)
    for _ in range(400):
        mutant = _mutate(rng, token)
        if mutant != token:
            _expect_refusal(verifier, mutant)
    for _ in range(150):
        _expect_refusal(verifier, "".join(rng.choices(FUZZ_ALPHABET, k=rng.randint(0, 200))))
        _expect_refusal(verifier, f"mnt1.{_b64(rng.randbytes(rng.randint(0, 300)))}.{_b64(rng.randbytes(64))}")
    good = {**ticket.as_json(), "tracker_key_id": signer.key_id}
    for _ in range(250):  # payloads the trusted key signed, one field (or the whole payload) replaced
        field = rng.choice([*good, "whole"])
        payload = _random_json(rng) if field == "whole" else {**good, field: _random_json(rng)}
        raw = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        _expect_no_crash(verifier, _sign_raw(raw))
    deep = ("[" * 5000 + "]" * 5000).encode()
    _expect_refusal(verifier, _sign_raw(deep))
    _expect_refusal(
        verifier, _sign_raw(b'{"tracker_key_id":"' + signer.key_id.encode() + b'","kind":' + b"9" * 5000 + b"}")
    )
