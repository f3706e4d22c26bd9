"""Context that fits, and one model identity per route: the pure decisions, then the tracker's HTTP surface.

- ``choose_context``: the trained context, capped at 131,072, lowered to the KV budget, ``--ctx`` checked.
- ``select_routes``: a node whose per-session context cannot hold the request is never chosen; nodes of
  different identities are never chained; with no route left the ``Overloaded`` says which limit.
- ``equivalent_nodes``: a repair never brings in another identity.
- The tracker app: a 400 past the model's or the product's cap, a 503 with Retry-After when no route
  has room or one identity, hops that say what they run.
- ``gguf_identity``: one file, one identity; other weights, another.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from meshnet.artifacts.identity import gguf_identity
from meshnet.backends.gpu import GpuDevice
from meshnet.config import PRODUCT_CONTEXT_CAP
from meshnet.errors import InvalidRequest, Overloaded
from meshnet.layers import LayerRange
from meshnet.node.context import CONTEXT_ALIGN, choose_context, kv_budget
from meshnet.tracker.app import create_tracker_app
from meshnet.tracker.db import TrackerDB
from meshnet.tracker.repair import PinnedHop, equivalent_nodes, plan_repair
from meshnet.tracker.routing import NodeRecord, RouteRequest, select_routes
from tests.long_models import tiny_long_llama

MODEL = "m"
Q4, Q2 = "gguf-sha256:" + "4" * 64, "gguf-sha256:" + "2" * 64


# -- choose_context -----------------------------------------------------------------------------
def test_the_default_context_is_the_trained_one_capped_at_the_product_cap():
    roomy = 1 << 40
    assert choose_context(trained=32_768, kv_bytes_per_token=1000, max_sessions=4, budget_bytes=roomy).per_session == (
        32_768
    )
    million = choose_context(trained=1_048_576, kv_bytes_per_token=1000, max_sessions=4, budget_bytes=roomy)
    assert million.per_session == PRODUCT_CONTEXT_CAP == 131_072
    assert "product cap" in million.reason
    unknown = choose_context(trained=8192, kv_bytes_per_token=0, max_sessions=4, budget_bytes=None)
    assert unknown.per_session == 8192 and "no KV budget" in unknown.reason


def test_the_default_context_is_lowered_to_what_the_kv_budget_holds_for_the_nodes_layers():
    # 4 sessions x 1,000 bytes/token in 100 MB: 26,214 positions, rounded down to llama.cpp's padding.
    choice = choose_context(trained=32_768, kv_bytes_per_token=1000, max_sessions=4, budget_bytes=100 * 2**20)
    assert choice.per_session == 26_112 and choice.per_session % CONTEXT_ALIGN == 0
    assert "lowered from 32,768" in choice.reason and "--max-sessions 4" in choice.reason
    assert "1,000 KV bytes/token" in choice.reason
    with pytest.raises(InvalidRequest, match="holds only 10 positions per session"):
        choose_context(trained=32_768, kv_bytes_per_token=1000, max_sessions=4, budget_bytes=40_000)


GIB = 2**30


def _gpu(free_gib: float, *, integrated: bool = False) -> GpuDevice:
    return GpuDevice("CUDA0", "NVIDIA H200", 141 * GIB, int(free_gib * GIB), integrated)


def test_without_offload_the_kv_budget_is_half_the_host_memory_available():
    assert kv_budget(10 * GIB) == (5 * GIB, "50% of the memory available now")
    assert kv_budget(None) == (None, "50% of the memory available now")
    # a GPU present but no layer offloaded, or only an integrated GPU (host memory): the host's share
    weights = [GIB] * 4
    assert kv_budget(10 * GIB, [_gpu(100)], gpu_layers=0, layer_weights=weights)[0] == 5 * GIB
    assert kv_budget(10 * GIB, [_gpu(100, integrated=True)], gpu_layers=-1, layer_weights=weights)[0] == 5 * GIB


def test_every_layer_offloaded_puts_the_kv_budget_in_the_gpus_free_memory_after_their_weights():
    budget, source = kv_budget(4 * GIB, [_gpu(20)], gpu_layers=-1, layer_weights=[GIB] * 4)
    assert budget == 8 * GIB  # half of the 16 GiB left after 4 GiB of weights: the host's 4 GiB does not count
    assert "NVIDIA H200" in source and "after 4 layers' weights" in source
    two = kv_budget(4 * GIB, [_gpu(10), _gpu(10)], gpu_layers=-1, layer_weights=[GIB] * 4)[0]
    assert two == 8 * GIB  # llama.cpp splits the layers over both
    assert kv_budget(4 * GIB, [_gpu(3)], gpu_layers=-1, layer_weights=[GIB] * 4)[0] == 0  # weights do not fit


def test_some_layers_offloaded_split_the_kv_and_the_scarcer_memory_bounds_it():
    # the last 2 of 4 layers on the GPU: half of the KV there, half in host memory
    weights = [GIB, GIB, 3 * GIB, 3 * GIB]
    budget, source = kv_budget(4 * GIB, [_gpu(26)], gpu_layers=2, layer_weights=weights)
    assert budget == 4 * GIB  # the host's 2 GiB is half of it; the GPU's (26 - 6) / 2 = 10 GiB allows 20
    assert "2 of 4 layers' KV" in source and "the other 2" in source
    assert kv_budget(100 * GIB, [_gpu(26)], gpu_layers=2, layer_weights=weights)[0] == 20 * GIB  # the GPU bounds it
    assert kv_budget(4 * GIB, [_gpu(26)], gpu_layers=9, layer_weights=weights)[0] == 9 * GIB  # more than it has: all


def test_an_explicit_ctx_is_taken_but_never_past_the_trained_context():
    asked = choose_context(trained=8192, kv_bytes_per_token=1000, max_sessions=4, budget_bytes=1, asked=2048)
    assert asked.per_session == 2048 and "--ctx 2,048 as given" in asked.reason
    with pytest.raises(InvalidRequest, match=r"--ctx 9,000 exceeds the context cap 8,192 \(the model's trained"):
        choose_context(trained=8192, kv_bytes_per_token=1000, max_sessions=4, budget_bytes=None, asked=9000)
    with pytest.raises(InvalidRequest, match="exceeds the context cap 131,072"):
        choose_context(trained=1 << 20, kv_bytes_per_token=1, max_sessions=1, budget_bytes=None, asked=131_073)


# -- select_routes: room and identity -------------------------------------------------------------
def node(node_id: str, layers: str, *, total: int = 12, **fields: Any) -> NodeRecord:
    base = NodeRecord(
        node_id=node_id,
        url=f"http://{node_id}",
        model=MODEL,
        layers=LayerRange.parse(layers, total),
        backend="fake",
        kv_bytes_free=10**9,
        last_seen=0.0,
        prefill_tps=1000.0,
        decode_tps=50.0,
        warm=True,
        identity=Q4,
        quantization="Q4_1",
        max_positions=4096,
        numerics="fake 1",
    )
    return replace(base, **fields)


def best(nodes: list[NodeRecord], **request: int) -> list[str]:
    return [n.node_id for n in select_routes(nodes, MODEL, request=RouteRequest(**request))[0].nodes]


def test_a_node_whose_context_cannot_hold_the_request_is_never_chosen():
    fast_small = node("fast-small", "6:12", decode_tps=500.0, max_positions=1024)
    slow_roomy = node("slow-roomy", "6:12", decode_tps=5.0, max_positions=8192)
    head = node("h", "0:6")
    assert best([head, fast_small, slow_roomy], prefill_tokens=100, decode_tokens=100, positions=200) == [
        "h",
        "fast-small",
    ]
    # 2,000 positions: the fast node cannot hold them, however fast it is.
    assert best([head, fast_small, slow_roomy], prefill_tokens=1000, decode_tokens=1000, positions=2000) == [
        "h",
        "slow-roomy",
    ]
    unknown = node("unknown", "6:12", max_positions=0)  # an older node that did not say: not held against it
    assert best([node("h", "0:6", max_positions=131_072), unknown], positions=100_000) == ["h", "unknown"]


def test_no_route_with_room_is_an_overload_naming_the_limit():
    nodes = [node("h", "0:6", max_positions=8192), node("t", "6:12", max_positions=1024)]
    with pytest.raises(Overloaded) as caught:
        select_routes(nodes, MODEL, request=RouteRequest(1000, 1000, positions=2000))
    message = caught.value.message
    assert "no route of 'm' has room for 2,000 positions per session" in message
    assert "1,024 on node t, layers 6:12" in message
    assert caught.value.retry_after_s
    with pytest.raises(Overloaded, match="room for 2,000"):  # every node too small
        select_routes([node("t", "0:12", max_positions=1024)], MODEL, request=RouteRequest(positions=2000))


def test_nodes_of_different_identities_are_never_chained():
    head, tail = node("h", "0:4"), node("t", "8:12")
    requantized = node("q2", "4:8", identity=Q2, quantization="Q2_K", decode_tps=5000.0)  # faster than anything
    with pytest.raises(Overloaded) as caught:
        select_routes([head, requantized, tail], MODEL)
    message = caught.value.message
    assert "nodes of different model identities are never chained into one route" in message
    assert "Q2_K): q2 [4:8]" in message and "Q4_1): h [0:4], t [8:12]" in message
    honest = node("m", "4:8", decode_tps=5.0)
    for _ in range(3):
        assert best([head, requantized, tail, honest]) == ["h", "m", "t"]
    # A complete route of the other identity competes on its own: the faster whole route wins.
    whole_q2 = node("q2-whole", "0:12", identity=Q2, quantization="Q2_K", decode_tps=5000.0)
    chosen = select_routes([head, requantized, tail, honest, whole_q2], MODEL, k=3)
    assert [[n.node_id for n in c.nodes] for c in chosen][:1] == [["q2-whole"]]
    assert all(len({n.identity for n in c.nodes}) == 1 for c in chosen)


def test_a_repair_never_brings_in_another_identity():
    route = [
        PinnedHop("h", LayerRange.parse("0:6", 12), "fake 1", identity=Q4),
        PinnedHop("t", LayerRange.parse("6:12", 12), "fake 1", identity=Q4),
    ]
    other = node("q2", "6:12", identity=Q2, quantization="Q2_K")
    same = node("t2", "6:12")
    assert [n.node_id for n in equivalent_nodes(route[1:], [other, same])] == ["t2"]
    assert plan_repair(route, "t", [node("h", "0:6"), other, same], MODEL).nodes[0].node_id == "t2"
    with pytest.raises(Overloaded):
        plan_repair(route, "t", [node("h", "0:6"), other], MODEL)


# -- the tracker app ---------------------------------------------------------------------------
@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    db = TrackerDB(f"sqlite:///{tmp_path}/tracker.db")
    try:
        with TestClient(create_tracker_app(db)) as c:
            yield c
    finally:
        db.close()


def register(client: TestClient, node_id: str, layers: str, **fields: Any) -> None:
    body = {
        "node_id": node_id,
        "url": f"http://{node_id}.local:7000",
        "model": MODEL,
        "layers": layers,
        "total_layers": 12,
        "backend": "fake",
        "kv_bytes_free": 1 << 30,
        "identity": Q4,
        "quantization": "Q4_1",
        "max_positions": 4096,
        "context_length": 8192,
        **fields,
    }
    assert client.post("/v1/nodes", json=body).status_code in (200, 201)


def test_the_tracker_refuses_past_the_models_or_the_products_cap_with_a_400(client: TestClient):
    register(client, "a", "0:12", max_positions=131_072, context_length=8192)
    past_model = client.post("/v1/sessions", json={"model": MODEL, "prefill_tokens": 8000, "max_tokens": 193})
    assert past_model.status_code == 400, past_model.text
    error = past_model.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    assert "8,193 positions, past the trained context of 'm' (8,192)" in error["message"]
    register(client, "a", "0:12", max_positions=131_072, context_length=1 << 20)
    past_cap = client.post("/v1/sessions", json={"model": MODEL, "prefill_tokens": 131_072, "max_tokens": 1})
    assert past_cap.status_code == 400
    assert "131,073 positions, past the product's context cap (131,072)" in past_cap.json()["error"]["message"]
    fits = client.post("/v1/sessions", json={"model": MODEL, "prefill_tokens": 131_071, "max_tokens": 1})
    assert fits.status_code == 201, fits.text


def test_the_tracker_answers_503_when_no_route_has_room_and_pins_hops_that_say_what_they_run(client: TestClient):
    register(client, "a", "0:6")
    register(client, "b", "6:12", max_positions=1024)
    full = client.post("/v1/sessions", json={"model": MODEL, "prefill_tokens": 1000, "max_tokens": 100})
    assert full.status_code == 503 and int(full.headers["retry-after"]) > 0
    assert "room for 1,100 positions" in full.json()["error"]["message"]
    # Without max_tokens the route must hold the prompt and one token; the gateway stops at its context.
    ok = client.post("/v1/sessions", json={"model": MODEL, "prefill_tokens": 1000})
    assert ok.status_code == 201, ok.text
    hops = ok.json()["hops"]
    assert [(h["identity"], h["quantization"], h["max_positions"]) for h in hops] == [
        (Q4, "Q4_1", 4096),
        (Q4, "Q4_1", 1024),
    ]
    listed = {n["node_id"]: n for n in client.get("/v1/nodes").json()["nodes"]}
    assert (listed["b"]["identity"], listed["b"]["max_positions"], listed["b"]["context_length"]) == (Q4, 1024, 8192)


def test_the_tracker_never_chains_identities_and_names_them_in_its_503(client: TestClient):
    register(client, "a", "0:4")
    register(client, "q2", "4:8", identity=Q2, quantization="Q2_K")
    register(client, "c", "8:12")
    mixed = client.post("/v1/sessions", json={"model": MODEL})
    assert mixed.status_code == 503 and "retry-after" in mixed.headers
    assert "never chained" in mixed.json()["error"]["message"]
    register(client, "b", "4:8")
    for _ in range(3):
        route = client.post("/v1/sessions", json={"model": MODEL}).json()
        assert [h["node_id"] for h in route["hops"]] == ["a", "b", "c"]
    # Latency probes go only to next hops a route could use: nodes of the same identity.
    answer = client.post(
        "/v1/nodes",
        json={"node_id": "a", "url": "http://a.local:7000", "model": MODEL, "layers": "0:4", "total_layers": 12,
              "identity": Q4},
    )  # fmt: skip
    assert answer.json()["next_hops"] == ["http://b.local:7000"]


# -- the identity of a GGUF --------------------------------------------------------------------
def test_a_gguf_identity_is_the_models_and_changes_with_its_weights(tmp_path: Path):
    def write(folder: str, **kwargs: int) -> Path:
        (tmp_path / folder).mkdir()
        return tiny_long_llama(tmp_path / folder / "m.gguf", tokenizer=False, **kwargs)

    one = write("one", context=4096, seed=0)
    copy = write("copy", context=4096, seed=0)  # the same model in another place: the same identity
    reseeded = write("reseeded", context=4096, seed=1)  # same metadata and types, other weights
    longer = write("longer", context=8192, seed=0)  # same weights, other metadata
    identity = gguf_identity(one)
    assert identity.startswith("gguf-sha256:") and len(identity) == len("gguf-sha256:") + 64
    assert gguf_identity(copy) == identity
    assert len({identity, gguf_identity(reseeded), gguf_identity(longer)}) == 3
