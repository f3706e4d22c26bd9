"""Issue #28, "floods change nothing": the decisions as pure functions (rate limits, heartbeat
counting, probation in route choice, measured credit), then the tracker app over them (repairs and
failure reports that count once, suspension only when a repair proceeds, 429s per member, a URL
host outside the certificate, probation listed and ended by measurement)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from meshnet.errors import RateLimited
from meshnet.layers import LayerRange
from meshnet.protocol.signing import HopKey
from meshnet.tracker.app import create_tracker_app
from meshnet.tracker.db import BillingRow, TrackerDB
from meshnet.tracker.failures import MEMBER_FAILURE_WINDOW_S, FailureLedger
from meshnet.tracker.limits import LIMITS, REGISTRATIONS, REPAIRS, Limit, RateLimits
from meshnet.tracker.plausibility import MAX_FLOOR_S, MEASURED_STEPS, SpeedChecks
from meshnet.tracker.reliability import FAILURE_WEIGHT, MIN_HEARTBEAT_S, Reliability
from meshnet.tracker.routing import DEFAULT_DECODE_S_PER_LAYER, NodeRecord, RouteRequest, select_routes
from tests.unit.test_tracker_trust import PrivateTracker, measure, register, route

MODEL = "m"


# -- rate limits -----------------------------------------------------------------------------------
def test_a_member_gets_its_burst_then_its_rate_and_others_are_untouched() -> None:
    limits = RateLimits({REPAIRS: Limit(burst=3, per_s=0.5), REGISTRATIONS: Limit(burst=1, per_s=1)})
    for _ in range(3):
        limits.check("rogue", REPAIRS, 100.0)
    with pytest.raises(RateLimited) as refused:
        limits.check("rogue", REPAIRS, 100.0)
    assert refused.value.status == 429 and refused.value.retry_after_s == 2
    assert "member 'rogue' sent more repairs" in refused.value.message and "3 at once" in refused.value.message
    limits.check("honest", REPAIRS, 100.0)  # another member's bucket
    limits.check("rogue", REGISTRATIONS, 100.0)  # another kind's bucket
    limits.check("rogue", REPAIRS, 102.0)  # refilled at 0.5 a second
    with pytest.raises(RateLimited):
        limits.check("rogue", REPAIRS, 102.5)
    for _ in range(1000):
        limits.check(None, REPAIRS, 100.0)  # the admin and an open swarm's callers: no limit


def test_the_default_limits_leave_an_honest_member_room() -> None:
    """A node heartbeats every 5 s; a gateway reports each broken session once."""
    limits = RateLimits()
    for t in range(0, 3600, 5):
        limits.check("node", REGISTRATIONS, float(t))
    for _ in range(int(LIMITS[REPAIRS].burst)):  # a dying node breaks a busy gateway's sessions at once
        limits.check("gw", REPAIRS, 0.0)


# -- which failures count -------------------------------------------------------------------------
def test_a_failure_counts_once_per_session_and_once_a_window_per_member() -> None:
    ledger = FailureLedger(window_s=60.0)
    assert ledger.count("s1", "n", "rogue", 0.0) == (True, True)
    assert ledger.count("s1", "n", "rogue", 1.0) == (False, True)  # the repair after the report: same failure
    assert ledger.count("s2", "n", "rogue", 2.0) == (True, False)  # another session, inside the window
    assert ledger.count("s2", "n", "rogue", 90.0) == (False, False)  # decided at its first word
    assert ledger.count("s3", "n", "honest", 3.0) == (True, True)  # another member's word
    assert ledger.count("s4", "m", "rogue", 3.0) == (True, True)  # another node
    assert ledger.count("s5", "n", "rogue", 60.0) == (True, True)  # the window passed
    assert ledger.count("s6", "n", None, 60.0) == (True, True)  # no member (open swarm, admin): no window
    assert MEMBER_FAILURE_WINDOW_S == 60.0


# -- heartbeats ------------------------------------------------------------------------------------
def _beat(record: Reliability, start: float, seconds: float, every: float, claimed: float) -> None:
    t = start
    while t < start + seconds:
        record.heartbeat(t, claimed)
        t += every


@pytest.mark.parametrize(("every", "claimed"), [(0.05, 0.05), (0.05, 5.0), (1.0, 15.0), (0.2, 1.0)])
def test_a_heartbeat_flood_counts_no_more_than_honest_heartbeats(every: float, claimed: float) -> None:
    honest, flood = Reliability(), Reliability()
    for record in (honest, flood):
        record.heartbeat(0.0, 5.0)
        record.failure(1.0, "failed at prefill")
    _beat(honest, 5.0, 300.0, 5.0, 5.0)
    _beat(flood, 5.0, 300.0, every, claimed)
    assert flood.seen <= honest.seen * 1.1 + 2.0  # by time: 300 s is ~60 units whatever the rate
    assert flood.value() <= honest.value() * 1.1 + 0.01
    assert honest.value() < 0.5  # a failure still weighs FAILURE_WEIGHT units after five minutes
    assert honest.value() == pytest.approx((honest.seen + 1) / (honest.seen + FAILURE_WEIGHT * honest.failures + 1))


def test_a_claimed_interval_is_floored_and_a_beat_inside_it_does_not_count() -> None:
    record = Reliability()
    assert record.heartbeat(0.0, 0.001) is True
    assert record.interval_s == MIN_HEARTBEAT_S
    assert record.heartbeat(0.001, 0.001) is True  # the burst: a re-registration right after the benchmark
    assert [record.heartbeat(0.002 + i / 1000, 0.001) for i in range(100)].count(True) == 0
    assert record.heartbeat(1.2, 0.001) is True  # one interval later
    assert record.seen == pytest.approx(3 * MIN_HEARTBEAT_S / 5.0, rel=1e-3)


# -- probation in route choice ---------------------------------------------------------------------
def node(node_id: str, layers: str, *, tps: float = 50.0, probation: bool = False, **fields: Any) -> NodeRecord:
    fields = {"kv_bytes_free": 1 << 30, **fields}
    return NodeRecord(node_id=node_id, url=f"https://{node_id}:1", model=MODEL, layers=LayerRange.parse(layers, 30),
                      backend="fake", last_seen=0.0, decode_tps=tps, prefill_tps=tps * 10, warm=True,
                      probation=probation, **fields)  # fmt: skip


def _heads(nodes: list[NodeRecord], **kw: Any) -> list[list[str]]:
    return [[n.node_id for n in c.nodes] for c in select_routes(nodes, MODEL, 30, **kw)]


def test_a_node_on_probation_heads_no_route_while_another_head_can() -> None:
    liar = node("liar", "0:15", tps=1e7, probation=True, kv_bytes_free=1 << 49)
    nodes = [liar, node("head", "0:15", tps=5.0), node("tail", "15:30")]
    assert _heads(nodes) == [["head", "tail"]]  # no alternative with the liar as head either
    assert _heads([liar, node("tail", "15:30")]) == [["liar", "tail"]]  # the only head: the swarm still serves
    whole = node("whole", "0:30", tps=1.0)
    assert _heads([liar, node("tail", "15:30"), whole])[0] == ["whole"]


def test_a_claim_on_probation_buys_nothing() -> None:
    liar = node("liar", "15:30", tps=1e7, probation=True)
    honest = node("honest", "15:30", tps=100.0)  # 10 ms a position: better than the 150 ms default
    request = RouteRequest(prefill_tokens=64, decode_tokens=32)
    assert _heads([node("head", "0:15"), liar, honest], request=request)[0] == ["head", "honest"]
    [alone] = select_routes([liar], MODEL, 30, request=request, span=(15, 30), k=1)
    assert alone.breakdown["decode_s"] == pytest.approx(32 * DEFAULT_DECODE_S_PER_LAYER * 15)
    # a repair's run that does not start at layer 0 is not the route's head: probation allows it
    assert _heads([liar], span=(15, 30)) == [["liar"]]


# -- measured credit -------------------------------------------------------------------------------
def _judged(checks: SpeedChecks, sid: str, nodes: list[NodeRecord], steps: int, step_s: float) -> bool:
    checks.route_chosen(sid, nodes)
    rows = [BillingRow(n.node_id, str(n.layers), len(n.layers), 8, steps) for n in nodes]
    verdict = checks.judge(sid, rows, 30, steps * step_s)
    assert verdict is not None
    return verdict.plausible


def test_a_node_is_measured_after_enough_plausible_steps_and_back_on_probation_after_a_lie_or_failure() -> None:
    checks = SpeedChecks(probation=True)
    fresh = node("fresh", "0:30", tps=100.0)
    assert [n.probation for n in checks.apply([fresh, node("vouched", "0:30", trusted=True)])] == [True, False]
    assert _judged(checks, "s1", [fresh], MEASURED_STEPS - 1, 0.01)
    assert checks.apply([fresh])[0].probation is True  # one step short
    assert _judged(checks, "s2", [fresh], 8, 0.01)
    assert checks.measured("fresh") and checks.apply([fresh])[0].probation is False
    assert not _judged(checks, "s3", [fresh], 8, 1.0)  # 100x slower than it claims
    assert not checks.measured("fresh")
    assert _judged(checks, "s4", [fresh], MEASURED_STEPS, 0.01) and checks.measured("fresh")
    checks.failed("fresh")
    assert not checks.measured("fresh") and checks.floor_s("fresh") == pytest.approx(MAX_FLOOR_S)
    liar = node("liar", "0:30", tps=1e6)
    for i in range(10):  # a liar's reports are implausible: it is never measured
        assert not _judged(checks, f"l{i}", [liar], MEASURED_STEPS, 0.2)
    assert not checks.measured("liar")
    assert SpeedChecks().apply([fresh])[0].probation is False  # an open swarm's tracker: no tiers, no probation


# -- the app ---------------------------------------------------------------------------------------
@pytest.fixture
def client(tmp_path: Path) -> Any:
    db = TrackerDB(f"sqlite:///{tmp_path}/open.db")
    try:
        with TestClient(create_tracker_app(db)) as c:
            yield c
    finally:
        db.close()


def _register_open(client: TestClient, node_id: str, layers: str) -> None:
    body = {"node_id": node_id, "url": f"http://{node_id}.local:7000", "model": MODEL, "layers": layers,
            "total_layers": 30, "decode_tps": 100.0, "prefill_tps": 1000.0, "numerics": "fake 1"}  # fmt: skip
    assert client.post("/v1/nodes", json=body).status_code in (200, 201)


def _live(client: TestClient) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in client.get("/v1/nodes").json()["nodes"]}


def test_a_repair_that_cannot_proceed_counts_once_and_suspends_nothing(client: TestClient) -> None:
    for node_id, layers in (("a", "0:15"), ("b", "15:30")):
        _register_open(client, node_id, layers)
    sid = client.post("/v1/sessions", json={"model": MODEL, "total_layers": 30}).json()["session_id"]
    for _ in range(20):
        answer = client.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "a", "position": 3})
        assert answer.status_code == 503 and "no live node can take over layers 0:15" in answer.text
    live = _live(client)
    assert set(live) == {"a", "b"}  # never suspended
    assert live["a"]["reliability"] == pytest.approx(2 / (2 + FAILURE_WEIGHT), rel=1e-3)  # one failure
    # the prefill failure report of the same failure counts no second time (nor floors it)
    report = client.post("/v1/nodes/a/failures", json={"session_id": sid})
    assert report.json()["duplicate"] is True and _live(client)["a"]["decode_floor_s"] is None
    # once a replacement exists the repair proceeds, and only then is the failed node suspended
    _register_open(client, "a2", "0:15")
    fixed = client.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "a", "position": 3})
    assert fixed.status_code == 200 and [h["node_id"] for h in fixed.json()["hops"]] == ["a2", "b"]
    assert "a" not in _live(client)
    assert _live(client)["a2"]["reliability"] == 1.0


def test_a_node_reported_failed_at_prefill_is_floored(client: TestClient) -> None:
    for node_id, layers in (("a", "0:15"), ("b", "15:30"), ("b2", "15:30")):
        _register_open(client, node_id, layers)
    session = client.post("/v1/sessions", json={"model": MODEL, "total_layers": 30}).json()
    failed = session["hops"][1]["node_id"]
    other = "b2" if failed == "b" else "b"
    assert client.post(f"/v1/nodes/{failed}/failures", json={"session_id": session["session_id"]}).status_code == 200
    _register_open(client, failed, "15:30")  # it heartbeats back at once
    assert _live(client)[failed]["decode_floor_s"] == pytest.approx(MAX_FLOOR_S, rel=1e-3)
    again = client.post("/v1/sessions", json={"model": MODEL, "total_layers": 30}).json()
    assert [h["node_id"] for h in again["hops"]] == ["a", other]


@pytest.fixture
def private(tmp_path: Path) -> Any:
    db = TrackerDB(f"sqlite:///{tmp_path}/tracker.db")
    try:
        yield PrivateTracker(tmp_path, db)
    finally:
        db.close()


def test_floods_are_429_per_member_with_retry_after(private: PrivateTracker) -> None:
    register(private, "head", "0:15", trusted=True)
    register(private, "tail", "15:30", trusted=True)
    rogue, honest = private.member("rogue", "gateway"), private.member("honest", "gateway")
    sid = rogue.post("/v1/sessions", json={"model": MODEL, "total_layers": 30}).json()["session_id"]
    codes = [rogue.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "head"}).status_code for _ in range(40)]
    assert codes[: int(LIMITS[REPAIRS].burst)] == [503] * int(LIMITS[REPAIRS].burst) and codes[-1] == 429
    refused = rogue.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "head"})
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and "repairs" in refused.json()["error"]["message"]
    reports = [rogue.post("/v1/nodes/head/failures", json={"session_id": sid}).status_code for _ in range(40)]
    assert reports[0] == 200 and reports[-1] == 429
    register(private, "head", "0:15", trusted=True)  # back after its suspension
    listed = {n["node_id"]: n for n in rogue.get("/v1/nodes").json()["nodes"]}
    assert listed["head"]["decode_floor_s"] is None  # trusted: a failure lowers its reliability, no floor
    assert honest.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "head"}).status_code == 403  # not limited
    admin = private.member("admin", "admin")
    assert all(admin.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "head"}).status_code == 503
               for _ in range(40))  # fmt: skip
    assert {"head", "tail"} <= {n["node_id"] for n in admin.get("/v1/nodes").json()["nodes"]}
    beats = [_heartbeat(private, "tail").status_code for _ in range(40)]
    assert beats[0] == 200 and beats[-1] == 429


def _heartbeat(private: PrivateTracker, node_id: str, **fields: Any) -> Any:
    body = {"node_id": node_id, "url": f"https://{node_id}.local:7000", "model": MODEL, "layers": "15:30",
            "total_layers": 30, "hop_key": HopKey.generate().public, **fields}  # fmt: skip
    return private.member(node_id, trusted=True).post("/v1/nodes", json=body)


def test_a_registration_url_host_must_be_in_the_nodes_certificate(private: PrivateTracker) -> None:
    refused = _heartbeat(private, "tail", url="https://10.1.2.3:7000")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "url"
    assert "lists tail.local, not '10.1.2.3'" in refused.json()["error"]["message"]
    assert "--san 10.1.2.3" in refused.json()["error"]["message"]
    assert _heartbeat(private, "tail", url="https://TAIL.local:7001").status_code == 201  # DNS names: any case


def _probation(client: TestClient) -> dict[str, bool]:
    return {n["node_id"]: n["probation"] for n in client.get("/v1/nodes").json()["nodes"]}


def test_an_untrusted_fast_node_heads_routes_only_once_measured(private: PrivateTracker) -> None:
    gateway = private.member("gw", "gateway")
    body = {"model": MODEL, "total_layers": 30}
    register(private, "fast", "0:30", trusted=False, tps=5000.0)
    register(private, "head", "0:15", trusted=True)
    register(private, "tail", "15:30", trusted=True)
    assert _probation(gateway) == {"fast": True, "head": False, "tail": False}
    session = gateway.post("/v1/sessions", json=body).json()
    assert route(session) == ["head", "tail"]
    report = {"session_id": session["session_id"]}
    for node_id in ("head", "tail"):  # the trusted nodes leave for a while: the fast one is all there is
        assert gateway.post(f"/v1/nodes/{node_id}/failures", json=report).status_code == 200
    measure(private, "fast", "0:30")  # its only route, billed as fast as it claims
    register(private, "head", "0:15", trusted=True)
    register(private, "tail", "15:30", trusted=True)
    assert _probation(gateway)["fast"] is False
    session = gateway.post("/v1/sessions", json=body).json()
    assert route(session) == ["fast"]  # measured: its claim counts
    assert gateway.post("/v1/nodes/fast/failures", json={"session_id": session["session_id"]}).status_code == 200
    register(private, "fast", "0:30", trusted=False, tps=5000.0)
    assert _probation(gateway)["fast"] is True  # failed: on probation again, and floored
    assert route(gateway.post("/v1/sessions", json=body).json()) == ["head", "tail"]


def test_one_members_failures_of_one_node_count_once_a_window(private: PrivateTracker) -> None:
    """A gateway opening session after session to repair or report the same node keeps it suspended
    no more than once per MEMBER_FAILURE_WINDOW_S; another member's word still counts."""
    for node_id, layers in (("head", "0:15"), ("tail", "15:30"), ("spare", "15:30")):
        register(private, node_id, layers, trusted=True)
    rogue, honest = private.member("rogue", "gateway"), private.member("honest", "gateway")
    body = {"model": MODEL, "total_layers": 30, "exclude": ["spare"]}

    def repaired(client: TestClient) -> list[str]:
        session = client.post("/v1/sessions", json=body).json()
        answer = client.post(f"/v1/sessions/{session['session_id']}/repair", json={"failed_node": "tail"})
        assert answer.status_code == 200, answer.text
        return route(answer.json())

    live = lambda: {n["node_id"] for n in rogue.get("/v1/nodes").json()["nodes"]}  # noqa: E731
    assert repaired(rogue) == ["head", "spare"] and "tail" not in live()
    register(private, "tail", "15:30", trusted=True)  # back with its next heartbeat
    for _ in range(3):  # the repairs proceed (their sessions need a route), the node stays live
        assert repaired(rogue) == ["head", "spare"] and "tail" in live()
    session = rogue.post("/v1/sessions", json=body).json()
    report = rogue.post("/v1/nodes/tail/failures", json={"session_id": session["session_id"]})
    assert report.json()["duplicate"] is True and "tail" in live()
    assert repaired(honest) == ["head", "spare"] and "tail" not in live()
