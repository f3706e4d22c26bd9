"""Lying hops on a real swarm.

- A tail answering a token id outside the vocabulary is a failed hop, repaired with identical text;
  the gateway (whose detokenizer aborts the process on such an id) never sees it.
- A head that changes the tail's token in the answer it relays, or rewrites the tail's entry, is
  caught on that answer by the entries' signatures (protocol.signing): the generation stops with
  ``route_inconsistent``, and no token of the forged answer reaches the client.
- A tail that signs another token than the distribution it committed to gives with the gateway's
  seed (sampling.check_draw) is a failed tail, repaired with identical text, greedy or sampled.

The liar is a member that forwards every request to a real node (which signs its entries with its
own key, advertised by the liar) but rewrites answers. It advertises a speed no honest node has,
so the tracker puts it on the route.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from meshnet.protocol.messages import answer_from_json
from meshnet.protocol.signing import HopKey
from tests.asgi import serve_in_thread
from tests.procs import Proc, meshnet_process

pytestmark = pytest.mark.real

MODEL = "SmolLM2-135M-Instruct.Q4_1"
OUT_OF_VOCABULARY = 10**9
Rewrite = Callable[[str, dict[str, Any]], dict[str, Any] | None]  # (request path, JSON answer) -> changed or None
_HOP_HEADERS_DROPPED = ("host", "content-length", "transfer-encoding", "connection")


class Liar:
    """Forwards every request to ``backend``; ``rewrite`` may change a JSON answer (None: unchanged).
    With a ``key`` it is a tail that signs its lies: every answer it changed is signed anew with the
    key it advertises (protocol.signing); without one its changes keep the backend's signature."""

    def __init__(self, backend: str, rewrite: Rewrite, key: HopKey | None = None) -> None:
        self.backend = backend
        self.rewrite = rewrite
        self.key = key
        self.lied = False
        self.app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST", "DELETE"])])

    async def forward(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS_DROPPED}
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.request(
                request.method, f"{self.backend}{request.url.path}", content=await request.body(), headers=headers
            )
        body = answer.content
        if answer.status_code in (200, 202) and answer.headers.get("content-type", "").startswith("application/json"):
            data = answer.json()
            changed = self.rewrite(request.url.path, data) if answer.status_code == 200 else None
            self.lied = self.lied or changed is not None
            data = data if changed is None else changed
            if self.key is not None and "hops" in data:  # the tail's own entry, signed anew: /v1/sessions/{id}/...
                session = request.url.path.split("/")[3]
                data = self.key.sign_answer(session, answer_from_json(answer.status_code, data)).to_json()
            body = json.dumps(data).encode()
        return Response(body, status_code=answer.status_code, media_type=answer.headers.get("content-type"))

    def public_key(self, backend: str) -> str:
        """The key to advertise: its own, or the backend's whose signatures it passes on."""
        if self.key is not None:
            return self.key.public
        return str(httpx.get(f"{backend}/v1/health", timeout=10).json()["hop_key"])


def out_of_vocabulary_at(step: int) -> Rewrite:
    """The ``step``-th decode or verify answer names a token no vocabulary has."""
    seen = [0]

    def rewrite(path: str, data: dict[str, Any]) -> dict[str, Any] | None:
        if not path.endswith(("/decode-step", "/verify")):
            return None
        seen[0] += 1
        if seen[0] != step:
            return None
        if "tokens" in data:
            data["tokens"][0] = OUT_OF_VOCABULARY
        else:
            data["token"] = OUT_OF_VOCABULARY
        return data

    return rewrite


def wait_nodes(tracker: str, names: set[str]) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + 120
    while True:
        nodes = {n["node_id"]: n for n in httpx.get(f"{tracker}/v1/nodes", timeout=10).json()["nodes"]}
        if names <= set(nodes):
            return nodes
        assert time.monotonic() < deadline, f"nodes {sorted(names - set(nodes))} never registered"
        time.sleep(0.2)


def _billed(tracker: str, session: str, want: set[str]) -> set[str]:
    """The nodes billed for ``session`` once ``want`` are (the gateway's outbox delivers them; bounded wait)."""
    deadline = time.monotonic() + 60
    while True:
        records = httpx.get(f"{tracker}/v1/billing", params={"session_id": session}, timeout=10).json()["records"]
        billed = {r["node_id"] for r in records}
        if want <= billed:
            return billed
        assert time.monotonic() < deadline, f"billed {billed} after 60 s, not yet {want}"
        time.sleep(0.2)


@contextlib.contextmanager
def _swarm(tmp_path: Path, liar_layers: str) -> Iterator[tuple[str, Proc, Proc]]:
    """A tracker with a head (0:15) and a tail (15:30) registered, a gateway, and a node of
    ``liar_layers`` that is not registered: the backend a liar fronts. Yields the tracker's URL, the
    gateway and the backend."""
    db = f"sqlite:///{tmp_path}/tracker.db"
    with meshnet_process(["tracker", "--port", "0", "--db", db]) as tracker:
        common = ["--threads", "1", "--ctx", "512"]
        with (
            meshnet_process(["node", "--layers", "0:15", "--node-id", "head", "--tracker", tracker.url, *common]),
            meshnet_process(["node", "--layers", "15:30", "--node-id", "tail", "--tracker", tracker.url, *common]),
            meshnet_process(["node", "--layers", liar_layers, "--node-id", "liar", *common]) as backend,
            meshnet_process(["gateway", "--tracker", tracker.url, "--port", "0", "--ctx", "512"]) as gateway,
        ):
            wait_nodes(tracker.url, {"head", "tail"})
            yield tracker.url, gateway, backend
            assert gateway.popen.poll() is None  # whatever the liar did, the gateway stands


def _register_liar(tracker: str, like: str, liar: Liar, backend: Proc, url: str) -> None:
    """Register the liar at ``url`` as node ``like``'s twin (the same numerics, so that node may
    replace it exactly), absurdly fast, so the tracker routes through it."""
    twin = wait_nodes(tracker, {like})[like]
    advert = {**twin, "node_id": "liar", "url": url, "decode_tps": 1e6, "prefill_tps": 1e6}
    advert.update(hop_key=liar.public_key(backend.url), idle_s=0.0, heartbeat_s=15.0)
    assert httpx.post(f"{tracker}/v1/nodes", json=advert, timeout=10).status_code in (200, 201)


def _a_lying_tail_is_repaired(tmp_path: Path, rewrite: Rewrite, body: dict[str, Any], reason: tuple[str, ...]) -> None:
    """A route head -> liar, where the liar is a tail that signs its lies (``rewrite``), and an honest
    tail of the same numerics beside it: ``body``'s completion is repaired once, around the liar only,
    for a ``reason`` that names one of the words given, and its text is the honest route's."""
    with _swarm(tmp_path, "15:30") as (tracker, gateway, backend):
        liar = Liar(backend.url, rewrite, key=HopKey.generate())
        with serve_in_thread(liar.app) as liar_url:
            _register_liar(tracker, "tail", liar, backend, liar_url)
            first = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120)
            assert first.status_code == 200, first.text
            gid = first.headers["x-meshnet-generation-id"]
            events = httpx.get(f"{gateway.url}/v1/generations/{gid}/events", timeout=30).text
            retries = [json.loads(line[6:]) for line in events.splitlines() if '"route.retry"' in line]
            assert liar.lied, "the liar was never on the route"
            assert [r["failed_node"] for r in retries] == ["liar"], retries
            assert any(word in retries[0]["reason"] for word in reason), retries
            # Caught in an answer it signed: the liar is not paid for the session; the honest hops are.
            session = httpx.get(f"{gateway.url}/v1/generations/{gid}", timeout=10).json()["session_id"]
            billed = _billed(tracker, session, {"head", "tail"})
            assert "liar" not in billed, billed
            # The liar is off the live set now: the same request runs head -> honest, undisturbed.
            again = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120)
            assert again.status_code == 200, again.text
            assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]


def test_a_tail_answering_a_token_outside_the_vocabulary_is_repaired_and_the_text_is_unchanged(tmp_path) -> None:
    body = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 24, "temperature": 0}
    _a_lying_tail_is_repaired(tmp_path, out_of_vocabulary_at(3), body, ("vocabulary",))


def _change_token(path: str, data: dict[str, Any]) -> dict[str, Any] | None:
    """A head that hands the gateway another token than the tail chose (a valid one)."""
    if "token" not in data or not data.get("hops"):
        return None
    data["token"] = data["token"] + 1 if data["token"] < 40 else data["token"] - 1
    return data


def _rewrite_tail_entry(path: str, data: dict[str, Any]) -> dict[str, Any] | None:
    """A head that rewrites the tail's entry in the answer it relays (here: claims the tail took longer)."""
    hops = data.get("hops") or []
    if len(hops) < 2 or "token" not in data:
        return None
    hops[-1]["compute_ms"] = hops[-1]["compute_ms"] + 50.0
    return data


@pytest.mark.parametrize(("rewrite", "caught"), [(_change_token, "answer it vouches for"), (_rewrite_tail_entry, "")],
                         ids=["changed-token", "rewritten-entry"])  # fmt: skip
def test_a_head_that_changes_what_the_tail_answered_is_caught_on_that_answer(
    tmp_path, rewrite: Rewrite, caught: str
) -> None:
    with _swarm(tmp_path, "0:15") as (tracker, gateway, backend):
        liar = Liar(backend.url, rewrite)
        with serve_in_thread(liar.app) as liar_url:
            _register_liar(tracker, "head", liar, backend, liar_url)
            body = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 8, "temperature": 0,
                    "stream": True}  # fmt: skip
            with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=120) as streamed:
                lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
            assert liar.lied, "the liar was never on the route"
            events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
            texts = [e["choices"][0]["text"] for e in events if e.get("choices")]
            assert not "".join(texts), f"text from a forged answer reached the client: {texts}"
            error = next(e["error"] for e in events if "error" in e)
            assert error["code"] == "route_inconsistent", error
            assert "node tail" in error["message"] and caught in error["message"], error


def changed_token_at(step: int) -> Rewrite:
    """The ``step``-th decode answer names another token (a valid one) than the tail drew."""
    seen = [0]

    def rewrite(path: str, data: dict[str, Any]) -> dict[str, Any] | None:
        if not path.endswith("/decode-step") or "token" not in data:
            return None
        seen[0] += 1
        if seen[0] != step:
            return None
        data["token"] = data["token"] + 1 if data["token"] < 40 else data["token"] - 1
        return data

    return rewrite


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_tail_that_signs_another_token_than_its_draw_gives_is_repaired_with_the_same_text(
    tmp_path, temperature: float
) -> None:
    body = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 16, "temperature": temperature,
            "seed": 1234}  # fmt: skip
    _a_lying_tail_is_repaired(tmp_path, changed_token_at(3), body, ("draw", "greedy"))


def _inflate_held(path: str, data: dict[str, Any]) -> dict[str, Any] | None:
    """A tail that signs a receipt for more positions than the route computed (its own entry's ``held``)."""
    hops = data.get("hops") or []
    if "token" not in data or not hops:
        return None
    hops[-1]["held"] = hops[-1]["held"] + 5
    return data


def test_a_tail_that_inflates_its_signed_receipt_is_caught_on_that_answer_and_nothing_is_billed(tmp_path) -> None:
    with _swarm(tmp_path, "15:30") as (tracker, gateway, backend):
        liar = Liar(backend.url, _inflate_held, key=HopKey.generate())
        with serve_in_thread(liar.app) as liar_url:
            _register_liar(tracker, "tail", liar, backend, liar_url)
            body = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 8, "temperature": 0}
            answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120)
            assert liar.lied, "the liar was never on the route"
            assert answer.status_code == 502 and answer.json()["error"]["code"] == "route_inconsistent", answer.text
            assert "positions" in answer.json()["error"]["message"], answer.text
            gid = answer.headers["x-meshnet-generation-id"]
            session = httpx.get(f"{gateway.url}/v1/generations/{gid}", timeout=10).json()["session_id"]
            # The gateway bills nothing for a forged answer; a record would have been spooled and sent
            # at the generation's end, before its answer above.
            time.sleep(2.0)
            records = httpx.get(f"{tracker}/v1/billing", params={"session_id": session}, timeout=10).json()
            assert records["records"] == [], records
