"""The tracker's placement endpoint and heartbeat moves (``tracker.placement_api``) over its real app."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

import meshnet.tracker.app as tracker_app
import meshnet.tracker.placement_api as placement_api
import meshnet.tracker.sessions as tracker_sessions
from meshnet.layers import LayerRange
from meshnet.tracker.app import NODE_TTL_S, create_tracker_app
from meshnet.tracker.db import TrackerDB
from meshnet.tracker.placement_api import HOLE_GRACE_S, MOVE_COOLDOWN_S, PlacementBook, RoutableNodes
from meshnet.tracker.routing import NodeRecord

MODEL = "m"
TOTAL = 12


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1_000_000.0]
    fake = types.SimpleNamespace(time=lambda: now[0])
    for module in (tracker_app, tracker_sessions, placement_api):
        monkeypatch.setattr(module, "time", fake)
    return now


@pytest.fixture
def client(tmp_path: Path, clock: list[float]) -> Iterator[TestClient]:
    db = TrackerDB("sqlite:///" + str(tmp_path / "t.db"))
    try:
        with TestClient(create_tracker_app(db)) as c:
            yield c
    finally:
        db.close()


def advert(max_layers: int | None = 4, budget: int = 10**9) -> dict[str, Any]:
    return {"layer_bytes": [1000] * TOTAL, "budget_bytes": budget, "boundaries": list(range(TOTAL + 1)),
            "max_layers": max_layers}  # fmt: skip


def ask(client: TestClient, node_id: str, **fields: Any) -> Any:
    return client.post("/v1/placement", json={"node_id": node_id, "model": MODEL, "total_layers": TOTAL,
                                              **advert(), **fields})  # fmt: skip


def register(client: TestClient, node_id: str, layers: str, *, auto: bool = True) -> dict[str, Any]:
    body = {"node_id": node_id, "url": f"http://{node_id}.local:7000", "model": MODEL, "layers": layers,
            "total_layers": TOTAL, "kv_bytes_free": 1000, "decode_tps": 10.0}  # fmt: skip
    if auto:
        body["placement"] = advert()
    answer = client.post("/v1/nodes", json=body)
    assert answer.status_code in (200, 201), answer.text
    return dict(answer.json())


def nodes(client: TestClient) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in client.get("/v1/nodes").json()["nodes"]}


def test_nodes_asking_at_the_same_moment_get_the_holes_one_each(client: TestClient) -> None:
    got = [ask(client, f"n{i}").json() for i in range(3)]
    assert [g["layers"] for g in got] == ["0:4", "4:8", "8:12"]
    assert got[0]["reason"] == "uncovered" and got[0]["reserved_s"] == placement_api.RESERVE_S
    listed = client.get("/v1/placement").json()
    reserved = [(r["node_id"], r["layers"]) for r in listed["reservations"]]
    assert reserved == [("n0", "0:4"), ("n1", "4:8"), ("n2", "8:12")]
    # Asking again (a restart) gets the same range back: its own reservation is not in its way.
    assert ask(client, "n1").json()["layers"] == "4:8"
    # Registering with the range ends the reservation; the live node now covers it.
    register(client, "n0", "0:4")
    assert [r["node_id"] for r in client.get("/v1/placement").json()["reservations"]] == ["n1", "n2"]
    assert ask(client, "n3").json()["reason"] == "least_throughput"
    assert nodes(client)["n0"]["placement"]["mode"] == "auto"


def test_a_reservation_lapses_and_frees_its_range(client: TestClient, clock: list[float]) -> None:
    assert ask(client, "a").json()["layers"] == "0:4"
    clock[0] += placement_api.RESERVE_S + 1
    assert ask(client, "b").json()["layers"] == "0:4"


def test_bad_asks_are_400_naming_the_field(client: TestClient) -> None:
    short = ask(client, "a", layer_bytes=[1, 2])
    assert short.status_code == 400 and short.json()["error"]["param"] == "layer_bytes"
    bounds = ask(client, "a", boundaries=[0, 5])
    assert bounds.status_code == 400 and bounds.json()["error"]["param"] == "boundaries"
    tiny = ask(client, "a", budget_bytes=10)
    assert tiny.status_code == 400
    assert (tiny.json()["error"]["code"], tiny.json()["error"]["param"]) == ("placement_does_not_fit", "budget_bytes")
    assert "no layer range fits this node" in tiny.json()["error"]["message"]
    bad = client.post("/v1/nodes", json={"node_id": "x", "url": "http://x.local:7000", "model": MODEL,
                                         "layers": "0:12", "total_layers": TOTAL,
                                         "placement": {**advert(), "layer_bytes": [1]}})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "placement.layer_bytes"
    assert "x" not in nodes(client)  # refused before it was stored


def _swarm_with_a_spare(client: TestClient) -> None:
    for node_id, layers in (("a", "0:4"), ("b", "4:8"), ("c", "8:12"), ("d", "0:4")):
        register(client, node_id, layers)


def _heartbeats(client: TestClient, *alive: tuple[str, str]) -> dict[str, dict[str, Any]]:
    return {node_id: register(client, node_id, layers) for node_id, layers in alive}


def test_a_doubly_covered_auto_node_moves_to_a_hole_once_it_lasts(client: TestClient, clock: list[float]) -> None:
    _swarm_with_a_spare(client)
    alive = (("a", "0:4"), ("b", "4:8"), ("d", "0:4"))
    assert all("move" not in a for a in _heartbeats(client, *alive).values())
    clock[0] += NODE_TTL_S + 1  # c leaves for good: it expires
    answers = _heartbeats(client, *alive)
    assert all("move" not in a for a in answers.values())  # the hole is new: no move yet
    clock[0] += HOLE_GRACE_S
    answers = _heartbeats(client, *alive)
    moving = {k for k, a in answers.items() if "move" in a}
    assert len(moving) == 1 and moving <= {"a", "d"}  # one of the two at 0:4; never b, the only one at 4:8
    mover = moving.pop()
    assert answers[mover]["move"]["layers"] == "8:12" and answers[mover]["move"]["from"] == "0:4"
    # Repeated until it registers at the target; the other one at 0:4 is not sent too.
    again = _heartbeats(client, *alive)
    assert again[mover]["move"]["layers"] == "8:12" and sum("move" in a for a in again.values()) == 1
    listed = nodes(client)[mover]["placement"]
    assert (listed["moving_to"], listed["moves"]) == ("8:12", 0)
    assert [m["node_id"] for m in client.get("/v1/placement").json()["moves"]] == [mover]
    # It drains: the sessions API routes nothing new through it.
    register(client, mover, "8:12")
    listed = nodes(client)[mover]["placement"]
    assert (listed["moving_to"], listed["moves"]) == (None, 1)
    assert "moved 0:4 -> 8:12" in listed["events"][-1]
    assert client.get("/v1/placement").json() == {"reservations": [], "moves": []}


def test_moves_are_bounded_by_a_cooldown(client: TestClient, clock: list[float]) -> None:
    register(client, "b", "4:8", auto=False)
    register(client, "c", "8:12", auto=False)
    for node_id in ("a", "d"):
        register(client, node_id, "0:4")
    clock[0] += NODE_TTL_S + 1  # c leaves
    alive = {"a": "0:4", "d": "0:4"}
    _heartbeats(client, *alive.items())
    register(client, "b", "4:8", auto=False)
    clock[0] += HOLE_GRACE_S
    mover = next(k for k, a in _heartbeats(client, *alive.items()).items() if "move" in a)
    stayer = next(k for k in alive if k != mover)
    register(client, mover, "8:12")  # moved
    register(client, "f", "8:12", auto=False)  # someone else serves 8:12 too now
    clock[0] += NODE_TTL_S + 1  # and the node left at 0:4 leaves: a hole the mover could fill
    beat = [(mover, "8:12")]
    for _ in range(3):
        register(client, "b", "4:8", auto=False)
        register(client, "f", "8:12", auto=False)
        assert "move" not in _heartbeats(client, *beat)[mover]  # within its cooldown
        clock[0] += HOLE_GRACE_S
    assert stayer not in nodes(client)
    clock[0] += MOVE_COOLDOWN_S
    register(client, "b", "4:8", auto=False)
    register(client, "f", "8:12", auto=False)
    assert _heartbeats(client, *beat)[mover]["move"]["layers"] == "0:4"


def test_a_node_placed_by_hand_is_never_moved(client: TestClient, clock: list[float]) -> None:
    for node_id, layers in (("a", "0:4"), ("b", "4:8"), ("c", "8:12"), ("d", "0:4")):
        register(client, node_id, layers, auto=False)
    alive = [("a", "0:4"), ("b", "4:8"), ("d", "0:4")]
    clock[0] += NODE_TTL_S + 1
    for node_id, layers in alive:
        register(client, node_id, layers, auto=False)
    clock[0] += HOLE_GRACE_S + MOVE_COOLDOWN_S
    for node_id, layers in alive:
        assert "move" not in register(client, node_id, layers, auto=False)
    assert nodes(client)["a"]["placement"] is None


def test_routes_skip_a_draining_node() -> None:
    class Registry:
        def __init__(self) -> None:
            self.failed: list[str] = []

        def live_nodes(self) -> list[NodeRecord]:
            return [NodeRecord(k, f"http://{k}.local:1", MODEL, LayerRange(0, 12, 12), "fake", 0, 0.0) for k in "ab"]

        def record_failure(self, node_id: str, reason: str) -> None:
            self.failed.append(node_id)

        def suspend(self, node_id: str) -> None:
            pass

    book = PlacementBook(clock=lambda: 0.0)
    book.moves["a"] = placement_api._Move(MODEL, LayerRange(0, 12, 12), LayerRange(0, 6, 12), 0.0, "test")
    registry = Registry()
    routable = RoutableNodes(registry, book)
    assert [n.node_id for n in routable.live_nodes()] == ["b"]
    routable.record_failure("a", "x")
    assert registry.failed == ["a"]
