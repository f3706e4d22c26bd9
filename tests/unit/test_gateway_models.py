"""Several models behind one gateway: the request's model picks the engine, /v1/models lists what the
swarm routes end to end, unknown models are OpenAI's 404, and models are learned from the tracker."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from meshnet.artifacts.vocab import Publication
from meshnet.backends.fake import FakeEngine
from meshnet.errors import InvalidRequest
from meshnet.gateway import create_app
from meshnet.gateway.catalog import ModelCatalog
from meshnet.gateway.metrics import GatewayMetrics
from meshnet.gateway.telemetry import TelemetryHub
from meshnet.tracker.app import create_tracker_app
from meshnet.tracker.db import TrackerDB
from tests.asgi import serve_in_thread
from tests.unit.test_tracker_models import DIGEST, DOC, TORRENT

pytestmark = pytest.mark.timeout(30)


def engine(model: str, reply: str) -> FakeEngine:
    fake = FakeEngine(reply=reply, n_ctx=256)
    fake.info = dataclasses.replace(fake.info, model_id=model)
    return fake


def chat(client: TestClient, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 40}
    return client.post("/v1/chat/completions", json=body)


def listed(client: TestClient) -> list[str]:
    response = client.get("/v1/models")
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["data"]]


def test_each_request_goes_to_the_engine_of_its_model() -> None:
    a, b = engine("model-a", "Reply of A."), engine("model-b", "Reply of B.")
    with TestClient(create_app(a, more_engines=[b])) as client:
        assert listed(client) == ["model-a", "model-b"]
        assert chat(client, "model-b").json()["choices"][0]["message"]["content"] == "Reply of B."
        assert (a.prefill_calls, b.prefill_calls) == (0, 1)
        answer = chat(client, "model-a").json()
        assert answer["choices"][0]["message"]["content"] == "Reply of A." and answer["model"] == "model-a"
        assert (a.prefill_calls, b.prefill_calls) == (1, 1)


def test_an_unknown_model_is_openais_model_not_found() -> None:
    a = engine("model-a", "A.")
    with TestClient(create_app(a)) as client:
        for response in (chat(client, "gpt-9"), client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})):
            assert response.status_code == 404
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error"
            assert (error["param"], error["code"]) == ("model", "model_not_found")
            assert "'gpt-9'" in error["message"] and "'model-a'" in error["message"]
        assert a.prefill_calls == 0


def node(node_id: str, model: str, layers: str, total: int = 4, manifest: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"node_id": node_id, "url": f"http://{node_id}:7000", "model": model, "layers": layers,
                            "total_layers": total, "backend": "fake"}  # fmt: skip
    return {**body, "manifest": manifest} if manifest else body


@pytest.fixture
def tracker(tmp_path: Path) -> Iterator[str]:
    db = TrackerDB(f"sqlite:///{tmp_path / 't.db'}")
    try:
        with serve_in_thread(create_tracker_app(db)) as url:
            yield url
    finally:
        db.close()


def test_models_list_only_what_live_nodes_route_end_to_end(tracker: str) -> None:
    a, b = engine("model-a", "A."), engine("model-b", "B.")
    with TestClient(create_app(a, swarm_tracker=tracker, more_engines=[b])) as client:
        assert listed(client) == []  # no node yet
        httpx.post(f"{tracker}/v1/nodes", json=node("a1", "model-a", "0:4"), timeout=10).raise_for_status()
        httpx.post(f"{tracker}/v1/nodes", json=node("b1", "model-b", "0:2"), timeout=10).raise_for_status()
        assert listed(client) == ["model-a"]  # model-b misses layers 2:4
        httpx.post(f"{tracker}/v1/nodes", json=node("b2", "model-b", "2:4"), timeout=10).raise_for_status()
        assert listed(client) == ["model-a", "model-b"]
        # A model the swarm routes but this gateway has no vocabulary for is not listed.
        httpx.post(f"{tracker}/v1/nodes", json=node("c1", "model-c", "0:4"), timeout=10).raise_for_status()
        assert listed(client) == ["model-a", "model-b"]


def test_models_are_a_503_while_the_tracker_is_unreachable() -> None:
    with TestClient(create_app(engine("model-a", "A."), swarm_tracker="http://127.0.0.1:9")) as client:
        response = client.get("/v1/models")
        assert response.status_code == 503 and "unreachable" in response.json()["error"]["message"]
        assert response.headers["retry-after"] == "5"


def test_a_model_is_learned_from_the_manifest_its_nodes_hand_the_tracker(tracker: str) -> None:
    learned: list[Publication] = []
    failing = [True]

    def learn(publication: Publication) -> FakeEngine:
        if failing[0]:
            raise InvalidRequest("no source delivered the vocabulary")
        learned.append(publication)
        return engine(publication.manifest.model_id, "Reply of tiny.")

    catalog = ModelCatalog(TelemetryHub(), GatewayMetrics(), tracker=tracker, learn=learn)
    try:
        assert catalog.learn_once() == []  # the tracker knows no model yet
        registered = httpx.post(f"{tracker}/v1/nodes", json=node("t1", "tiny", "0:6", 6, DIGEST), timeout=10).json()
        assert registered["manifest_wanted"] is True
        assert catalog.learn_once() == []  # the tracker holds no publication of it yet
        offer = {"manifest": DOC.decode(), "torrent": base64.b64encode(TORRENT).decode()}
        httpx.post(f"{tracker}/v1/manifests", json=offer, timeout=10).raise_for_status()
        assert catalog.learn_once() == []  # the learner failed: not served, retried later
        failing[0] = False
        assert catalog.learn_once() == []  # ... not at once
        catalog._failed.clear()  # the retry interval has passed
        assert catalog.learn_once() == ["tiny"]
        assert [p.digest for p in learned] == [DIGEST] and learned[0].torrent == TORRENT
        assert catalog.get("tiny").manifest == DIGEST
        assert catalog.learn_once() == []  # served already: not learned twice
    finally:
        catalog.close()


def test_a_manifest_of_another_model_id_is_not_learned(tracker: str) -> None:
    catalog = ModelCatalog(TelemetryHub(), GatewayMetrics(), tracker=tracker, learn=lambda p: engine("x", "X."))
    try:
        # The node calls its model "impostor" but serves the manifest of "tiny".
        httpx.post(f"{tracker}/v1/nodes", json=node("t1", "impostor", "0:6", 6, DIGEST), timeout=10)
        offer = {"manifest": DOC.decode(), "torrent": base64.b64encode(TORRENT).decode()}
        httpx.post(f"{tracker}/v1/manifests", json=offer, timeout=10).raise_for_status()
        assert catalog.learn_once() == []
        assert [e.model_id for e in catalog.entries()] == []
    finally:
        catalog.close()
