"""KV snapshot standbys on a private swarm's tracker (``POST /v1/sessions/{id}/standbys``) and the
repair that takes the gateway's standby (``prefer``).

A standby gets a copy of one hop's KV, so it must be trusted (its certificate's tier), hold exactly
that hop's layers and compute them bit-identically; the repair ticket it carries must be the one a
real repair putting it in place of that hop would sign. The tracker is the real app behind its real
``RequireMember``; each client stands for one member's TLS connection (as in test_tracker_trust).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from meshnet.protocol.signing import HopKey
from meshnet.protocol.tickets import REPAIR, TicketVerifier
from meshnet.security.identity import MemberRequest, SwarmCA, make_csr, new_member_key
from meshnet.security.membership import SwarmAuthority
from meshnet.tracker.app import create_tracker_app
from meshnet.tracker.db import TrackerDB
from tests.unit.test_tracker_trust import _as_member, _sans

MODEL = "m"
NUMERICS = "fake 1; threads 1"


class Swarm:
    """A private swarm's tracker, its ticket key, and member clients by id (each a certificate)."""

    def __init__(self, directory: Path, db: TrackerDB) -> None:
        self.ca = SwarmCA.init(directory / "swarm", name="lab")
        authority = SwarmAuthority.load(directory / "swarm")
        self.verifier = TicketVerifier(authority.signer.public_pem())
        self.app = create_tracker_app(db, swarm=authority)
        self._clients: dict[str, TestClient] = {}

    def member(self, member_id: str, role: str = "node", *, trusted: bool = False) -> TestClient:
        if member_id not in self._clients:
            csr = make_csr(new_member_key(), member_id)
            cert = self.ca.issue(MemberRequest(csr, role=role, trusted=trusted, sans=_sans(member_id, role)))
            self._clients[member_id] = TestClient(_as_member(self.app, cert))
        return self._clients[member_id]

    def register(self, node_id: str, layers: str, *, trusted: bool = True, **fields: Any) -> None:
        body = {"node_id": node_id, "url": f"https://{node_id}.local:7000", "model": MODEL, "layers": layers,
                "total_layers": 30, "backend": "fake", "kv_bytes_free": 1 << 30, "prefill_tps": 1000.0,
                "decode_tps": 100.0, "numerics": NUMERICS, "hop_key": HopKey.generate().public, **fields}  # fmt: skip
        answer = self.member(node_id, trusted=trusted).post("/v1/nodes", json=body)
        assert answer.status_code in (200, 201), answer.text

    def live(self) -> set[str]:
        return {n["node_id"] for n in self.member("ops", "gateway").get("/v1/nodes").json()["nodes"]}


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    db = TrackerDB(f"sqlite:///{tmp_path}/tracker.db")
    try:
        yield Swarm(tmp_path, db)
    finally:
        db.close()


def route(answer: dict[str, Any]) -> list[str]:
    return [h["node_id"] for h in answer["hops"]]


def open_on(client: TestClient, nodes: list[str], exclude: list[str], **fields: Any) -> dict[str, Any]:
    """A session pinned to ``nodes`` (head first): every other node is excluded."""
    answer = client.post("/v1/sessions", json={"model": MODEL, "total_layers": 30, "exclude": exclude, **fields})
    assert answer.status_code == 201, answer.text
    assert route(answer.json()) == nodes
    return dict(answer.json())


def the_route(swarm: Swarm) -> None:
    for node_id, layers in (("head", "0:10"), ("mid", "10:20"), ("tail", "20:30")):
        swarm.register(node_id, layers)


def test_each_hop_gets_the_trusted_bit_identical_same_layer_standby_with_the_most_free_kv(swarm: Swarm) -> None:
    the_route(swarm)
    candidates = [
        ("h-small", "0:10", {"kv_bytes_free": 1 << 20}),
        ("h-big", "0:10", {"kv_bytes_free": 1 << 31}),  # the most free KV among the qualifying: hop 0's
        ("h-untrusted", "0:10", {"kv_bytes_free": 1 << 40, "trusted": False}),
        ("m-other-bits", "10:20", {"kv_bytes_free": 1 << 40, "numerics": "fake 1; threads 2"}),
        ("m-bf16", "10:20", {"kv_bytes_free": 1 << 40, "wire_dtype": "bfloat16"}),  # would round the seam
        ("m-wide", "10:30", {"kv_bytes_free": 1 << 40}),  # other layers: holds no one hop's KV
        ("m-b", "10:20", {}),
        ("m-a", "10:20", {}),  # as much free KV as m-b: the node id decides
        ("t-one", "20:30", {"wire_dtype": "bfloat16"}),  # a tail sends nothing: its dtype does not matter
    ]
    for node_id, layers, fields in candidates:
        swarm.register(node_id, layers, **fields)
    gateway = swarm.member("gw", "gateway")
    session = open_on(gateway, ["head", "mid", "tail"], exclude=[c[0] for c in candidates])
    sid = session["session_id"]
    answer = gateway.post(f"/v1/sessions/{sid}/standbys", json={})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["why_not"] is None
    standbys = body["standbys"]
    assert [(s["index"], s["node_id"], s["layers"], s["url"]) for s in standbys] == [
        (0, "h-big", "0:10", "https://h-big.local:7000"),
        (1, "m-a", "10:20", "https://m-a.local:7000"),
        (2, "t-one", "20:30", "https://t-one.local:7000"),
    ]
    assert len({s["node_id"] for s in standbys}) == len(standbys)  # one hop each
    for s in standbys:  # the repair ticket of "hop i fails and this standby replaces it"
        ticket = swarm.verifier.verify(
            s["ticket"], session_id=sid, route_id=session["route_id"], node_id=s["node_id"], kind=REPAIR
        )
        expected = route(session)
        expected[s["index"]] = s["node_id"]
        assert ticket.repair_from == s["index"] and [h.node_id for h in ticket.hops] == expected
        assert ticket.hops[s["index"]].url == s["url"] and ticket.hops[s["index"]].layers == s["layers"]
    # nothing changed: the session keeps its route, the standbys are only advice
    assert route(gateway.get(f"/v1/sessions/{sid}").json()) == ["head", "mid", "tail"]


def test_a_hop_without_a_candidate_is_absent_and_why_not_says_why(swarm: Swarm) -> None:
    the_route(swarm)
    swarm.register("h-wide", "0:20")  # trusted, bit-identical, but not exactly the head's layers
    swarm.register("m-stranger", "10:20", trusted=False)
    swarm.register("t-other-bits", "20:30", numerics="other 2")
    gateway = swarm.member("gw", "gateway")
    session = open_on(gateway, ["head", "mid", "tail"], exclude=["h-wide", "m-stranger", "t-other-bits"])
    url = f"/v1/sessions/{session['session_id']}/standbys"
    answer = gateway.post(url, json={})
    assert answer.status_code == 200 and answer.json()["standbys"] == [], answer.text
    why = answer.json()["why_not"]
    assert "no other live node serves exactly layers 0:10 (hop head)" in why
    assert "none of the 1 other live nodes serving layers 10:20 (hop mid) is trusted" in why
    assert "none of the 1 other trusted nodes serving layers 20:30 (hop tail) computes them bit-identically" in why
    swarm.register("m-trusted", "10:20")
    answer = gateway.post(url, json={})
    assert [(s["index"], s["node_id"]) for s in answer.json()["standbys"]] == [(1, "m-trusted")]
    assert "10:20" not in answer.json()["why_not"] and "0:10" in answer.json()["why_not"]


def test_standbys_are_the_owners_to_ask_for_while_the_session_is_open(swarm: Swarm) -> None:
    the_route(swarm)
    swarm.register("spare", "10:20")
    owner, other = swarm.member("gw", "gateway"), swarm.member("gw-2", "gateway")
    session = open_on(owner, ["head", "mid", "tail"], exclude=["spare"])
    sid = session["session_id"]
    url = f"/v1/sessions/{sid}/standbys"
    for body in (None, {}, {"unknown": 1}):  # empty or any object: nothing to say yet
        answer = owner.post(url) if body is None else owner.post(url, json=body)
        assert answer.status_code == 200 and answer.json()["standbys"][0]["node_id"] == "spare", answer.text
    for bad in ([], "x"):
        assert owner.post(url, json=bad).status_code == 400
    assert owner.post(url, content=b"{").status_code == 400
    refused = other.post(url, json={})
    as_repair = other.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "mid"})
    assert refused.status_code == as_repair.status_code == 403
    assert refused.json()["error"]["code"] == as_repair.json()["error"]["code"] == "forbidden"
    assert refused.json()["error"]["param"] == as_repair.json()["error"]["param"] == "session_id"
    assert "opened by 'gw'" in refused.json()["error"]["message"]
    assert "mid" in swarm.live()  # the refused repair recorded nothing
    assert owner.post("/v1/sessions/ses-none/standbys", json={}).status_code == 404
    assert owner.delete(f"/v1/sessions/{sid}").status_code == 200
    closed = owner.post(url, json={})
    assert closed.status_code == 409 and "closed" in closed.json()["error"]["message"]


def test_an_open_swarm_has_no_standbys(tmp_path: Path) -> None:
    db = TrackerDB(f"sqlite:///{tmp_path}/open.db")
    try:
        with TestClient(create_tracker_app(db)) as client:
            for node_id, layers in (("a", "0:10"), ("b", "10:20"), ("c", "20:30"), ("b2", "10:20")):
                body = {"node_id": node_id, "url": f"http://{node_id}.local:7000", "model": MODEL, "layers": layers,
                        "total_layers": 30, "backend": "fake", "kv_bytes_free": 1, "numerics": NUMERICS}  # fmt: skip
                assert client.post("/v1/nodes", json=body).status_code == 201
            session = open_on(client, ["a", "b", "c"], exclude=["b2"])
            answer = client.post(f"/v1/sessions/{session['session_id']}/standbys", json={})
            assert answer.status_code == 409
            error = answer.json()["error"]
            assert error["code"] == "no_trusted_nodes"
            assert "KV snapshots go only to trusted nodes, and only a private swarm has them" in error["message"]
            assert "meshnet swarm init" in error["message"] and "--trusted" in error["message"]
            # ``prefer`` works in an open swarm too: it only picks among valid repairs
            repair = {"failed_node": "b", "prefer": "b2"}
            fixed = client.post(f"/v1/sessions/{session['session_id']}/repair", json=repair)
            assert fixed.status_code == 200 and fixed.json()["preferred"] is True and "ticket" not in fixed.json()
    finally:
        db.close()


def test_a_repair_takes_the_preferred_standby_in_place_of_exactly_the_failed_hop(swarm: Swarm) -> None:
    the_route(swarm)
    swarm.register("fast", "10:20", decode_tps=9000.0, prefill_tps=90000.0)  # the search's own pick
    swarm.register("standby", "10:20", decode_tps=10.0, kv_bytes_free=1 << 33)
    gateway = swarm.member("gw", "gateway")
    session = open_on(gateway, ["head", "mid", "tail"], exclude=["fast", "standby"])
    sid = session["session_id"]
    chosen = gateway.post(f"/v1/sessions/{sid}/standbys", json={}).json()["standbys"]
    assert [(s["index"], s["node_id"]) for s in chosen] == [(1, "standby")]
    fixed = gateway.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "mid", "position": 40, "prefer": "standby"})
    assert fixed.status_code == 200, fixed.text
    body = fixed.json()
    assert body["preferred"] is True and route(body) == ["head", "standby", "tail"]
    assert body["replaced"] == {"first": 1, "count": 1, "removed": 1}
    ticket = swarm.verifier.verify(body["ticket"], session_id=sid, route_id=session["route_id"], kind=REPAIR)
    assert ticket.repair_from == 1 and [h.node_id for h in ticket.hops] == ["head", "standby", "tail"]
    assert route(gateway.get(f"/v1/sessions/{sid}").json()) == ["head", "standby", "tail"]
    assert "mid" not in swarm.live()  # recorded and suspended as any repair's failed node


@pytest.mark.parametrize(
    "prefer",
    ["gone", "head", "mid", "wide", "odd-bits", "stranger", "other-model"],
    ids=["not-live", "on-the-route", "the-failed-node", "other-layers", "other-numerics", "untrusted", "other-model"],
)
def test_a_stale_or_ineligible_preference_falls_back_to_the_search(swarm: Swarm, prefer: str) -> None:
    the_route(swarm)
    swarm.register("spare", "10:20")
    swarm.register("wide", "10:30")
    swarm.register("odd-bits", "10:20", numerics="fake 1; threads 8")
    swarm.register("stranger", "10:20", trusted=False)  # ineligible: the session takes trusted nodes only
    swarm.register("other-model", "10:20", model="m2")
    gateway = swarm.member("gw", "gateway")
    exclude = ["spare", "wide", "odd-bits", "stranger"]
    session = open_on(gateway, ["head", "mid", "tail"], exclude=exclude, trusted_only=True)
    fixed = gateway.post(f"/v1/sessions/{session['session_id']}/repair", json={"failed_node": "mid", "prefer": prefer})
    assert fixed.status_code == 200, fixed.text
    assert fixed.json()["preferred"] is False and route(fixed.json()) == ["head", "spare", "tail"]


@pytest.mark.parametrize("prefer", [5, "", "x" * 129, ["spare"], True])
def test_a_bad_prefer_is_a_400_naming_the_field_and_changes_nothing(swarm: Swarm, prefer: Any) -> None:
    the_route(swarm)
    swarm.register("spare", "10:20")
    gateway = swarm.member("gw", "gateway")
    session = open_on(gateway, ["head", "mid", "tail"], exclude=["spare"])
    answer = gateway.post(f"/v1/sessions/{session['session_id']}/repair", json={"failed_node": "mid", "prefer": prefer})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prefer", answer.text
    assert route(gateway.get(f"/v1/sessions/{session['session_id']}").json()) == ["head", "mid", "tail"]
    assert "mid" in swarm.live()  # not recorded as failed, not suspended
