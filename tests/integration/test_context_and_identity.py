"""Context that fits the model and the machine, and one model identity per route, on real processes.

- A tiny llama trained for 131,072 positions (tests.long_models) runs a 131,072-token session through
  a two-node llama.cpp route with every node on its default context (the trained one); a request of
  131,073 positions is refused with a 400 before any compute, naming the cap.
- A node whose context is smaller than a request is never routed to: with no route left the client
  gets a 503 with Retry-After naming the limit, before any compute.
- A node serving the bundled model requantized to Q8_0 (same file name, same model id) is never
  chained between Q4_1 nodes: with no Q4_1 node for its layers the client gets a clear 503, and once
  one joins every route runs Q4_1 only (telemetry and /v1/swarm say what each hop runs).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from meshnet.artifacts.bundled import bundled_gguf
from tests.long_models import requantized, tiny_long_llama
from tests.procs import Proc, meshnet_process

pytestmark = pytest.mark.real

LONG = 131_072
BUNDLED = "SmolLM2-135M-Instruct.Q4_1"
NO_EOG = {"0": -100.0, "2": -100.0, "4": -100.0}  # the bundled tokenizer's end-of-generation tokens


def _wait_nodes(tracker: Proc, count: int, timeout_s: float = 120) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes: list[dict[str, object]] = httpx.get(f"{tracker.url}/v1/nodes", timeout=10).json()["nodes"]
        if len(nodes) >= count:
            return nodes
        assert time.monotonic() < deadline, f"only {len(nodes)} of {count} nodes registered"
        time.sleep(0.2)


def _swarm(tmp_path: Path, stack: ExitStack) -> Proc:
    db = f"sqlite:///{tmp_path}/tracker.db"
    return stack.enter_context(meshnet_process(["tracker", "--port", "0", "--db", db]))


def _node(stack: ExitStack, tracker: Proc, gguf: Path, layers: str, *extra: str) -> Proc:
    args = ["node", "--gguf", str(gguf), "--layers", layers, "--threads", "1", "--tracker", tracker.url]
    args += ["--max-sessions", "1", "--session-ttl", "120", *extra]
    return stack.enter_context(meshnet_process(args))


def _gateway(stack: ExitStack, tracker: Proc, gguf: Path, *extra: str) -> Proc:
    args = ["gateway", "--gguf", str(gguf), "--tracker", tracker.url, "--port", "0", *extra]
    return stack.enter_context(meshnet_process(args))


@pytest.fixture(scope="module")
def long_gguf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tiny_long_llama(tmp_path_factory.mktemp("long") / "tiny-long-128k.gguf")


def test_a_131072_token_session_runs_through_a_route_and_131073_is_refused(tmp_path: Path, long_gguf: Path) -> None:
    with ExitStack() as stack:
        tracker = _swarm(tmp_path, stack)
        head = _node(stack, tracker, long_gguf, "0:1")
        _node(stack, tracker, long_gguf, "1:2")
        gateway = _gateway(stack, tracker, long_gguf, "--prefill-chunk", "2048", "--speculative", "off")
        nodes = _wait_nodes(tracker, 2)
        # No --ctx: the trained context, said at start-up and advertised with one identity for both ranges.
        assert "context 131,072 positions per session: the model's trained context 131,072" in head.output()
        assert {n["max_positions"] for n in nodes} == {LONG}
        assert {n["context_length"] for n in nodes} == {LONG}
        [identity] = {n["identity"] for n in nodes}
        assert isinstance(identity, str) and identity.startswith("gguf-sha256:")
        model = long_gguf.stem
        prompt = [100 + (i * 7919) % 40_000 for i in range(LONG - 8)]
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logit_bias": NO_EOG}
        began = time.monotonic()
        answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=1800)
        took = time.monotonic() - began
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (LONG - 8, 8, LONG)
        print(f"131,072-token session through 2 llama.cpp nodes: {took:.1f} s")
        # One position more: refused before any compute, naming the cap, in OpenAI's error shape.
        over = httpx.post(f"{gateway.url}/v1/completions", json={**body, "max_tokens": 9}, timeout=120)
        assert over.status_code == 400, over.text
        error = over.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert "131,073" in error["message"] or "131073" in error["message"], error
        assert "131072" in error["message"] or "131,072" in error["message"], error
        # The tracker refuses it too (a gateway of another --ctx cannot get past the model's cap).
        session = {"model": model, "prefill_tokens": LONG - 8, "max_tokens": 9}
        refused = httpx.post(f"{tracker.url}/v1/sessions", json=session, timeout=10)
        assert refused.status_code == 400 and "131,073 positions" in refused.json()["error"]["message"]
        health = httpx.get(f"{head.url}/v1/health", timeout=10).json()
        assert health["sessions"] == 0  # nothing was opened for the refused requests


def test_a_node_too_small_for_a_request_is_never_routed_to(tmp_path: Path) -> None:
    with ExitStack() as stack:
        tracker = _swarm(tmp_path, stack)
        roomy = ["--ctx", "1024"]
        _node(stack, tracker, bundled_gguf(), "0:15", *roomy)
        small = _node(stack, tracker, bundled_gguf(), "15:30", "--ctx", "256")
        gateway = _gateway(stack, tracker, bundled_gguf(), "--speculative", "off")
        _wait_nodes(tracker, 2)
        body = {"model": BUNDLED, "prompt": "Once upon a time", "temperature": 0}
        fits = httpx.post(f"{gateway.url}/v1/completions", json={**body, "max_tokens": 8}, timeout=120)
        assert fits.status_code == 200, fits.text
        over = httpx.post(f"{gateway.url}/v1/completions", json={**body, "max_tokens": 600}, timeout=120)
        assert over.status_code == 503, over.text
        assert int(over.headers["retry-after"]) > 0
        message = over.json()["error"]["message"]
        assert "room for" in message and "256" in message and small.url.rsplit(":", 1)[1] in message, message
        health = httpx.get(f"{small.url}/v1/health", timeout=10).json()
        assert health["sessions"] == 0


def _route_of(gateway: Proc, answer: httpx.Response) -> list[dict[str, object]]:
    """What each hop ran, from the generation's telemetry: route.accepted and model.selected agree."""
    gid = answer.headers["x-meshnet-generation-id"]
    events = httpx.get(f"{gateway.url}/v1/generations/{gid}/events", timeout=30).text
    found = {}
    for line in events.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            found[event["type"]] = event
    accepted, selected = found["route.accepted"]["nodes"], found["model.selected"]["hops"]
    assert [(h["identity"], h["quantization"]) for h in accepted] == [
        (h["identity"], h["quantization"]) for h in selected
    ]
    return list(accepted)


def test_a_node_of_another_quantization_is_never_chained(tmp_path: Path) -> None:
    q8 = tmp_path / "q8"
    q8.mkdir()
    copy = requantized(q8 / f"{BUNDLED}.gguf", "Q8_0")  # the same file name: the same model id
    with ExitStack() as stack:
        tracker = _swarm(tmp_path, stack)
        small = ["--ctx", "512"]
        _node(stack, tracker, bundled_gguf(), "0:10", *small)
        _node(stack, tracker, copy, "10:20", *small)
        _node(stack, tracker, bundled_gguf(), "20:30", *small)
        gateway = _gateway(stack, tracker, bundled_gguf(), "--speculative", "off", "--ctx", "512")
        nodes = _wait_nodes(tracker, 3)
        assert len({n["identity"] for n in nodes}) == 2
        assert {n["quantization"] for n in nodes} == {"Q4_1", "Q8_0"}
        body = {"model": BUNDLED, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        mixed = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120)
        assert mixed.status_code == 503, mixed.text
        assert "retry-after" in mixed.headers
        message = mixed.json()["error"]["message"]
        assert "model identities are never chained" in message and "Q8_0" in message, message
        _node(stack, tracker, bundled_gguf(), "10:20", *small)
        _wait_nodes(tracker, 4)
        texts = set()
        for _ in range(3):
            answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            texts.add(answer.json()["choices"][0]["text"])
            route = _route_of(gateway, answer)
            assert [h["quantization"] for h in route] == ["Q4_1"] * 3
            assert len({h["identity"] for h in route}) == 1
        assert len(texts) == 1
        swarm = httpx.get(f"{gateway.url}/v1/swarm", timeout=30).json()
        assert {(n["quantization"], n["identity"] is not None) for n in swarm["nodes"]} == {
            ("Q4_1", True),
            ("Q8_0", True),
        }
