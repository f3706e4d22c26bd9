"""The node advertisement: what a node measures (``node.advert``) and what the tracker keeps of it."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient

import meshnet.tracker.app as tracker_app
from meshnet.backends.shard import F32, I32, KVFormat, SeamSpec, ShardBase, ShardInfo, ShardOutput
from meshnet.ids import SessionId
from meshnet.layers import LayerRange
from meshnet.node.advert import (
    BenchResult,
    LatencyProber,
    SelfBenchmark,
    Traffic,
    advert_fields,
    host_hardware,
)
from meshnet.session.store import StoreLimits
from meshnet.tracker.app import NODE_TTL_S, create_tracker_app
from meshnet.tracker.db import TrackerDB
from meshnet.tracker.reliability import FAILURE_WEIGHT, HALF_LIFE_S, Reliability

# -- node side --------------------------------------------------------------------------------


class _EchoShard(ShardBase[list[int]]):
    """Hidden states pass through unchanged; records every call so the test can check the inputs."""

    def __init__(self, layers: LayerRange, *, max_positions: int = 128, fail_at: int = -1) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, bool, bool]] = []  # (start, n, had tokens, had hidden)
        self.fail_at = fail_at
        self.info = ShardInfo(
            model_id="echo",
            architecture="echo",
            backend="fake",
            layers=layers,
            seam=SeamSpec((4,)),
            n_vocab=100,
            max_positions=max_positions,
            weight_bytes=1234,
            kv=KVFormat("kv", "f32", 32, 0, (32,), "test"),
        )
        self._init_store(StoreLimits(32, budget_bytes=32 * 1000, max_sessions=2, max_positions=max_positions))

    def _forward(
        self, state: list[int], start: int, tokens: I32 | None, hidden: F32 | None, all_logits: bool = False
    ) -> ShardOutput:
        n = len(tokens) if tokens is not None else len(hidden)  # type: ignore[arg-type]
        self.calls.append((start, n, tokens is not None, hidden is not None))
        if len(self.calls) == self.fail_at:
            raise RuntimeError("backend failed")
        state.append(n)
        if self.info.layers.is_tail:
            return ShardOutput(logits=np.zeros(self.info.n_vocab, dtype=np.float32))
        return ShardOutput(hidden=np.zeros((n, 4), dtype=np.float32) if hidden is None else hidden)

    def _new_state(self, sid: SessionId) -> list[int]:
        return []

    def _free_state(self, state: list[int]) -> None:
        state.clear()

    def _truncate_state(self, state: list[int], position: int) -> None:
        pass

    def _dump_state(self, state: list[int], position: int) -> bytes:
        return b""

    def _load_state(self, sid: SessionId, body: bytes, position: int) -> list[int]:
        return []


@pytest.mark.parametrize("layers", ["0:4", "4:8", "8:12", "0:12"])
def test_the_self_benchmark_runs_on_a_scratch_session_with_inputs_of_the_seam_shape(layers: str):
    shard = _EchoShard(LayerRange.parse(layers, 12))
    result = SelfBenchmark(shard).run()
    assert (result.prefill_positions, result.decode_steps) == (32, 8)
    assert result.prefill_tps > 0 and result.decode_tps > 0
    head = shard.info.layers.is_head
    # warm-up chunk, the timed chunk, then one position per decode step, gapless
    assert [(s, n) for s, n, _, _ in shard.calls] == [(0, 8), (8, 32), *((40 + i, 1) for i in range(8))]
    assert all(tok == head and hid == (not head) for _, _, tok, hid in shard.calls)
    assert len(shard.store) == 0  # the scratch session is gone


def test_the_self_benchmark_fits_a_small_context_and_stops_when_asked():
    shard = _EchoShard(LayerRange(0, 12, 12), max_positions=20)
    result = SelfBenchmark(shard).run()
    assert (result.prefill_positions, result.decode_steps) == (6, 6)
    bench = SelfBenchmark(_EchoShard(LayerRange(0, 12, 12)))
    bench.stop()
    assert bench.run().decode_steps == 0


def test_the_self_benchmark_frees_its_session_when_the_backend_fails():
    shard = _EchoShard(LayerRange(0, 12, 12), fail_at=3)
    with pytest.raises(RuntimeError, match="backend failed"):
        SelfBenchmark(shard).run()
    assert len(shard.store) == 0


def test_traffic_counts_the_queue_and_samples_only_uncontended_calls():
    async def scenario() -> Traffic:
        traffic = Traffic()
        with traffic.measure(128, decode=False):
            assert traffic.fields()["queue_depth"] == 1
            await asyncio.sleep(0.01)
        alone = traffic.prefill.per_second
        assert 0 < alone < 128 / 0.01
        with traffic.measure(1, decode=True), traffic.measure(1, decode=True):  # overlapping
            assert traffic.fields()["queue_depth"] == 2
        assert traffic.decode.per_second == 0  # neither ran alone: no sample
        with pytest.raises(RuntimeError), traffic.measure(1, decode=True):
            raise RuntimeError("failed compute")
        assert traffic.decode.per_second == 0  # a failure is no sample either
        assert traffic.fields()["queue_depth"] == 0
        return traffic

    traffic = asyncio.run(scenario())
    assert traffic.fields()["idle_s"] is not None


def test_traffic_speed_is_a_size_weighted_moving_average_seeded_by_the_benchmark():
    traffic = Traffic()
    assert traffic.fields() == {"prefill_tps": 0.0, "decode_tps": 0.0, "queue_depth": 0, "idle_s": None}
    traffic.seed(BenchResult(prefill_positions=32, prefill_s=0.032, decode_steps=8, decode_s=0.08))
    assert traffic.fields()["prefill_tps"] == pytest.approx(1000.0)
    assert traffic.fields()["decode_tps"] == pytest.approx(100.0)
    assert traffic.news.is_set()
    for _ in range(50):
        traffic.decode.add(1, 0.02)  # traffic turns out slower: the average follows
    assert traffic.decode.per_second == pytest.approx(50.0, rel=1e-3)


def test_host_hardware_reports_this_machine_without_importing_torch():
    hw = host_hardware(threads=3)
    ram = {"ram_total_bytes", "ram_available_bytes"}
    assert set(hw) == {"cpu", "logical_cores", "threads", *ram, "gpu", "gpu_memory_bytes"}
    assert hw["threads"] == 3
    assert hw["logical_cores"] >= 1
    assert hw["ram_total_bytes"] > 0


def test_advert_fields():
    shard = _EchoShard(LayerRange(0, 12, 12))
    prober = LatencyProber()
    prober.latency_ms["http://next"] = 1.5
    fields = advert_fields(shard, Traffic(), prober)
    assert fields["kv_bytes_per_token"] == 32
    assert fields["max_positions"] == 128  # the per-session cap: the tracker routes only what fits it
    assert fields["weight_bytes"] == 1234
    assert fields["latency_ms"] == {"http://next": 1.5}


def test_the_prober_takes_the_median_of_a_few_health_checks_and_drops_unreachable_hops():
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.host == "down":
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"status": "ok"})

    async def scenario() -> LatencyProber:
        prober = LatencyProber()
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            prober.latency_ms["http://down"] = 3.0  # measured before, unreachable now
            await prober.probe(client, ["http://up/", "http://down", "ftp://ignored"])
            assert seen.count("http://up/v1/health") == 3
            await prober.probe(client, ["http://up"])  # measured moments ago: not due again
            assert seen.count("http://up/v1/health") == 3
        return prober

    prober = asyncio.run(scenario())
    assert set(prober.latency_ms) == {"http://up"}
    assert prober.latency_ms["http://up"] >= 0


# -- tracker side -----------------------------------------------------------------------------


def test_reliability_counts_missed_heartbeats_and_failures_and_forgives_with_time():
    record = Reliability()
    for t in range(0, 50, 5):
        record.heartbeat(float(t), 5.0)
    assert record.value() == 1.0
    record.heartbeat(45.0 + 5 * 3, 5.0)  # two beats missed (one interval of slack)
    assert record.missed == 2
    assert record.value() == pytest.approx(12 / 14, rel=1e-2)  # (counts decay a little with time)
    record.heartbeat(10_000.0, 5.0)  # a long outage counts as at most three misses
    assert record.missed < 2 + 3 + 1e-9
    assert record.value(now=10_000.0 + 5 * 10) < record.value()  # overdue now: already counted
    fresh = Reliability()
    fresh.heartbeat(0.0, 5.0)
    fresh.failure(1.0, "x" * 1000)
    assert fresh.value() == pytest.approx(2 / (2 + FAILURE_WEIGHT))
    assert fresh.last_failure is not None and len(fresh.last_failure) == 500
    before = fresh.value()
    for t in range(1, 200):  # serving well: the failure fades, heartbeats add up
        fresh.heartbeat(1.0 + t * HALF_LIFE_S / 50, HALF_LIFE_S / 40)
    assert fresh.failures < 0.1
    assert fresh.value() > before + 0.5


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1_000_000.0]
    monkeypatch.setattr(tracker_app, "time", types.SimpleNamespace(time=lambda: now[0]))
    return now


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    db = TrackerDB("sqlite:///" + str(tmp_path / "t.db"))
    try:
        with TestClient(create_tracker_app(db)) as c:
            yield c
    finally:
        db.close()


def registration(node_id: str, layers: str, **fields: Any) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "url": f"http://{node_id}:7000",
        "model": "m",
        "layers": layers,
        "total_layers": 12,
        **fields,
    }


ADVERT = {
    "quantization": "Q8_0",
    "hardware": {
        "cpu": "Some CPU",
        "logical_cores": 16,
        "threads": 8,
        "ram_total_bytes": 2**35,
        "ram_available_bytes": 2**34,
        "gpu": None,
        "gpu_memory_bytes": None,
    },
    "prefill_tps": 900.5,
    "decode_tps": 42.0,
    "queue_depth": 2,
    "kv_bytes_per_token": 4096,
    "latency_ms": {"http://b:7000/": 0.75},
    "idle_s": 3.0,
    "weight_bytes": 10**8,
    "heartbeat_s": 5.0,
    "manifest": "sha256:abc",
    "files": ["model-0-6.gguf", "embed.npy"],
}


def test_the_advertisement_is_stored_and_listed(client: TestClient, clock: list[float]):
    assert client.post("/v1/nodes", json=registration("a", "0:6", **ADVERT)).status_code == 201
    [listed] = client.get("/v1/nodes").json()["nodes"]
    expected = {**ADVERT, "latency_ms": {"http://b:7000": 0.75}, "warm": True, "reliability": 1.0}
    del expected["idle_s"], expected["heartbeat_s"]
    assert {k: listed[k] for k in expected} == expected


def test_a_node_idle_for_long_or_never_benchmarked_is_cold(client: TestClient, clock: list[float]):
    client.post("/v1/nodes", json=registration("a", "0:12", idle_s=tracker_app.WARM_WINDOW_S + 1))
    client.post("/v1/nodes", json=registration("b", "0:12"))
    assert [n["warm"] for n in client.get("/v1/nodes").json()["nodes"]] == [False, False]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prefill_tps": -1}, "prefill_tps"),
        ({"queue_depth": -1}, "queue_depth"),
        ({"latency_ms": {"http://b": -1}}, "latency_ms.http://b"),
        ({"hardware": {"logical_cores": 0}}, "hardware.logical_cores"),
        ({"heartbeat_s": NODE_TTL_S + 1}, "heartbeat_s"),
        ({"files": "not a list"}, "files"),
    ],
)
def test_a_bad_advertisement_is_400(client: TestClient, fields: dict[str, Any], param: str):
    response = client.post("/v1/nodes", json=registration("a", "0:12", **fields))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_the_registration_answer_names_the_next_hops_to_measure(client: TestClient, clock: list[float]):
    client.post("/v1/nodes", json=registration("t1", "6:12"))
    client.post("/v1/nodes", json=registration("t2", "6:12"))
    client.post("/v1/nodes", json=registration("x", "6:12", total_layers=24))  # another layer count
    client.post("/v1/nodes", json=registration("o", "6:12", model="other"))
    client.post("/v1/nodes", json=registration("m", "4:12"))
    answer = client.post("/v1/nodes", json=registration("h", "0:6")).json()
    assert answer["next_hops"] == ["http://t1:7000", "http://t2:7000"]
    assert client.post("/v1/nodes", json=registration("t1", "6:12")).json()["next_hops"] == []  # the tail
    for i in range(tracker_app.MAX_PROBE_TARGETS + 5):
        client.post("/v1/nodes", json=registration(f"t{i + 3}", "6:12"))
    hops = client.post("/v1/nodes", json=registration("h", "0:6")).json()["next_hops"]
    assert len(hops) == len(set(hops)) == tracker_app.MAX_PROBE_TARGETS


def test_missed_heartbeats_and_failures_lower_reliability(tmp_path: Path, clock: list[float]):
    db = TrackerDB("sqlite:///" + str(tmp_path / "t.db"))
    try:
        tracker = tracker_app._Tracker(db)
        for _ in range(10):
            clock[0] += 5
            tracker.heartbeat("a", 5.0)
        assert tracker.heartbeat("a", 5.0) == 1.0
        clock[0] += 5 * 4  # three beats missed
        assert tracker.heartbeat("a", 5.0) == pytest.approx(13 / 16, rel=1e-2)
        tracker.record_failure("a", "decode step timed out")
        assert tracker.records["a"].value() < 0.2
        assert tracker.records["a"].last_failure == "decode step timed out"
        tracker.record_failure("never-seen", "boom")  # a failure report may arrive for any node id
        assert tracker.records["never-seen"].failures == 1
    finally:
        db.close()


def test_a_failure_report_lowers_a_live_nodes_reliability_at_once(client: TestClient, clock: list[float]):
    client.post("/v1/nodes", json=registration("a", "0:12"))
    tracker = _tracker_of(client)
    tracker.record_failure("a", "hop failed")
    [listed] = client.get("/v1/nodes").json()["nodes"]
    assert listed["reliability"] == pytest.approx(2 / (2 + FAILURE_WEIGHT))
    clock[0] += 3 * 5.0  # overdue, not yet expired: the missed beats count before the next heartbeat
    [overdue] = client.get("/v1/nodes").json()["nodes"]
    assert overdue["reliability"] < listed["reliability"]


def _tracker_of(client: TestClient) -> Any:
    """The ``_Tracker`` behind an app (a closure variable of its register endpoint)."""
    for route in client.app.routes:  # type: ignore[attr-defined]
        endpoint = getattr(route, "endpoint", None)
        for cell in getattr(endpoint, "__closure__", None) or ():
            if isinstance(cell.cell_contents, tracker_app._Tracker):
                return cell.cell_contents
    raise AssertionError("no _Tracker found")


# -- a GPU in the registration (backends.gpu, --gpu-layers) -------------------------------------
def _gpu_registration(**hardware: object) -> dict[str, object]:
    return {"node_id": "g", "url": "http://g:7000", "model": "m", "layers": "0:12", "total_layers": 12,
            "hardware": {"gpu": "NVIDIA H200", **hardware}}  # fmt: skip


def test_the_tracker_accepts_and_lists_the_gpu_memory(client: TestClient) -> None:
    assert client.post("/v1/nodes", json=_gpu_registration(gpu_memory_bytes=150 * 2**30)).status_code == 201
    [node] = client.get("/v1/nodes").json()["nodes"]
    assert node["hardware"]["gpu"] == "NVIDIA H200"
    assert node["hardware"]["gpu_memory_bytes"] == 150 * 2**30


def test_the_tracker_refuses_a_negative_gpu_memory(client: TestClient) -> None:
    response = client.post("/v1/nodes", json=_gpu_registration(gpu_memory_bytes=-1))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "hardware.gpu_memory_bytes"
