"""A lying tail on a real swarm: a token id outside the vocabulary is a failed hop, repaired with identical
text; the gateway (whose detokenizer aborts the process on such an id) never sees it.

The liar is a member that forwards every request to a real tail but rewrites one decode answer. It
advertises a speed no honest node has, so the tracker puts it on the route.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.asgi import serve_in_thread
from tests.procs import meshnet_process

pytestmark = pytest.mark.real

MODEL = "SmolLM2-135M-Instruct.Q4_1"
OUT_OF_VOCABULARY = 10**9
_HOP_HEADERS_DROPPED = ("host", "content-length", "transfer-encoding", "connection")


class LyingTail:
    """Forwards to ``backend``; the ``lie_at``-th decode or verify answer names a token no vocabulary has."""

    def __init__(self, backend: str, lie_at: int) -> None:
        self.backend = backend
        self.lie_at = lie_at
        self.steps = 0
        self.lied = False
        self.app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST", "DELETE"])])

    async def forward(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS_DROPPED}
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.request(
                request.method, f"{self.backend}{request.url.path}", content=await request.body(), headers=headers
            )
        body = answer.content
        if answer.status_code == 200 and request.url.path.endswith(("/decode-step", "/verify")):
            self.steps += 1
            if self.steps == self.lie_at:
                data = answer.json()
                if "tokens" in data:
                    data["tokens"][0] = OUT_OF_VOCABULARY
                else:
                    data["token"] = OUT_OF_VOCABULARY
                body, self.lied = json.dumps(data).encode(), True
        return Response(body, status_code=answer.status_code, media_type=answer.headers.get("content-type"))


def wait_nodes(tracker: str, names: set[str]) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + 120
    while True:
        nodes = {n["node_id"]: n for n in httpx.get(f"{tracker}/v1/nodes", timeout=10).json()["nodes"]}
        if names <= set(nodes):
            return nodes
        assert time.monotonic() < deadline, f"nodes {sorted(names - set(nodes))} never registered"
        time.sleep(0.2)


def test_a_tail_answering_a_token_outside_the_vocabulary_is_repaired_and_the_text_is_unchanged(tmp_path) -> None:
    db = f"sqlite:///{tmp_path}/tracker.db"
    with meshnet_process(["tracker", "--port", "0", "--db", db]) as tracker:
        common = ["--threads", "1", "--ctx", "512"]
        with (
            meshnet_process(["node", "--layers", "0:15", "--node-id", "head", "--tracker", tracker.url, *common]),
            meshnet_process(["node", "--layers", "15:30", "--node-id", "honest", "--tracker", tracker.url, *common]),
            meshnet_process(["node", "--layers", "15:30", "--node-id", "liar", *common]) as backend,
            meshnet_process(["gateway", "--tracker", tracker.url, "--port", "0", "--ctx", "512"]) as gateway,
        ):
            honest = wait_nodes(tracker.url, {"head", "honest"})["honest"]
            liar = LyingTail(backend.url, lie_at=3)
            with serve_in_thread(liar.app) as liar_url:
                # Same numerics as the honest tail (so it may replace the liar exactly), absurdly fast.
                advert = {**honest, "node_id": "liar", "url": liar_url, "decode_tps": 1e6, "prefill_tps": 1e6}
                advert.update(idle_s=0.0, heartbeat_s=15.0)
                assert httpx.post(f"{tracker.url}/v1/nodes", json=advert, timeout=10).status_code in (200, 201)
                body = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 24, "temperature": 0}
                first = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120)
                assert first.status_code == 200, first.text
                gid = first.headers["x-meshnet-generation-id"]
                events = httpx.get(f"{gateway.url}/v1/generations/{gid}/events", timeout=30).text
                retries = [json.loads(line[6:]) for line in events.splitlines() if '"route.retry"' in line]
                assert liar.lied, "the liar was never on the route"
                assert [r["failed_node"] for r in retries] == ["liar"], retries
                assert "vocabulary" in retries[0]["reason"], retries
                # The liar is off the live set now: the same request runs head -> honest, undisturbed.
                again = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120)
                assert again.status_code == 200, again.text
                assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
            assert gateway.popen.poll() is None
