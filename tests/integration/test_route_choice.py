"""Route selection on real, self-benchmarked nodes: the measurably faster middle wins, and a fast
middle without KV room for the request is passed over."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

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


def test_the_faster_middle_wins_and_a_middle_without_kv_room_is_avoided(tmp_path: Path) -> None:
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
        # Compute decides when it outweighs the measured hop latencies, which wobble by some ms on a
        # loaded 2-core machine: a prompt of 300 makes the torch middle's slower prefill cost seconds.
        # mid-tiny's 64 positions cannot hold it; the fast llama.cpp middle with room wins.
        assert route(tracker, prefill_tokens=300, max_tokens=16)[1] == "mid-llama"
        assert route(tracker, prefill_tokens=16, max_tokens=16, exclude=["mid-llama", "mid-torch"])[1] == "mid-tiny"
        # 500 positions do not fit mid-tiny's 64-position KV store: the slower middle with room wins.
        tiny = nodes["mid-tiny"]
        assert tiny["kv_bytes_free"] < 500 * tiny["kv_bytes_per_token"]
        assert route(tracker, prefill_tokens=400, max_tokens=100, exclude=["mid-llama"])[1] == "mid-torch"
