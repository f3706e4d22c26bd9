"""The tracker's session, repair, failure and billing endpoints, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from meshnet.tracker.app import create_tracker_app
from meshnet.tracker.billing import FORMULA, bill
from meshnet.tracker.db import TrackerDB
from tests.postgres import postgres_server

MODEL = "m"


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/tracker.db"
        return
    url = request.getfixturevalue("postgres_url")
    yield url
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    with engine.begin() as conn:  # every test starts from empty tables
        conn.execute(sa.text("DROP TABLE IF EXISTS sessions, billing_records, audits, suspensions"))
    engine.dispose()


@pytest.fixture
def client(db_url: str) -> Iterator[TestClient]:
    db = TrackerDB(db_url)
    try:
        with TestClient(create_tracker_app(db)) as c:
            yield c
    finally:
        db.close()


def register(client: TestClient, node_id: str, layers: str, **fields: Any) -> None:
    body = {"node_id": node_id, "url": f"http://{node_id}.local:7000", "model": MODEL, "layers": layers,
            "total_layers": 30, "backend": "fake", "kv_bytes_free": 1 << 30, "prefill_tps": 1000.0,
            "decode_tps": 100.0, "numerics": "fake 1; threads 1", **fields}  # fmt: skip
    assert client.post("/v1/nodes", json=body).status_code in (200, 201)


def swarm(client: TestClient, *extra: tuple[str, str]) -> None:
    for node_id, layers in (("a", "0:10"), ("b", "10:20"), ("c", "20:30"), *extra):
        register(client, node_id, layers)


def open_session(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/sessions", json={"model": MODEL, "total_layers": 30, **fields})
    assert response.status_code == 201, response.text
    return dict(response.json())


def work(session: dict[str, Any], prefill: int = 10, decode: int = 5) -> dict[str, Any]:
    records = [{"node_id": h["node_id"], "layers": h["layers"], "prefill_tokens": prefill, "decode_tokens": decode}
               for h in session["hops"]]  # fmt: skip
    return {"session_id": session["session_id"], "route_id": session["route_id"], "records": records}


def test_billing_records_are_written_once_and_read_back_with_totals(client: TestClient):
    swarm(client)
    session = open_session(client)
    first = client.post("/v1/billing", json=work(session))
    assert first.status_code == 201 and first.json()["duplicate"] is False
    again = client.post("/v1/billing", json=work(session))  # a gateway retry after a lost answer
    assert again.status_code == 200 and again.json()["duplicate"] is True
    data = client.get("/v1/billing", params={"session_id": session["session_id"]}).json()
    assert data["formula"] == FORMULA
    assert [r["node_id"] for r in data["records"]] == ["a", "b", "c"]
    one = bill(prefill_tokens=10, decode_tokens=5, layers=10)
    for record in data["records"]:
        assert record["prefill_layer_tokens"] == one.prefill_layer_tokens == 100
        assert record["decode_layer_tokens"] == one.decode_layer_tokens == 50
        assert record["units"] == pytest.approx(one.units)
        assert record["outcome"] == "completed"
    assert data["totals"] == {"records": 3, "sessions": 1, "prefill_layer_tokens": 300, "decode_layer_tokens": 150,
                              "units": pytest.approx(3 * one.units), "voided_records": 0,
                              "voided_units": 0.0}  # fmt: skip
    assert client.get("/v1/sessions/" + session["session_id"]).json()["status"] == "closed"
    by_node = client.get("/v1/billing", params={"node_id": "b"}).json()
    assert [r["node_id"] for r in by_node["records"]] == ["b"] and by_node["totals"]["records"] == 1


def test_bad_billing_reports_are_refused_and_write_nothing(client: TestClient):
    swarm(client)
    session = open_session(client)
    good = work(session)
    cases = [
        ({**good, "session_id": "ses-nope"}, 404, "no session ses-nope"),
        ({**good, "route_id": "rte-other"}, 409, "is on route"),
        ({**good, "records": []}, 400, "records"),
        ({**good, "outcome": "great"}, 400, "outcome"),
        ({**good, "records": [{**good["records"][0], "prefill_tokens": -1}]}, 400, "prefill_tokens"),
        ({**good, "records": [{**good["records"][0], "layers": "ten"}]}, 400, "layers"),
        ({**good, "records": [{**good["records"][0], "layers": "0:99"}]}, 400, "layers"),
    ]
    for body, status, needle in cases:
        response = client.post("/v1/billing", json=body)
        assert response.status_code == status, (body, response.text)
        assert needle in response.json()["error"]["message"] + str(response.json()["error"]["param"])
    assert client.get("/v1/billing").json()["totals"]["records"] == 0
    assert client.post("/v1/billing", json=good).status_code == 201


def test_billing_records_survive_a_tracker_restart(db_url: str):
    db = TrackerDB(db_url)
    with TestClient(create_tracker_app(db)) as first:
        swarm(first)
        sessions = [open_session(first) for _ in range(3)]
        for s in sessions:
            assert first.post("/v1/billing", json=work(s)).status_code == 201
    db.close()
    db = TrackerDB(db_url)
    try:
        with TestClient(create_tracker_app(db)) as second:
            totals = second.get("/v1/billing").json()["totals"]
            assert totals["records"] == 9 and totals["sessions"] == 3
    finally:
        db.close()


def test_repair_replaces_the_failed_hop_and_repins_the_session(client: TestClient):
    swarm(client, ("b2", "10:20"))
    session = open_session(client, exclude=["b2"])
    assert [h["node_id"] for h in session["hops"]] == ["a", "b", "c"]
    sid = session["session_id"]
    response = client.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "b", "reason": "gone", "position": 40})
    assert response.status_code == 200, response.text
    fixed = response.json()
    assert [h["node_id"] for h in fixed["hops"]] == ["a", "b2", "c"]
    assert fixed["replaced"] == {"first": 1, "count": 1, "removed": 1}
    assert fixed["route_id"] == session["route_id"]
    stored = client.get(f"/v1/sessions/{sid}").json()
    assert stored["hops"] == fixed["hops"] and stored["repairs"] == 1
    # The failed node is off the live set until it heartbeats again, with the failure on its record.
    assert "b" not in {n["node_id"] for n in client.get("/v1/nodes").json()["nodes"]}
    register(client, "b", "10:20")
    b = next(n for n in client.get("/v1/nodes").json()["nodes"] if n["node_id"] == "b")
    assert b["reliability"] < 1.0


def test_repair_and_a_fresh_route_like_a_session_take_only_numerically_equivalent_nodes(client: TestClient):
    swarm(client)
    register(client, "b2", "10:20", numerics="fake 1; threads 2")  # other low bits
    register(client, "s", "10:30", wire_dtype="bfloat16")  # a tail never sends: the dtype does not matter
    session = open_session(client, exclude=["b2", "s"])
    assert [h["node_id"] for h in session["hops"]] == ["a", "b", "c"]
    assert all(h["numerics"] == "fake 1; threads 1" for h in session["hops"])
    sid = session["session_id"]
    fixed = client.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "b", "position": 9}).json()
    assert [h["node_id"] for h in fixed["hops"]] == ["a", "s"]  # b2 would compute other bits
    register(client, "b", "10:20")  # back after its failure
    like = open_session(client, like_session=sid, exclude=["s"])
    assert [h["node_id"] for h in like["hops"]] == ["a", "b", "c"]
    response = client.post("/v1/sessions", json={"model": MODEL, "like_session": sid, "exclude": ["b", "s"]})
    assert response.status_code == 503 and "bit-identically" in response.text
    assert client.post("/v1/sessions", json={"model": MODEL, "like_session": "ses-none"}).status_code == 404


def test_repair_without_a_replacement_says_which_layers_are_missing(client: TestClient):
    swarm(client)
    session = open_session(client)
    response = client.post(f"/v1/sessions/{session['session_id']}/repair", json={"failed_node": "c"})
    assert response.status_code == 503 and response.headers["retry-after"]
    assert "no live node can take over layers 20:30 from failed node c" in response.json()["error"]["message"]
    assert client.get(f"/v1/sessions/{session['session_id']}").json()["hops"] == session["hops"]  # unchanged


def test_repair_refuses_a_node_off_the_route_and_a_closed_session(client: TestClient):
    swarm(client)
    session = open_session(client)
    sid = session["session_id"]
    response = client.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "zzz"})
    assert response.status_code == 400 and "not on session" in response.json()["error"]["message"]
    assert client.post(f"/v1/sessions/{sid}/repair", json={}).status_code == 400
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    response = client.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "b"})
    assert response.status_code == 409 and "closed" in response.json()["error"]["message"]


def test_a_failure_report_suspends_the_node_and_new_sessions_avoid_it(client: TestClient):
    swarm(client, ("b2", "10:20"))
    sid = next(s["session_id"] for s in iter(lambda: open_session(client), None) if s["hops"][1]["node_id"] == "b")
    report = {"reason": "connection refused", "session_id": sid}
    assert client.post("/v1/nodes/b/failures", json=report).status_code == 200
    for _ in range(3):
        assert "b" not in [h["node_id"] for h in open_session(client)["hops"]]
    response = client.post("/v1/sessions", json={"model": MODEL, "exclude": ["b2"]})
    assert response.status_code == 503 and "10:20" in response.json()["error"]["message"]


def test_failure_reports_count_only_for_a_node_on_the_named_open_session_and_once(client: TestClient):
    """A report loop used to suspend any node and push its reliability to nothing."""
    swarm(client)
    session = open_session(client)
    sid = session["session_id"]
    missing = client.post("/v1/nodes/b/failures", json={"reason": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "session_id"
    register(client, "elsewhere", "0:10")
    stranger = client.post("/v1/nodes/zzz/failures", json={"session_id": sid})
    assert stranger.status_code == 400 and "not on session" in stranger.json()["error"]["message"]
    assert client.post("/v1/nodes/b/failures", json={"session_id": "ses-nope"}).status_code == 404
    first = client.post("/v1/nodes/b/failures", json={"session_id": sid})
    assert first.status_code == 200 and first.json()["duplicate"] is False
    register(client, "b", "10:20")  # its next heartbeat brings it back
    for _ in range(5):
        again = client.post("/v1/nodes/b/failures", json={"session_id": sid})
        assert again.status_code == 200 and again.json()["duplicate"] is True
    assert "b" in {n["node_id"] for n in client.get("/v1/nodes").json()["nodes"]}  # not suspended again
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    closed = client.post("/v1/nodes/c/failures", json={"session_id": sid})
    assert closed.status_code == 409 and "closed" in closed.json()["error"]["message"]


def test_a_repair_naming_a_node_off_the_route_suspends_nothing(client: TestClient):
    swarm(client, ("b2", "10:20"))
    session = open_session(client)
    outsider = "b2" if session["hops"][1]["node_id"] == "b" else "b"
    sid = session["session_id"]
    response = client.post(f"/v1/sessions/{sid}/repair", json={"failed_node": outsider})
    assert response.status_code == 400
    assert outsider in {n["node_id"] for n in client.get("/v1/nodes").json()["nodes"]}


def test_billing_takes_only_members_of_the_route_bounded_counts_and_not_long_after_close(client: TestClient):
    swarm(client, ("b2", "10:20"))
    session = open_session(client)
    stranger = work(session)
    stranger["records"][0] = {**stranger["records"][0], "node_id": "elsewhere"}
    response = client.post("/v1/billing", json=stranger)
    assert response.status_code == 400 and "never served layers" in response.json()["error"]["message"]
    wrong_layers = work(session)
    wrong_layers["records"][0] = {**wrong_layers["records"][0], "layers": "0:30"}
    assert client.post("/v1/billing", json=wrong_layers).status_code == 400
    huge = work(session, prefill=2**40)
    assert client.post("/v1/billing", json=huge).status_code == 400
    # A repaired session bills the replaced hop too: it computed the positions before the failure.
    sid, middle = session["session_id"], session["hops"][1]["node_id"]
    repaired = client.post(f"/v1/sessions/{sid}/repair", json={"failed_node": middle, "position": 4})
    assert repaired.status_code == 200, repaired.text
    both = work(session)
    both["records"].append({**both["records"][1], "node_id": repaired.json()["hops"][1]["node_id"]})
    assert client.post("/v1/billing", json=both).status_code == 201
    assert {r["node_id"] for r in client.get(f"/v1/billing?session_id={sid}").json()["records"]} == {
        "a", "b", "b2", "c"
    }  # fmt: skip
    late = open_session(client)
    assert client.delete(f"/v1/sessions/{late['session_id']}").status_code == 200
    import meshnet.tracker.sessions as sessions_module

    grace = sessions_module.BILLING_GRACE_S
    try:
        sessions_module.BILLING_GRACE_S = -1.0  # as if the grace had passed
        response = client.post("/v1/billing", json=work(late))
        assert response.status_code == 409 and "billed within" in response.json()["error"]["message"]
    finally:
        sessions_module.BILLING_GRACE_S = grace


def test_a_database_of_an_older_tracker_gets_the_new_columns_and_index(db_url: str):
    import sqlalchemy as sa

    engine = sa.create_engine(db_url)
    with engine.begin() as conn:  # the sessions table as the first tracker wrote it
        old_schema = (
            "CREATE TABLE sessions (session_id VARCHAR(64) PRIMARY KEY, route_id VARCHAR(64) NOT NULL, "
            "model VARCHAR(512) NOT NULL, hops TEXT NOT NULL, created FLOAT NOT NULL)"
        )
        conn.execute(sa.text(old_schema))
        conn.execute(sa.text("INSERT INTO sessions VALUES ('ses-old', 'rte-old', 'm', '[]', 1.0)"))
    engine.dispose()
    db = TrackerDB(db_url)
    try:
        old = db.load_session("ses-old")
        assert old is not None and old["status"] == "open" and old["repairs"] == 0
        engine = sa.create_engine(db_url)
        indexes = {i["name"] for i in sa.inspect(engine).get_indexes("sessions")}
        engine.dispose()
        assert "sessions_status_updated" in indexes
    finally:
        db.close()


def test_billing_records_of_an_older_tracker_get_the_voided_column(db_url: str):
    import sqlalchemy as sa

    engine = sa.create_engine(db_url)
    with engine.begin() as conn:  # billing_records as a tracker before audits wrote it (no "voided")
        conn.execute(
            sa.text(
                "CREATE TABLE billing_records (id INTEGER PRIMARY KEY, session_id VARCHAR(64) NOT NULL, "
                "node_id VARCHAR(128) NOT NULL, route_id VARCHAR(64) NOT NULL, model VARCHAR(512) NOT NULL, "
                "layers VARCHAR(32) NOT NULL, prefill_tokens BIGINT NOT NULL, decode_tokens BIGINT NOT NULL, "
                "prefill_layer_tokens BIGINT NOT NULL, decode_layer_tokens BIGINT NOT NULL, units FLOAT NOT NULL, "
                "outcome VARCHAR(16) NOT NULL, recorded_at FLOAT NOT NULL, receipt TEXT)"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO billing_records VALUES (1, 'ses-old', 'a', 'rte-old', 'm', '0:10', 10, 5, 100, 50, "
                "0.2, 'completed', 1.0, NULL)"
            )
        )
    engine.dispose()
    db = TrackerDB(db_url)
    try:
        [record], totals = db.billing()
        assert record["voided"] is None and totals["units"] == pytest.approx(0.2) and totals["voided_records"] == 0
        assert db.void_billing("a", "audit aud-1 failed the node (reexecuted): test") == 1
        [record], totals = db.billing()
        assert record["voided"].startswith("audit aud-1") and totals["units"] == 0
        assert totals["voided_units"] == pytest.approx(0.2) and db.void_billing("a", "again") == 0
    finally:
        db.close()


def test_audits_suspensions_and_voided_billing_are_kept_by_the_database(db_url: str):
    from meshnet.tracker.audit_store import AuditRow
    from meshnet.tracker.db import BillingRow

    db = TrackerDB(db_url)
    try:
        session = {"session_id": "ses-1", "route_id": "rte-1", "model": MODEL, "created": 1.0,
                   "hops": [{"node_id": "a", "layers": "0:30"}]}  # fmt: skip
        db.save_session(session)
        row = AuditRow("ses-1", "a", "0:30", "reexecuted", "fail", "wrong", ("x", "y"), "{}")
        stored, fresh = db.audits.record(row)
        again, fresh_again = db.audits.record(row)
        assert fresh and not fresh_again and again == stored and stored["auditors"] == ["x", "y"]
        db.audits.record(AuditRow("ses-1", "a", "0:30", "reexecuted", "pass", "fine", ("z",), "{}"))
        assert [a["verdict"] for a in db.audits.listing()] == ["pass", "fail"]
        assert [a["verdict"] for a in db.audits.listing(verdict="fail", node_id="a", session_id="ses-1")] == ["fail"]
        assert db.audits.failing_auditors("a") == {"x", "y"} and db.audits.failing_auditors("b") == set()
        db.audits.suspend("a", "audit: wrong", stored["audit_id"])
        assert db.audits.suspend("a", "later", "aud-2")["reason"] == "audit: wrong"  # the first one stays
        # A session that started before the verdict is billed voided.
        assert db.record_billing(db.load_session("ses-1") or {}, "completed", [BillingRow("a", "0:30", 30, 4, 2)])
        [record], totals = db.billing()
        assert stored["audit_id"] in record["voided"] and totals["units"] == 0 and totals["voided_records"] == 1
    finally:
        db.close()
    db = TrackerDB(db_url)  # a restart reads the suspensions back
    try:
        assert db.audits.suspended("a") == "audit: wrong" and db.audits.lift("a") and not db.audits.lift("a")
        assert db.audits.suspended("a") is None and db.audits.suspensions() == []
    finally:
        db.close()
