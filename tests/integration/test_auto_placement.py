"""``meshnet node --manifest M --layers auto``: real nodes placed by the tracker cover the bundled model,
each fetching only its files, and the route's greedy text is ``meshnet serve``'s; when a node leaves for
good, an auto node whose layers are served twice moves to the hole, and the text stays the same."""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from meshnet.artifacts.fetch import load_source
from meshnet.artifacts.webseed import RangeServer
from tests.procs import Proc, admin_client, meshnet_cli, meshnet_process, start_together, tracker_url

pytestmark = pytest.mark.real

NAME = "SmolLM2-135M-Instruct.Q4_1"
# 64 MiB: one published range of the bundled model with its KV budget (2 sessions x 512 positions)
# fits, two do not (0:10 with the head's table is ~60 MB, 20:30 with the lm_head ~62 MB, 0:20 ~90 MB).
MEMORY_GB = "0.0625"
PROMPTS = ("What is the capital of France?", "Name two primary colours.")


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("published")
    done = meshnet_cli("publish", "--out", str(out), timeout_s=300)
    assert done.returncode == 0, done.stderr
    return out


def _nodes(tracker: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{tracker}/v1/nodes", timeout=10).json()["nodes"])


def _wait(tracker: str, ready: Any, what: str, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = _nodes(tracker)
        if ready(nodes):
            return nodes
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s:.0f} s; nodes: {[(n['node_id'], n['layers']) for n in nodes]}")


def _tiles(nodes: list[dict[str, Any]]) -> bool:
    return sorted(n["layers"] for n in nodes) == ["0:10", "10:20", "20:30"]


def _chat(url: str, model: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=24
    )
    return out.choices[0].message.content or ""


@contextlib.contextmanager
def _auto_node(manifest: str, tracker: str, web_seed: str, dest: Path, node_id: str) -> Iterator[Proc]:
    args = ["node", "--manifest", manifest, "--layers", "auto", "--memory-gb", MEMORY_GB, "--tracker", tracker,
            "--web-seed", web_seed, "--dest", str(dest), "--cache-dir", str(dest / "cache"), "--node-id", node_id,
            "--threads", "1", "--ctx", "512", "--max-sessions", "2"]  # fmt: skip
    with meshnet_process(args) as proc:
        yield proc


def _held(dest: Path) -> list[str]:
    return sorted(p.name for p in (dest / NAME).iterdir())


def test_auto_nodes_cover_the_model_fetch_only_their_files_and_refill_a_hole(
    published: Path, tmp_path: Path, server: Proc, model_id: str
) -> None:
    manifest = str(published / "manifest.json")
    files = {str(r): sorted(names) for r, names in load_source(manifest)[0].layer_map}
    expected = {p: _chat(server.url, model_id, p) for p in PROMPTS}
    with contextlib.ExitStack() as stack:
        web = stack.enter_context(contextlib.closing(RangeServer(published).start()))
        tracker = stack.enter_context(
            meshnet_process(["tracker", "--port", "0", "--db", f"sqlite:///{tmp_path / 'tracker.db'}"])
        ).url
        dests = {f"n{i}": tmp_path / f"n{i}" for i in range(4)}
        # Three nodes start at the same moment: the tracker's reservations give them one range each.
        procs = start_together(
            stack, {k: _auto_node(manifest, tracker, web.url, dests[k], k) for k in ("n0", "n1", "n2")}
        )
        nodes = _wait(tracker, lambda ns: len(ns) == 3, "three auto nodes did not register", 120)
        assert _tiles(nodes), nodes
        layers = {n["node_id"]: n["layers"] for n in nodes}
        for node_id, proc in procs.items():
            assert f"the tracker placed node {node_id} on layers {layers[node_id]}" in proc.output()
            assert _held(dests[node_id]) == files[layers[node_id]]  # only its own range's files
        assert all(n["placement"]["mode"] == "auto" for n in nodes)
        gateway = stack.enter_context(meshnet_process(["gateway", "--tracker", tracker, "--port", "0"]))
        assert {p: _chat(gateway.url, model_id, p) for p in PROMPTS} == expected

        # A fourth node: every layer is served, so it doubles the span with the least throughput.
        spare = stack.enter_context(_auto_node(manifest, tracker, web.url, dests["n3"], "n3"))
        nodes = _wait(tracker, lambda ns: len(ns) == 4, "the fourth node did not register", 60)
        doubled = next(n["layers"] for n in nodes if n["node_id"] == "n3")
        assert "have the least throughput" in spare.output()
        # The node of another range leaves for good (SIGKILL: no goodbye); after its TTL and the
        # hole's grace, one of the two nodes serving `doubled` is told to move there, drains and reloads.
        victim = next(k for k, v in layers.items() if v != doubled)
        procs[victim].popen.send_signal(signal.SIGKILL)
        procs[victim].popen.wait(10)
        nodes = _wait(
            tracker,
            lambda ns: len(ns) == 3 and _tiles(ns) and any(n["placement"]["moves"] == 1 for n in ns),
            "no node moved to the hole",
            90,
        )
        mover = next(n for n in nodes if n["placement"]["moves"] == 1)
        assert mover["layers"] == layers[victim] and mover["placement"]["moving_to"] is None
        assert f"moved {doubled} -> {layers[victim]}" in mover["placement"]["events"][-1]
        mover_proc = spare if mover["node_id"] == "n3" else procs[mover["node_id"]]
        assert re.search(rf"drained; moving from layers {doubled} to {layers[victim]}", mover_proc.output())
        assert set(files[layers[victim]]) <= set(_held(dests[mover["node_id"]]))
        assert {p: _chat(gateway.url, model_id, p) for p in PROMPTS} == expected


def test_meshnet_ups_nodes_are_placed_by_the_tracker_on_the_equal_split(
    swarm: Proc, server: Proc, model_id: str
) -> None:
    """``meshnet up`` (the shared swarm): its nodes start with ``--layers auto`` and the tracker puts
    them on the equal split it always had; the route gives serve's text."""
    with admin_client(swarm) as admin:
        nodes = admin.get(f"{tracker_url(swarm)}/v1/nodes").json()["nodes"]
    assert sorted(n["layers"] for n in nodes) == ["0:10", "10:20", "20:30"]
    assert all(n["placement"]["mode"] == "auto" and n["placement"]["moves"] == 0 for n in nodes)
    logs = re.search(r"\(logs in (\S+)\)", swarm.output())
    assert logs is not None, swarm.output()
    for n in nodes:
        log = (Path(logs.group(1)) / f"{n['node_id']}.log").read_text()
        assert f"the tracker placed node {n['node_id']} on layers {n['layers']}" in log
    prompt = PROMPTS[0]
    assert _chat(swarm.url, model_id, prompt) == _chat(server.url, model_id, prompt)
