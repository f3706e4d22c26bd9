"""Route selection on real, self-benchmarked nodes: the measurably faster middle wins, and a fast
middle without KV room for the request is passed over."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshnet.layers import LayerRange
from meshnet.tracker.routing import NodeRecord, RouteRequest, route_cost_ns
from tests.procs import meshnet_process

pytestmark = pytest.mark.real

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def measured(tracker: str, want: set[str], timeout_s: float = 120) -> dict[str, dict[str, Any]]:
    """The nodes ``want`` once each has registered its self-benchmarked speed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = {n["node_id"]: n for n in httpx.get(f"{tracker}/v1/nodes", timeout=10).json()["nodes"]}
        if want <= {k for k, n in nodes.items() if n["decode_tps"] > 0 and n["prefill_tps"] > 0}:
            return nodes
        time.sleep(0.5)
    raise AssertionError(f"nodes {want} never reported measured speeds")


def route(tracker: str, **fields: Any) -> list[str]:
    body = {"model": MODEL, "total_layers": 30, **fields}
    response = httpx.post(f"{tracker}/v1/sessions", json=body, timeout=10)
    assert response.status_code == 201, response.text
    return [h["node_id"] for h in response.json()["hops"]]


def chain_cost(nodes: dict[str, dict[str, Any]], ids: list[str], prefill: int, decode: int) -> int:
    """``routing.route_cost_ns`` of a chain, from the tracker's own listing of its nodes."""
    records = [
        NodeRecord(
            node_id=n["node_id"],
            url=n["url"],
            model=n["model"],
            layers=LayerRange.parse(n["layers"], n["total_layers"]),
            backend=n["backend"],
            kv_bytes_free=n["kv_bytes_free"],
            last_seen=n["last_seen"],
            prefill_tps=n["prefill_tps"],
            decode_tps=n["decode_tps"],
            queue_depth=n["queue_depth"],
            kv_bytes_per_token=n["kv_bytes_per_token"],
            latency_ms=n["latency_ms"],
            warm=n["warm"],
            weight_bytes=n["weight_bytes"],
            reliability=n["reliability"],
        )
        for n in (nodes[i] for i in ids)
    ]
    return route_cost_ns(records, RouteRequest(prefill_tokens=prefill, decode_tokens=decode))


def test_the_cheapest_measured_middle_wins_and_a_middle_without_kv_room_is_avoided(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/tracker.db"
    with contextlib.ExitStack() as stack:
        tracker = stack.enter_context(meshnet_process(["tracker", "--port", "0", "--db", db])).url
        common = ["--threads", "1", "--tracker", tracker]
        for node_id, extra in [
            ("head", ["--layers", "0:10"]),
            ("tail", ["--layers", "20:30"]),
            ("mid-llama", ["--layers", "10:20"]),
            ("mid-torch", ["--layers", "10:20", "--backend", "torch"]),  # same layers, several times slower
            ("mid-tiny", ["--layers", "10:20", "--ctx", "64", "--max-sessions", "1"]),  # fast, little KV room
        ]:
            stack.enter_context(meshnet_process(["node", "--node-id", node_id, *common, *extra]))
        nodes = measured(tracker, {"head", "tail", "mid-llama", "mid-torch", "mid-tiny"})
        assert nodes["mid-llama"]["decode_tps"] > nodes["mid-torch"]["decode_tps"]
        # Every middle fits a short request: the route whose measured speeds and hop latencies cost
        # least wins. Which middle that is depends on what the nodes measured while five of them
        # self-benchmarked on 2 cores (prefill and hop latency can favour either), so the choice is
        # held against the tracker's cost model over the measurements it was given, not a fixed name.
        for prefill, decode in ((16, 16), (16, 256)):
            best = []  # the cheapest middle by the listings just before and just after the choice
            for when in ("before", "after"):
                if when == "after":
                    picked = route(tracker, prefill_tokens=prefill, max_tokens=decode, exclude=["mid-tiny"])[1]
                listed = {n["node_id"]: n for n in httpx.get(f"{tracker}/v1/nodes", timeout=10).json()["nodes"]}
                cost = {m: chain_cost(listed, ["head", m, "tail"], prefill, decode) for m in ("mid-llama", "mid-torch")}
                best.append(min(cost, key=lambda m: cost[m]))
            assert picked in best, (prefill, decode, picked, best)
        assert route(tracker, prefill_tokens=16, max_tokens=16, exclude=["mid-llama", "mid-torch"])[1] == "mid-tiny"
        # 500 positions do not fit mid-tiny's 64-position KV store: the slower middle with room wins.
        tiny = nodes["mid-tiny"]
        assert tiny["kv_bytes_free"] < 500 * tiny["kv_bytes_per_token"]
        assert route(tracker, prefill_tokens=400, max_tokens=100, exclude=["mid-llama"])[1] == "mid-torch"
