"""The tracker's view of models: what is routable end to end, and the publications nodes hand over."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from meshnet.artifacts.manifest import canonical_json, parse_manifest
from meshnet.node.app import create_node_app
from meshnet.node.service import NodeConfig
from meshnet.tracker.app import create_tracker_app
from meshnet.tracker.db import TrackerDB
from meshnet.tracker.models import model_views
from tests.asgi import serve_in_thread
from tests.unit.test_manifest_vocab import TORRENT, with_vocab
from tests.unit.test_node_service import MixShard
from tests.unit.test_tracker import rec

DOC = canonical_json(with_vocab())
DIGEST = parse_manifest(DOC).digest


def test_a_model_is_routable_only_when_live_nodes_cover_every_layer() -> None:
    nodes = [rec("a", "0:6", model="x"), rec("b", "6:12", model="x"), rec("c", "0:4", model="y", total=8)]
    nodes.append(rec("d", "0:6", model="z"))
    views = {v.model: v for v in model_views(nodes)}
    assert sorted(views) == ["x", "y", "z"]
    assert views["x"].routable and views["x"].reason is None and views["x"].nodes == 2
    assert views["x"].total_layers == 12
    assert not views["y"].routable and "no node serves layers 4:8" in (views["y"].reason or "")
    assert not views["z"].routable and "6:12" in (views["z"].reason or "")


def registration(node_id: str, layers: str, *, manifest: str | None = DIGEST, model: str = "tiny") -> dict[str, Any]:
    body: dict[str, Any] = {"node_id": node_id, "url": f"http://{node_id}:7000", "model": model, "layers": layers,
                            "total_layers": 6, "backend": "fake"}  # fmt: skip
    if manifest is not None:
        body["manifest"] = manifest
    return body


def offer(doc: bytes = DOC, torrent: bytes = TORRENT) -> dict[str, str]:
    return {"manifest": doc.decode(), "torrent": base64.b64encode(torrent).decode()}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    db = TrackerDB(f"sqlite:///{tmp_path / 't.db'}")
    try:
        with TestClient(create_tracker_app(db)) as c:
            yield c
    finally:
        db.close()


def test_a_node_hands_over_its_manifest_and_gateways_read_it_back(client: TestClient) -> None:
    first = client.post("/v1/nodes", json=registration("h", "0:3")).json()
    assert first["manifest_wanted"] is True
    listed = client.get("/v1/models").json()["models"]
    assert listed == [{"id": "tiny", "total_layers": 6, "nodes": 1, "routable": False, "reason": listed[0]["reason"],
                       "manifests": [{"digest": DIGEST, "held": False}]}]  # fmt: skip
    assert "no node serves layers 3:6" in listed[0]["reason"]
    kept = client.post("/v1/manifests", json=offer())
    assert kept.status_code == 201, kept.text
    assert kept.json() == {"manifest": DIGEST, "model": "tiny"}
    assert "manifest_wanted" not in client.post("/v1/nodes", json=registration("t", "3:6")).json()
    (model,) = client.get("/v1/models").json()["models"]
    assert (model["routable"], model["reason"], model["manifests"]) == (True, None, [{"digest": DIGEST, "held": True}])
    document = client.get(f"/v1/manifests/{DIGEST}/manifest.json")
    assert document.status_code == 200 and document.content == DOC
    assert client.get(f"/v1/manifests/{DIGEST}/model.torrent").content == TORRENT
    assert client.get(f"/v1/manifests/{DIGEST}/other.txt").status_code == 404
    assert client.get(f"/v1/manifests/sha256:{'0' * 64}/manifest.json").status_code == 404


def test_a_publication_no_live_node_serves_or_that_does_not_verify_is_refused(client: TestClient) -> None:
    refused = client.post("/v1/manifests", json=offer())
    assert refused.status_code == 400 and "no live node advertises" in refused.json()["error"]["message"]
    client.post("/v1/nodes", json=registration("h", "0:6"))
    tampered = client.post("/v1/manifests", json=offer(torrent=TORRENT + b"x"))
    assert tampered.status_code == 400
    assert tampered.json()["error"]["param"] == "torrent.sha256"
    assert client.post("/v1/manifests", json={"manifest": "{}", "torrent": "!!"}).status_code == 400
    bad = client.post("/v1/manifests", json=offer(doc=DOC.replace(b'"layers":6', b'"layers":7')))
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_manifest"
    assert client.get(f"/v1/manifests/{DIGEST}/manifest.json").status_code == 404  # nothing was kept


def test_a_node_without_a_manifest_is_not_asked_for_one(client: TestClient) -> None:
    answer = client.post("/v1/nodes", json=registration("h", "0:6", manifest=None)).json()
    assert "manifest_wanted" not in answer
    (model,) = client.get("/v1/models").json()["models"]
    assert model["routable"] and model["manifests"] == []


def test_a_node_serving_from_a_manifest_hands_it_over_when_the_tracker_asks(tmp_path: Path) -> None:
    db = TrackerDB(f"sqlite:///{tmp_path / 't.db'}")
    try:
        with serve_in_thread(create_tracker_app(db)) as tracker:
            config = NodeConfig(node_id="n", url="http://127.0.0.1:7000", tracker_url=tracker, heartbeat_s=0.2,
                                advert=(("manifest", DIGEST),), publication=(DOC, TORRENT))  # fmt: skip
            with TestClient(create_node_app(MixShard("0:12"), config)):
                deadline = time.monotonic() + 10
                while True:
                    document = httpx.get(f"{tracker}/v1/manifests/{DIGEST}/manifest.json", timeout=10)
                    if document.status_code == 200:
                        break
                    assert time.monotonic() < deadline, "the node never handed its manifest over"
                    time.sleep(0.1)
                assert document.content == DOC
                (model,) = httpx.get(f"{tracker}/v1/models", timeout=10).json()["models"]
                assert model["manifests"] == [{"digest": DIGEST, "held": True}] and model["routable"]
    finally:
        db.close()
