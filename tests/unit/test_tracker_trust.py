"""Trust tiers on a private swarm's tracker: a node's tier comes from its certificate, and a
session asked with ``trusted_only`` is routed and repaired over trusted nodes only.

The tracker is the real app with its real ``RequireMember`` in front; each test client stands for
one member's TLS connection by putting that member's CA-issued certificate where the TLS transport
puts it (the ASGI ``tls`` extension, ``security.transport``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from meshnet.protocol.messages import HopEntry, TokenAnswer
from meshnet.protocol.signing import HopKey, claim_of
from meshnet.security.identity import MemberRequest, SwarmCA, make_csr, new_member_key
from meshnet.security.membership import SwarmAuthority
from meshnet.security.transport import TLS_EXTENSION, ASGIApp
from meshnet.tracker.app import create_tracker_app
from meshnet.tracker.db import TrackerDB
from meshnet.tracker.plausibility import MEASURED_STEPS

MODEL = "m"


def _as_member(app: ASGIApp, cert_pem: bytes) -> ASGIApp:
    """``app`` as reached over a TLS connection whose client presented ``cert_pem``."""

    async def connection(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            extensions = {**(scope.get("extensions") or {}), TLS_EXTENSION: {"client_cert_chain": [cert_pem.decode()]}}
            scope = {**scope, "extensions": extensions}
        await app(scope, receive, send)

    return connection


def _sans(member_id: str, role: str) -> tuple[str, ...]:
    """A node's certificate lists the host it registers (``https://ID.local:7000``)."""
    return (f"{member_id}.local",) if role == "node" else ()


class PrivateTracker:
    def __init__(self, directory: Path, db: TrackerDB) -> None:
        self.ca = SwarmCA.init(directory / "swarm", name="lab")
        self.app = create_tracker_app(db, swarm=SwarmAuthority.load(directory / "swarm"))

    def member(self, member_id: str, role: str = "node", *, trusted: bool = False) -> TestClient:
        csr = make_csr(new_member_key(), member_id)
        cert = self.ca.issue(MemberRequest(csr, role=role, trusted=trusted, sans=_sans(member_id, role)))
        return TestClient(_as_member(self.app, cert))


@pytest.fixture
def tracker(tmp_path: Path) -> Iterator[PrivateTracker]:
    db = TrackerDB(f"sqlite:///{tmp_path}/tracker.db")
    try:
        yield PrivateTracker(tmp_path, db)
    finally:
        db.close()


NODE_KEYS: dict[str, HopKey] = {}


def node_key(node_id: str) -> HopKey:
    """The hop key a node of these tests registers with and signs its receipts with."""
    return NODE_KEYS.setdefault(node_id, HopKey.generate())


def receipt(node_id: str, layers: str, session_id: str, held: int) -> dict[str, Any]:
    """A lone node's receipt for ``held`` positions of a session (it is head and tail: tracker.receipts)."""
    entry = HopEntry(node_id, layers, 1.0, held, "00" * 16, None, held)
    answer = TokenAnswer((entry,), position=held, token=1, logprob=-0.1)
    return {"entry": node_key(node_id).sign(session_id, entry, answer).to_json(), "answer": claim_of(answer)}


def register(tracker: PrivateTracker, node_id: str, layers: str, *, trusted: bool, tps: float = 100.0) -> None:
    body = {"node_id": node_id, "url": f"https://{node_id}.local:7000", "model": MODEL, "layers": layers,
            "total_layers": 30, "backend": "fake", "kv_bytes_free": 1 << 30, "prefill_tps": tps * 10,
            "decode_tps": tps, "numerics": "fake 1; threads 1", "hop_key": node_key(node_id).public,
            "trusted": not trusted}  # a claim in the body: ignored, the certificate decides  # fmt: skip
    answer = tracker.member(node_id, trusted=trusted).post("/v1/nodes", json=body)
    assert answer.status_code in (200, 201), answer.text


def tiers(tracker: PrivateTracker) -> dict[str, bool]:
    nodes = tracker.member("ops", "gateway").get("/v1/nodes").json()["nodes"]
    return {n["node_id"]: n["trusted"] for n in nodes}


def route(session: dict[str, Any]) -> list[str]:
    return [h["node_id"] for h in session["hops"]]


def test_a_nodes_tier_is_its_certificates_not_what_it_claims(tracker: PrivateTracker) -> None:
    register(tracker, "honest", "0:30", trusted=True)
    register(tracker, "stranger", "0:30", trusted=False)
    assert tiers(tracker) == {"honest": True, "stranger": False}


def measure(tracker: PrivateTracker, node_id: str, layers: str, *, steps: int = MEASURED_STEPS) -> None:
    """End ``node_id``'s probation: it alone makes a route, and a gateway bills ``steps`` decode steps
    of it as fast as it claims (a plausible report: tracker.plausibility)."""
    gateway = tracker.member("gw", "gateway")
    session = gateway.post("/v1/sessions", json={"model": MODEL, "total_layers": 30}).json()
    assert route(session) == [node_id], session
    work = {"node_id": node_id, "layers": layers, "prefill_tokens": 8, "decode_tokens": steps}
    signed = receipt(node_id, layers, session["session_id"], 8 + steps)
    report = {"session_id": session["session_id"], "route_id": session["route_id"], "records": [work],
              "decode_s": steps * 0.001, "receipts": [signed]}  # fmt: skip
    answer = gateway.post("/v1/billing", json=report)
    assert answer.status_code == 201 and answer.json()["speed_check"]["plausible"], answer.text


def test_a_trusted_only_session_is_routed_over_trusted_nodes_even_when_others_are_faster(
    tracker: PrivateTracker,
) -> None:
    register(tracker, "fast", "0:30", trusted=False, tps=5000.0)
    measure(tracker, "fast", "0:30")  # measured: its claim counts (an unmeasured one buys nothing)
    for node_id, layers, trusted, tps in [("t-head", "0:15", True, 50.0), ("t-tail", "15:30", True, 50.0),
                                          ("fast", "0:30", False, 5000.0)]:  # fmt: skip
        register(tracker, node_id, layers, trusted=trusted, tps=tps)
    gateway = tracker.member("gw", "gateway")
    anyone = gateway.post("/v1/sessions", json={"model": MODEL, "total_layers": 30})
    assert anyone.status_code == 201 and route(anyone.json()) == ["fast"] and anyone.json()["trusted_only"] is False
    trusted = gateway.post("/v1/sessions", json={"model": MODEL, "total_layers": 30, "trusted_only": True})
    assert trusted.status_code == 201, trusted.text
    assert route(trusted.json()) == ["t-head", "t-tail"] and trusted.json()["trusted_only"] is True
    assert all("fast" not in route(alt) for alt in [{"hops": h} for h in trusted.json()["alternatives"]])
    kept = gateway.get(f"/v1/sessions/{trusted.json()['session_id']}").json()
    assert kept["trusted_only"] is True  # persisted with the session: its repairs honour it


def test_too_few_trusted_nodes_is_a_503_naming_the_reason(tracker: PrivateTracker) -> None:
    register(tracker, "t-head", "0:15", trusted=True)
    register(tracker, "u-tail", "15:30", trusted=False)
    answer = tracker.member("gw", "gateway").post(
        "/v1/sessions", json={"model": MODEL, "total_layers": 30, "trusted_only": True}
    )
    assert answer.status_code == 503 and "Retry-After" in answer.headers
    error = answer.json()["error"]
    assert error["code"] == "no_trusted_route"
    assert "no node serves layers 15:30" in error["message"]
    assert "trusted nodes only (trusted_only): 1 of the 2 live nodes serving 'm' are trusted" in error["message"]
    assert "meshnet swarm invite --trusted" in error["message"]


def test_the_repair_of_a_trusted_only_session_takes_a_trusted_replacement(tracker: PrivateTracker) -> None:
    for node_id, layers, trusted, tps in [("head", "0:10", True, 100.0), ("mid", "10:20", True, 100.0),
                                          ("tail", "20:30", True, 100.0), ("spare", "10:20", True, 10.0),
                                          ("fast-spare", "10:20", False, 9000.0)]:  # fmt: skip
        register(tracker, node_id, layers, trusted=trusted, tps=tps)
    gateway = tracker.member("gw", "gateway")
    session = gateway.post("/v1/sessions", json={"model": MODEL, "total_layers": 30, "trusted_only": True}).json()
    assert route(session) == ["head", "mid", "tail"]
    sid = session["session_id"]
    fixed = gateway.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "mid", "position": 20})
    assert fixed.status_code == 200, fixed.text
    assert route(fixed.json()) == ["head", "spare", "tail"]  # not the faster untrusted one
    # the spare fails too: only the untrusted node is left for 10:20, and the repair says why it is refused
    refused = gateway.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "spare", "position": 20})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_trusted_route", refused.text
    assert "trusted nodes only" in refused.json()["error"]["message"]
    # while a session without the flag is routed over that live untrusted node
    plain = gateway.post("/v1/sessions", json={"model": MODEL, "total_layers": 30})
    assert plain.status_code == 201 and route(plain.json()) == ["head", "fast-spare", "tail"], plain.text


def test_an_open_swarm_has_no_trusted_nodes(tmp_path: Path) -> None:
    db = TrackerDB(f"sqlite:///{tmp_path}/open.db")
    try:
        with TestClient(create_tracker_app(db)) as client:
            body = {"node_id": "a", "url": "http://a.local:7000", "model": MODEL, "layers": "0:30", "total_layers": 30,
                    "trusted": True}  # fmt: skip
            assert client.post("/v1/nodes", json=body).status_code == 201
            assert client.get("/v1/nodes").json()["nodes"][0]["trusted"] is False
            answer = client.post("/v1/sessions", json={"model": MODEL, "trusted_only": True})
            assert answer.status_code == 503 and "0 of the 1 live nodes" in answer.json()["error"]["message"]
            assert client.post("/v1/sessions", json={"model": MODEL, "trusted_only": "yes"}).status_code == 400
    finally:
        db.close()


def test_a_member_past_its_open_sessions_on_the_tracker_gets_a_429(tmp_path: Path) -> None:
    """``meshnet tracker --max-sessions-per-client``: one gateway cannot pin every node's sessions."""
    db = TrackerDB(f"sqlite:///{tmp_path}/tracker.db")
    try:
        private = PrivateTracker(tmp_path, db)
        private.app = create_tracker_app(db, swarm=SwarmAuthority.load(tmp_path / "swarm"), max_sessions_per_client=2)
        register(private, "whole", "0:30", trusted=True)
        greedy, other = private.member("greedy", "gateway"), private.member("other", "gateway")
        body = {"model": MODEL, "total_layers": 30}
        opened = [greedy.post("/v1/sessions", json=body) for _ in range(2)]
        assert all(a.status_code == 201 for a in opened)
        refused = greedy.post("/v1/sessions", json=body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "member 'greedy' holds 2 open sessions" in refused.json()["error"]["message"]
        assert refused.headers["Retry-After"] == "5"
        assert other.post("/v1/sessions", json=body).status_code == 201  # the others are served
        assert greedy.delete(f"/v1/sessions/{opened[0].json()['session_id']}").status_code == 200
        assert greedy.post("/v1/sessions", json=body).status_code == 201  # one closed: room again
    finally:
        db.close()
