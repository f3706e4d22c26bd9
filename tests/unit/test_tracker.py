"""The tracker: ``plan_route`` as a pure function, then its HTTP surface over a SQLite file."""

from __future__ import annotations

import itertools
import json
import random
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

import meshnet.tracker.app as tracker_app
import meshnet.tracker.plausibility as plausibility
import meshnet.tracker.sessions as tracker_sessions
from meshnet.errors import Overloaded
from meshnet.layers import LayerRange
from meshnet.tracker.app import NODE_TTL_S, create_tracker_app
from meshnet.tracker.db import BillingRow, TrackerDB
from meshnet.tracker.plausibility import (
    FLOOR_HALF_LIFE_S,
    FLOOR_TTL_S,
    MAX_FLOOR_S,
    MAX_MEMORY_BANDWIDTH_BYTES_PER_S,
    SpeedChecks,
)
from meshnet.tracker.routing import NodeRecord, plan_route

MODEL = "m"


def rec(node_id: str, layers: str, *, free: int = 0, total: int = 12, model: str = MODEL) -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        url=f"http://{node_id}",
        model=model,
        layers=LayerRange.parse(layers, total),
        backend="fake",
        kv_bytes_free=free,
        last_seen=0.0,
    )


def ids(chain: list[NodeRecord]) -> list[str]:
    return [n.node_id for n in chain]


def assert_tiles(chain: list[NodeRecord], total: int = 12) -> None:
    assert chain, "a route has at least one hop"
    assert chain[0].layers.start == 0
    assert chain[-1].layers.stop == total
    for a, b in itertools.pairwise(chain):
        assert a.layers.stop == b.layers.start
    assert all(n.layers.total == total for n in chain)


# -- plan_route -------------------------------------------------------------------------------


def test_one_full_node_is_a_route():
    assert ids(plan_route([rec("a", "0:12")], MODEL)) == ["a"]


def test_a_chain_is_ordered_head_to_tail_whatever_the_input_order():
    nodes = [rec("t", "8:12"), rec("h", "0:4"), rec("m", "4:8")]
    chain = plan_route(nodes, MODEL)
    assert ids(chain) == ["h", "m", "t"]
    assert_tiles(chain)


def test_fewer_hops_win_over_free_kv():
    nodes = [
        rec("a", "0:4", free=900),
        rec("b", "4:8", free=900),
        rec("c", "8:12", free=900),
        rec("d", "0:6", free=500),
        rec("e", "6:12", free=500),
        rec("full", "0:12", free=1),
    ]
    assert ids(plan_route(nodes, MODEL)) == ["full"]
    assert ids(plan_route(nodes[:5], MODEL)) == ["d", "e"]


def test_more_free_kv_wins_among_equal_hop_counts():
    assert ids(plan_route([rec("a", "0:12", free=10), rec("b", "0:12", free=20)], MODEL)) == ["b"]


def test_free_kv_is_judged_at_the_weakest_hop():
    # h1 has the most free KV, but its only partner t1 is nearly full: the other chain's weakest
    # hop (50) beats this one's (10).
    nodes = [
        rec("h1", "0:5", free=100),
        rec("t1", "5:12", free=10),
        rec("h2", "0:6", free=50),
        rec("t2", "6:12", free=60),
    ]
    assert ids(plan_route(nodes, MODEL)) == ["h2", "t2"]


def test_ties_break_by_node_id_whatever_the_input_order():
    nodes = [rec("b", "0:12", free=5), rec("a", "0:12", free=5), rec("c", "0:12", free=5)]
    assert ids(plan_route(nodes, MODEL)) == ["a"]
    assert ids(plan_route(list(reversed(nodes)), MODEL)) == ["a"]


def test_other_models_are_ignored():
    nodes = [rec("other", "0:12", free=999, model="other"), rec("h", "0:6"), rec("t", "6:12")]
    assert ids(plan_route(nodes, MODEL)) == ["h", "t"]
    assert ids(plan_route(nodes, "other")) == ["other"]


@pytest.mark.parametrize("stray_first", [True, False])
def test_nodes_reporting_another_layer_count_are_never_mixed_in(stray_first: bool):
    # A stray node of the same model id with another layer count must neither join the chain nor,
    # by registering first, hide the complete one.
    stray = rec("stray", "6:24", total=24, free=999)
    good = [rec("h", "0:6"), rec("t", "6:12")]
    nodes = [stray, *good] if stray_first else [*good, stray]
    assert ids(plan_route(nodes, MODEL)) == ["h", "t"]


def test_layer_counts_are_not_mixed_even_when_the_ranges_would_line_up():
    with pytest.raises(Overloaded):
        plan_route([rec("h", "0:6", total=12), rec("t", "6:24", total=24)], MODEL)


def test_no_node_for_the_model_is_overloaded():
    with pytest.raises(Overloaded, match=r"no node serves model 'm' right now") as info:
        plan_route([rec("x", "0:12", model="other")], MODEL)
    assert (info.value.status, info.value.code, info.value.retry_after_s) == (503, None, 5)
    with pytest.raises(Overloaded, match="no node serves model"):
        plan_route([], MODEL)


@pytest.mark.parametrize(
    ("layers", "gap"),
    [
        (["0:6", "8:12"], "no node serves layers 6:8"),
        (["2:12"], "no node serves layers 0:2"),
        (["0:4", "4:9"], "no node serves layers 9:12"),
        (["8:12", "0:3", "3:5"], "no node serves layers 5:8"),
    ],
)
def test_a_gap_in_the_layers_is_named(layers: list[str], gap: str):
    nodes = [rec(f"n{i}", r) for i, r in enumerate(layers)]
    with pytest.raises(Overloaded) as info:
        plan_route(nodes, MODEL)
    message = info.value.message
    assert message.startswith("the nodes serving 'm' do not cover layers 0:12: ")
    assert gap in message
    assert info.value.retry_after_s == 5


def test_overlapping_ranges_that_do_not_tile_name_where_the_chain_stops():
    # Every layer is served, but nothing starts at 6, where 0:6 ends (4:12 needs layer 4's input).
    with pytest.raises(
        Overloaded, match=r"no node starts at layer 6, where the chain from layer 0 ends \(have 0:6, 4:12\)"
    ):
        plan_route([rec("b", "4:12"), rec("a", "0:6")], MODEL)


def test_the_gap_message_mentions_ignored_layer_counts():
    with pytest.raises(
        Overloaded, match=r"layers 6:12 \(have 0:6, 0:6\); 1 node\(s\) reporting another layer count ignored"
    ):
        plan_route([rec("h", "0:6"), rec("h2", "0:6"), rec("x", "0:30", total=60)], MODEL)


def _all_chains(nodes: list[NodeRecord], total: int) -> list[list[NodeRecord]]:
    """Every chain tiling [0, total), by exhaustive search."""
    chains: list[list[NodeRecord]] = []

    def extend(chain: list[NodeRecord], at: int) -> None:
        if at == total:
            chains.append(chain)
            return
        for node in nodes:
            if node.layers.start == at and node not in chain:
                extend([*chain, node], node.layers.stop)

    extend([], 0)
    return chains


@pytest.mark.parametrize("seed", range(300))
def test_random_swarms_match_brute_force(seed: int):
    rng = random.Random(seed)
    nodes = []
    for i in range(rng.randint(6, 10)):
        total = 12 if rng.random() < 0.85 else 16  # a few strays report another layer count
        start = rng.randrange(0, total)
        if rng.random() < 0.5:  # bias towards a few common cut points so chains exist often
            start = rng.choice([0, 3, 4, 6, 8, 9])
        stop = rng.randint(start + 1, total)
        if rng.random() < 0.5:
            stop = rng.choice([s for s in (3, 4, 6, 8, 9, total) if s > start])
        model = MODEL if rng.random() < 0.9 else "other"
        nodes.append(rec(f"n{i}", f"{start}:{stop}", total=total, free=rng.choice([0, 10, 20, 30]), model=model))
    mine = [n for n in nodes if n.model == MODEL]
    chains = _all_chains([n for n in mine if n.layers.total == 12], 12)
    chains += _all_chains([n for n in mine if n.layers.total == 16], 16)
    if not chains:
        with pytest.raises(Overloaded, match=r"do not cover layers 0:|no node serves model"):
            plan_route(nodes, MODEL)
        return
    chosen = plan_route(nodes, MODEL)
    assert_tiles(chosen, chosen[0].layers.total)
    assert all(n.model == MODEL for n in chosen)
    assert len({n.node_id for n in chosen}) == len(chosen)
    fewest = min(len(c) for c in chains)
    assert len(chosen) == fewest
    best_free = max(min(n.kv_bytes_free for n in c) for c in chains if len(c) == fewest)
    assert min(n.kv_bytes_free for n in chosen) == best_free
    assert plan_route(list(reversed(nodes)), MODEL) == chosen  # the input order never matters


# -- the HTTP surface -------------------------------------------------------------------------


@pytest.fixture
def db_path(tmp_path: Path) -> str:
    return "sqlite:///" + str(tmp_path / "t.db")


@pytest.fixture
def client(db_path: str) -> Iterator[TestClient]:
    db = TrackerDB(db_path)
    try:
        with TestClient(create_tracker_app(db)) as c:
            yield c
    finally:
        db.close()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The tracker's wall clock, moved by hand: ``clock[0] += ...``."""
    now = [1_000_000.0]
    fake = types.SimpleNamespace(time=lambda: now[0])
    monkeypatch.setattr(tracker_app, "time", fake)
    monkeypatch.setattr(tracker_sessions, "time", fake)
    monkeypatch.setattr(plausibility, "time", fake)
    return now


def registration(node_id: str, layers: str, **fields: Any) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "url": f"http://{node_id}.local:7000/",
        "model": MODEL,
        "layers": layers,
        "total_layers": 12,
        "backend": "fake",
        "kv_bytes_free": 1000,
        **fields,
    }


def assert_error(response: Any, status: int, error_type: str, *, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type
    assert error["param"] == param
    return dict(error)


def test_registration_then_heartbeat(client: TestClient):
    first = client.post("/v1/nodes", json=registration("a", "0:12"))
    assert first.status_code == 201
    assert first.json() == {"registered": "a", "ttl_s": NODE_TTL_S, "next_hops": []}
    again = client.post("/v1/nodes", json=registration("a", "0:12", kv_bytes_free=5))
    assert again.status_code == 200
    assert again.json() == {"registered": "a", "ttl_s": NODE_TTL_S, "next_hops": []}
    [node] = client.get("/v1/nodes").json()["nodes"]
    assert node["kv_bytes_free"] == 5  # a heartbeat refreshes what the node reports


# What a node that sends no advertisement is listed with.
UNADVERTISED = {
    "quantization": None,
    "hardware": {
        "cpu": None,
        "logical_cores": None,
        "threads": None,
        "ram_total_bytes": None,
        "ram_available_bytes": None,
        "gpu": None,
        "gpu_memory_bytes": None,
    },
    "prefill_tps": 0.0,
    "decode_tps": 0.0,
    "prefill_tps_used": 0.0,
    "decode_tps_used": 0.0,
    "capped": False,
    "decode_floor_s": None,
    "queue_depth": 0,
    "kv_bytes_per_token": 0,
    "latency_ms": {},
    "warm": False,
    "weight_bytes": 0,
    "reliability": 1.0,
    "manifest": None,
    "files": [],
    "bt_peer": None,
    "numerics": None,
    "wire_dtype": "float32",
    "hop_key": None,
    "architecture": None,
    "seam": None,
    "max_verify": 0,
    "trusted": False,  # an open swarm's nodes have no certificate, so no trusted tier
    "holds_prefixes": False,
    "placement": None,  # placed by hand (--layers START:STOP), not by the tracker
    "identity": None,
    "max_positions": 0,
    "context_length": 0,
    "auditor": False,  # an auditor is listed but never routed (tracker.audits)
    "suspended": None,  # no failed audit keeps it off the routes
}


def test_list_nodes(client: TestClient, clock: list[float]):
    assert client.get("/v1/nodes").json() == {"nodes": []}
    client.post("/v1/nodes", json=registration("a", "0:6"))
    client.post("/v1/nodes", json=registration("b", "6:", kv_bytes_free=7))
    listed = client.get("/v1/nodes").json()
    for node in listed["nodes"]:
        assert {k: node.pop(k) for k in UNADVERTISED} == UNADVERTISED
    assert listed == {
        "nodes": [
            {
                "node_id": "a",
                "url": "http://a.local:7000",  # the trailing slash is dropped
                "model": MODEL,
                "layers": "0:6",
                "total_layers": 12,
                "backend": "fake",
                "kv_bytes_free": 1000,
                "last_seen": clock[0],
            },
            {
                "node_id": "b",
                "url": "http://b.local:7000",
                "model": MODEL,
                "layers": "6:12",
                "total_layers": 12,
                "backend": "fake",
                "kv_bytes_free": 7,
                "last_seen": clock[0],
            },
        ]
    }


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"url": "ftp://a"}, "url", "must look like http://HOST:PORT"),
        ({"url": "a.local:7000"}, "url", "must look like http://HOST:PORT"),
        ({"url": "http://0.0.0.0:7000"}, "url", "wildcard address 0.0.0.0, which no peer can dial"),
        ({"url": "http://[::]:7000"}, "url", "wildcard address"),
        ({"url": "http://a.local"}, "url", "explicit port"),
        ({"url": "http://a.local:7000/admin"}, "url", "no user, path, query or fragment"),
        ({"url": "http://u:p@a.local:7000"}, "url", "no user, path, query or fragment"),
        ({"prefill_tps": 1e-300}, "prefill_tps", "at least 0.001 positions/s"),
        ({"decode_tps": 1e12}, "decode_tps", "less than or equal to 10000000"),
        ({"decode_tps": "NaN"}, "decode_tps", "finite number"),
        (
            {"latency_ms": {"http://b.local:7000": 1e300}},
            "latency_ms.http://b.local:7000",
            "less than or equal to 600000",
        ),
        ({"kv_bytes_free": 2**62}, "kv_bytes_free", "less than or equal to"),
        ({"layers": "6:40"}, "layers", "0 <= start < stop <= 12"),
        ({"layers": "abc"}, "layers", "START:STOP"),
        ({"layers": "x:y"}, "layers", "integers"),
        ({"total_layers": 0}, "total_layers", "greater than or equal to 1"),
        ({"node_id": ""}, "node_id", "at least 1 character"),
        ({"model": ""}, "model", "at least 1 character"),
        ({"kv_bytes_free": -1}, "kv_bytes_free", "greater than or equal to 0"),
    ],
)
def test_registration_is_validated(client: TestClient, fields: dict[str, Any], param: str, says: str):
    body = {**registration("a", "0:12"), **fields}
    error = assert_error(client.post("/v1/nodes", json=body), 400, "invalid_request_error", param=param)
    assert says in error["message"]
    assert client.get("/v1/nodes").json() == {"nodes": []}


def test_a_missing_field_or_bad_json_is_400(client: TestClient):
    body = registration("a", "0:12")
    del body["layers"]
    error = assert_error(client.post("/v1/nodes", json=body), 400, "invalid_request_error", param="layers")
    assert "Field required" in error["message"]
    assert_error(client.post("/v1/nodes", content=b"{not json"), 400, "invalid_request_error", param="body")
    assert_error(client.post("/v1/sessions", content=b"[]"), 400, "invalid_request_error", param="body")
    assert_error(client.post("/v1/sessions", json={}), 400, "invalid_request_error", param="model")


def test_open_session_returns_a_route_covering_every_layer(client: TestClient, clock: list[float]):
    for node_id, layers in [("c", "8:12"), ("a", "0:4"), ("b", "4:8")]:
        client.post("/v1/nodes", json=registration(node_id, layers))
    response = client.post("/v1/sessions", json={"model": MODEL})
    assert response.status_code == 201
    session = response.json()
    assert set(session) == {
        "session_id", "route_id", "model", "hops", "created", "trusted_only", "alternatives", "estimated_s",
        "cached_tokens",
    }  # fmt: skip
    assert session["trusted_only"] is False
    assert session["alternatives"] == []  # only one chain exists
    assert session["estimated_s"] > 0
    assert session["cached_tokens"] == 0  # no prefix asked for
    assert session["session_id"].startswith("ses-")
    assert session["route_id"].startswith("rte-")
    assert session["model"] == MODEL
    assert session["created"] == clock[0]
    assert session["hops"] == [
        {
            "node_id": n,
            "url": f"http://{n}.local:7000",
            "layers": layers,
            "numerics": None,
            "wire_dtype": "float32",
            "max_verify": 0,
        }
        for n, layers in (("a", "0:4"), ("b", "4:8"), ("c", "8:12"))
    ]
    other = client.post("/v1/sessions", json={"model": MODEL}).json()
    assert (other["session_id"], other["route_id"]) != (session["session_id"], session["route_id"])


def test_a_session_is_sticky_across_a_tracker_restart(db_path: str):
    first_db = TrackerDB(db_path)
    try:
        with TestClient(create_tracker_app(first_db)) as first:
            first.post("/v1/nodes", json=registration("a", "0:6"))
            first.post("/v1/nodes", json=registration("b", "6:12"))
            session = first.post("/v1/sessions", json={"model": MODEL}).json()
            del session["alternatives"], session["estimated_s"], session["cached_tokens"]  # the choice's, not persisted
    finally:
        first_db.close()
    second_db = TrackerDB(db_path)  # a restarted tracker: no nodes yet, the same database
    try:
        with TestClient(create_tracker_app(second_db)) as second:
            assert second.get("/v1/nodes").json() == {"nodes": []}
            got = second.get(f"/v1/sessions/{session['session_id']}")
            assert got.status_code == 200
            members = [f"{h['node_id']} {h['layers']}" for h in session["hops"]]
            assert got.json() == {**session, "status": "open", "updated": session["created"], "repairs": 0,
                                  "ended_reason": None, "members": members, "hop_keys": {},
                                  "gateway_key": None}  # fmt: skip
            deleted = second.delete(f"/v1/sessions/{session['session_id']}")
            assert deleted.json() == {"deleted": session["session_id"]}
    finally:
        second_db.close()


def test_delete_closes_a_session_once_and_keeps_its_record(client: TestClient):
    client.post("/v1/nodes", json=registration("a", "0:12"))
    sid = client.post("/v1/sessions", json={"model": MODEL}).json()["session_id"]
    assert client.get(f"/v1/sessions/{sid}").json()["status"] == "open"
    assert [s["session_id"] for s in client.get("/v1/sessions").json()["sessions"]] == [sid]
    deleted = client.delete(f"/v1/sessions/{sid}")
    assert deleted.status_code == 200
    assert deleted.json() == {"deleted": sid}
    closed = client.get(f"/v1/sessions/{sid}").json()  # kept: billing may still arrive for it
    assert closed["status"] == "closed" and closed["ended_reason"] == "closed by the gateway"
    assert client.get("/v1/sessions").json()["sessions"] == []
    error = assert_error(client.delete(f"/v1/sessions/{sid}"), 404, "not_found_error")
    assert error["message"] == f"session {sid} is already closed"
    assert_error(client.get("/v1/sessions/ses-never"), 404, "not_found_error")


def test_no_node_for_the_model_is_503_with_retry_after(client: TestClient):
    response = client.post("/v1/sessions", json={"model": MODEL})
    error = assert_error(response, 503, "overloaded_error")
    assert response.headers["retry-after"] == "5"
    assert error["message"] == "no node serves model 'm' right now"


def test_a_gap_in_the_layers_is_503_naming_it(client: TestClient):
    client.post("/v1/nodes", json=registration("a", "0:6"))
    client.post("/v1/nodes", json=registration("b", "8:12"))
    response = client.post("/v1/sessions", json={"model": MODEL})
    error = assert_error(response, 503, "overloaded_error")
    assert "no node serves layers 6:8" in error["message"]
    assert response.headers["retry-after"] == "5"


def test_nodes_expire_without_heartbeats(client: TestClient, clock: list[float]):
    client.post("/v1/nodes", json=registration("a", "0:12"))
    clock[0] += NODE_TTL_S - 0.5
    assert [n["node_id"] for n in client.get("/v1/nodes").json()["nodes"]] == ["a"]
    assert client.post("/v1/sessions", json={"model": MODEL}).status_code == 201
    clock[0] += 1.0  # now past the TTL since the last heartbeat
    assert client.get("/v1/nodes").json() == {"nodes": []}
    assert client.get("/v1/health").json()["nodes"] == 0
    assert_error(client.post("/v1/sessions", json={"model": MODEL}), 503, "overloaded_error")


def test_heartbeats_keep_a_node_alive_and_an_expired_node_registers_afresh(client: TestClient, clock: list[float]):
    assert client.post("/v1/nodes", json=registration("a", "0:12")).status_code == 201
    for _ in range(3):
        clock[0] += NODE_TTL_S - 1
        assert client.post("/v1/nodes", json=registration("a", "0:12")).status_code == 200
    assert client.post("/v1/sessions", json={"model": MODEL}).status_code == 201
    clock[0] += NODE_TTL_S + 1
    assert client.post("/v1/nodes", json=registration("a", "0:12")).status_code == 201


def test_health(client: TestClient, db_path: str):
    client.post("/v1/nodes", json=registration("a", "0:12"))
    assert client.get("/v1/health").json() == {"status": "ok", "nodes": 1, "database": db_path}


def test_unknown_path_and_wrong_method(client: TestClient):
    assert_error(client.get("/v1/nope"), 404, "not_found_error")
    assert_error(client.put("/v1/nodes", json={}), 405, "invalid_request_error")
    assert_error(client.post("/v1/sessions/x", json={}), 405, "invalid_request_error")


def test_the_callers_layer_count_rules_out_misconfigured_nodes() -> None:
    good = [
        NodeRecord("a", "http://a", "m", LayerRange(0, 15, 30), "llama.cpp", 10, 0.0),
        NodeRecord("b", "http://b", "m", LayerRange(15, 30, 30), "llama.cpp", 10, 0.0),
    ]
    wrong = NodeRecord("w", "http://w", "m", LayerRange(0, 24, 24), "llama.cpp", 10, 0.0)  # one hop, wrong model
    assert [n.node_id for n in plan_route([wrong, *good], "m")] == ["w"]  # fewer hops wins when nothing is known
    assert [n.node_id for n in plan_route([wrong, *good], "m", 30)] == ["a", "b"]
    with pytest.raises(Overloaded, match=r"report \[24\] layers, not the 30"):
        plan_route([wrong], "m", 30)


def test_a_node_of_another_model_under_the_same_name_is_refused(client: TestClient):
    """Another GGUF registered under a model id the swarm serves (another family, another seam width,
    another layer count) would join routes and compute garbage at its seams: 409, never routed to."""
    base = {"architecture": "llama", "seam": [576]}
    assert client.post("/v1/nodes", json=registration("a", "0:6", **base)).status_code == 201
    cases = [
        (registration("b", "6:12", architecture="qwen3", seam=[576]), "architecture 'qwen3', not 'llama'"),
        (registration("c", "6:12", architecture="llama", seam=[1024]), "seam [1024], not [576]"),
        (registration("d", "6:14", total_layers=14, **base), "14 layers, not 12"),
    ]
    for body, why in cases:
        answer = client.post("/v1/nodes", json=body)
        assert answer.status_code == 409, answer.text
        error = answer.json()["error"]
        assert error["code"] == "model_mismatch" and why in error["message"] and "own model id" in error["message"]
    assert [n["node_id"] for n in client.get("/v1/nodes").json()["nodes"]] == ["a"]
    # The same model again (or a node that does not say, as older nodes do) is welcome.
    assert client.post("/v1/nodes", json=registration("e", "6:12", **base)).status_code == 201
    assert client.post("/v1/nodes", json=registration("f", "6:12")).status_code == 201
    # A PyTorch node names its transformers model_type: the same family as the GGUF's architecture.
    hybrid = {"model": "q", "seam": [64]}
    assert (
        client.post("/v1/nodes", json=registration("g", "0:6", architecture="qwen35moe", **hybrid)).status_code == 201
    )
    torch_node = registration("h", "6:12", architecture="qwen3_5_moe_text", **hybrid)
    assert client.post("/v1/nodes", json=torch_node).status_code == 201
    assert client.get("/v1/nodes").json()["nodes"][0]["seam"] == [576]


def test_a_live_node_id_cannot_be_taken_over_from_another_address(client: TestClient) -> None:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tests.asgi import serve_in_thread

    async def health(_: Any) -> JSONResponse:
        return JSONResponse({"status": "ok", "node_id": "honest"})

    with serve_in_thread(Starlette(routes=[Route("/v1/health", health)])) as honest_url:
        assert client.post("/v1/nodes", json=registration("honest", "0:12", url=honest_url)).status_code == 201
        stolen = client.post("/v1/nodes", json=registration("honest", "0:12", url="http://127.0.0.1:9/"))
        error = assert_error(stolen, 409, "conflict_error", param="node_id")
        assert honest_url in error["message"] and "another --node-id" in error["message"]
        [node] = client.get("/v1/nodes").json()["nodes"]
        assert node["url"] == honest_url  # nothing changed
        # its own heartbeats are still taken
        assert client.post("/v1/nodes", json=registration("honest", "0:12", url=honest_url)).status_code == 200
    # the honest node is gone (killed, restarted elsewhere): its id moves at once
    moved = client.post("/v1/nodes", json=registration("honest", "0:12", url="http://127.0.0.1:9/"))
    assert moved.status_code == 200
    assert client.get("/v1/nodes").json()["nodes"][0]["url"] == "http://127.0.0.1:9"


# -- plausible speeds: ceilings at registration, floors from billing reports (tracker.plausibility) --


def test_an_absurd_speed_is_capped_for_routing_and_listed_next_to_the_advertised_one(client: TestClient):
    weights = 4 * 10**9  # a decode step reads them all: no node decodes them 12,500 times a second
    body = registration("liar", "0:12", decode_tps=1e6, prefill_tps=1000.0, weight_bytes=weights)
    assert client.post("/v1/nodes", json=body).status_code == 201  # capped, not refused
    client.post(
        "/v1/nodes", json=registration("honest", "0:12", decode_tps=100.0, prefill_tps=1000.0, weight_bytes=weights)
    )
    nodes = {n["node_id"]: n for n in client.get("/v1/nodes").json()["nodes"]}
    liar, honest = nodes["liar"], nodes["honest"]
    assert liar["decode_tps"] == 1e6 and liar["capped"] is True
    assert liar["decode_tps_used"] == pytest.approx(MAX_MEMORY_BANDWIDTH_BYTES_PER_S / weights) == pytest.approx(12_500)
    assert liar["prefill_tps_used"] == 1000.0
    assert (honest["decode_tps_used"], honest["prefill_tps_used"], honest["capped"]) == (100.0, 1000.0, False)
    assert liar["decode_floor_s"] is None and honest["decode_floor_s"] is None


def _swarm(client: TestClient) -> None:
    """A head, a liar claiming 10^6 decode positions/s for layers 6:12, and an honest tail for them."""
    for node_id, layers, tps in (("h", "0:6", 100.0), ("liar", "6:12", 1e6), ("honest", "6:12", 50.0)):
        body = registration(node_id, layers, decode_tps=tps, prefill_tps=1000.0, kv_bytes_free=1 << 30)
        assert client.post("/v1/nodes", json=body).status_code in (200, 201)


def _route(client: TestClient) -> dict[str, Any]:
    response = client.post("/v1/sessions", json={"model": MODEL, "total_layers": 12})
    assert response.status_code == 201, response.text
    return dict(response.json())


def _report(session: dict[str, Any], *, steps: int = 100, **fields: Any) -> dict[str, Any]:
    records = [{"node_id": h["node_id"], "layers": h["layers"], "prefill_tokens": 10, "decode_tokens": steps}
               for h in session["hops"]]  # fmt: skip
    return {"session_id": session["session_id"], "route_id": session["route_id"], "records": records, **fields}


def _floors(client: TestClient) -> dict[str, float | None]:
    return {n["node_id"]: n["decode_floor_s"] for n in client.get("/v1/nodes").json()["nodes"]}


def _hops(session: dict[str, Any]) -> list[str]:
    return [h["node_id"] for h in session["hops"]]


def test_a_plausible_decode_time_changes_nothing(client: TestClient, clock: list[float]):
    _swarm(client)
    session = _route(client)
    assert _hops(session) == ["h", "liar"]
    # Claimed per step: 1/100 + 1/10^6 + the 5 ms default hop = 15 ms; 40 ms is within 3x + 20 ms + 10 ms a node.
    answer = client.post("/v1/billing", json=_report(session, decode_s=100 * 0.04))
    assert answer.status_code == 201, answer.text
    check = answer.json()["speed_check"]
    assert check["plausible"] is True and check["steps"] == 100
    assert check["observed_step_s"] == pytest.approx(0.04) and check["claimed_step_s"] == pytest.approx(0.015001)
    assert check["plausible_step_s"] == pytest.approx(3 * 0.015001 + 0.02 + 2 * 0.01)
    assert check["decode_floor_s"] == {"h": 0.0, "liar": 0.0}
    assert _floors(client) == {"h": None, "liar": None, "honest": None}
    assert _hops(_route(client)) == ["h", "liar"]
    # A report without decode_s (an older gateway) is not judged.
    answer = client.post("/v1/billing", json=_report(_route(client)))
    assert answer.status_code == 201 and "speed_check" not in answer.json()


def test_an_implausible_decode_time_floors_the_route_and_a_chain_without_the_liar_wins(
    client: TestClient, clock: list[float]
):
    _swarm(client)
    session = _route(client)
    assert _hops(session) == ["h", "liar"]  # it claims the fastest tail
    answer = client.post("/v1/billing", json=_report(session, decode_s=100 * 0.2))  # 0.2 s a step, not 0.015
    assert answer.status_code == 201, answer.text
    check = answer.json()["speed_check"]
    assert check["plausible"] is False
    share = (0.2 - 0.005) * 6 / 12  # the step less its hop, by layer share
    assert check["decode_floor_s"] == {"h": pytest.approx(share), "liar": pytest.approx(share)}
    assert _floors(client) == {"h": pytest.approx(share), "liar": pytest.approx(share), "honest": None}
    assert _hops(_route(client)) == ["h", "honest"]  # the request the honest tail lost before
    # A resent report (the gateway lost the answer) is a duplicate and judged no second time.
    again = client.post("/v1/billing", json=_report(session, decode_s=100 * 5.0))
    assert again.status_code == 200 and again.json()["duplicate"] is True and "speed_check" not in again.json()
    assert _floors(client)["liar"] == pytest.approx(share)


def test_floors_decay_halve_on_an_honest_report_and_expire(client: TestClient, clock: list[float]):
    _swarm(client)
    client.post("/v1/billing", json=_report(_route(client), decode_s=100 * 0.2))
    share = (0.2 - 0.005) / 2
    clock[0] += FLOOR_HALF_LIFE_S
    _swarm(client)  # the heartbeats that keep them alive
    assert _floors(client) == {"h": pytest.approx(share / 2), "liar": pytest.approx(share / 2), "honest": None}
    # The head's claim holds up on a route without the liar: its floor halves at once.
    session = _route(client)
    assert _hops(session) == ["h", "honest"]
    answer = client.post("/v1/billing", json=_report(session, decode_s=100 * 0.035))
    assert answer.json()["speed_check"]["plausible"] is True
    assert _floors(client) == {"h": pytest.approx(share / 4), "liar": pytest.approx(share / 2), "honest": None}
    clock[0] += FLOOR_TTL_S + 1
    _swarm(client)
    assert _floors(client) == {"h": None, "liar": None, "honest": None}
    # Forgotten, the liar wins again; judged against its claim, not its floor, it is floored again.
    session = _route(client)
    assert _hops(session) == ["h", "liar"]
    client.post("/v1/billing", json=_report(session, decode_s=100 * 0.2))
    assert _floors(client)["liar"] == pytest.approx(share)


def test_a_gateway_reporting_absurd_times_floors_its_route_only_within_bounds(client: TestClient, clock: list[float]):
    _swarm(client)
    session = _route(client)
    answer = client.post("/v1/billing", json=_report(session, decode_s=1e7))  # the most decode_s allowed
    assert answer.json()["speed_check"]["decode_floor_s"] == {"h": MAX_FLOOR_S, "liar": MAX_FLOOR_S}
    assert _floors(client)["honest"] is None  # off its route: untouched
    # Too few decode steps to time: not judged.
    answer = client.post("/v1/billing", json=_report(_route(client), steps=3, decode_s=1e7))
    assert answer.status_code == 201 and "speed_check" not in answer.json()


@pytest.mark.parametrize("raw", ["-1", "NaN", "Infinity", "1e300", "10000001", '"12.5"', "true", "[1]", "{}"])
def test_a_bad_decode_s_is_a_400_naming_it_and_records_nothing(client: TestClient, raw: str):
    _swarm(client)
    session = _route(client)
    body = json.dumps(_report(session))[:-1] + f', "decode_s": {raw}}}'
    error = assert_error(client.post("/v1/billing", content=body), 400, "invalid_request_error", param="decode_s")
    assert "decode_s" in error["message"]
    assert client.get("/v1/billing").json()["totals"]["records"] == 0
    assert client.get(f"/v1/sessions/{session['session_id']}").json()["status"] == "open"
    assert _floors(client) == {"h": None, "liar": None, "honest": None}
    answer = client.post("/v1/billing", json=_report(session, decode_s=100 * 0.2))  # the fixed report still counts
    assert answer.status_code == 201 and answer.json()["speed_check"]["plausible"] is False


def _rows(steps: int, *hops: tuple[str, int]) -> list[BillingRow]:
    return [BillingRow(node_id, f"?:{n}", n, 0, steps) for node_id, n in hops]


def test_claims_are_the_ones_routing_saw_and_a_repair_adds_its_replacements():
    checks = SpeedChecks()
    fast = replace(rec("fast", "0:12"), decode_tps=1e6)
    checks.route_chosen("s1", [fast])
    assert checks.judge("unknown", _rows(100, ("fast", 12)), 12, 10.0) is None  # no snapshot: not judged
    verdict = checks.judge("s1", _rows(100, ("fast", 12)), 12, 10.0)
    assert verdict is not None and not verdict.plausible and verdict.claimed_step_s == pytest.approx(1e-6)
    assert checks.judge("s1", _rows(100, ("fast", 12)), 12, 10.0) is None  # judged once
    # What it claims later is not what routing chose it by: the snapshot stands.
    checks.route_chosen("s2", [fast])
    # A repair: the replacement's claim (10 positions/s) joins the route's.
    checks.route_repaired("s2", ["slow"], [replace(fast, node_id="slow", decode_tps=10.0)])
    verdict = checks.judge("s2", _rows(50, ("fast", 12)) + _rows(50, ("slow", 12)), 12, 100 * 0.05)
    assert verdict is not None and verdict.steps == 100
    assert verdict.claimed_step_s == pytest.approx((50 * 1e-6 + 50 * 0.1) / 100)
    assert verdict.plausible
