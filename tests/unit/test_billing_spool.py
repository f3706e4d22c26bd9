"""The gateway's billing outbox survives a restart: what one gateway spooled, the next one delivers."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx

from meshnet.gateway.billing_outbox import BillingOutbox, Usage
from meshnet.layers import LayerRange
from meshnet.routes import Hop, RoutePlan
from meshnet.tracker.app import create_tracker_app
from meshnet.tracker.billing import MAX_DECODE_S
from meshnet.tracker.db import TrackerDB
from tests.asgi import serve_in_thread


def _dead_url() -> str:
    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_record_spooled_by_a_gateway_that_stopped_is_delivered_by_the_next(tmp_path: Path) -> None:
    db = TrackerDB(f"sqlite:///{tmp_path}/tracker.db")
    spool = tmp_path / "spool"
    try:
        with serve_in_thread(create_tracker_app(db)) as tracker:
            for node_id, layers in (("a", "0:15"), ("b", "15:30")):
                body = {"node_id": node_id, "url": f"http://{node_id}.local:7000", "model": "m", "layers": layers,
                        "total_layers": 30, "backend": "fake", "numerics": "fake"}  # fmt: skip
                assert httpx.post(f"{tracker}/v1/nodes", json=body, timeout=10).status_code == 201
            session = httpx.post(f"{tracker}/v1/sessions", json={"model": "m", "total_layers": 30}, timeout=10).json()
            hops = tuple(Hop(h["node_id"], h["url"], LayerRange.parse(h["layers"], 30)) for h in session["hops"])
            plan = RoutePlan(session["session_id"], session["route_id"], hops)
            usage = Usage()
            usage.add(hops, prefill=12, decode=5)

            # The first gateway cannot reach its tracker and stops: the record stays in the spool.
            first = BillingOutbox(_dead_url(), spool_dir=spool)
            first.submit(plan, usage, "completed")
            first.close(flush_s=0.5)
            assert first.delivered == 0 and [p.name for p in spool.iterdir()] == [f"{plan.session_id}.json"]

            second = BillingOutbox(tracker, spool_dir=spool)
            try:
                assert second.recovered == 1
                assert second.wait_idle(30) and second.delivered == 1
            finally:
                second.close()
            assert list(spool.iterdir()) == []
            billed = httpx.get(f"{tracker}/v1/billing", params={"session_id": plan.session_id}, timeout=10).json()
            assert {(r["node_id"], r["prefill_tokens"], r["decode_tokens"]) for r in billed["records"]} == {
                ("a", 12, 5), ("b", 12, 5)
            }  # fmt: skip
    finally:
        db.close()


def test_an_unreadable_spool_file_is_set_aside_and_a_cut_write_removed(tmp_path: Path) -> None:
    (tmp_path / "ses-bad.json").write_text("{not json")
    (tmp_path / "ses-cut.json.123.tmp").write_text("{")
    outbox = BillingOutbox(_dead_url(), spool_dir=tmp_path)
    try:
        assert outbox.recovered == 0
    finally:
        outbox.close(flush_s=0.1)
    time.sleep(0.05)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ses-bad.bad"]


def test_the_report_carries_the_decode_seconds_the_usage_counted(tmp_path: Path) -> None:
    hops = (Hop("a", "http://a.local:7000", LayerRange.parse("0:15", 30)),
            Hop("b", "http://b.local:7000", LayerRange.parse("15:30", 30)))  # fmt: skip
    decoded, prefilled, long = Usage(), Usage(), Usage()
    decoded.add(hops, prefill=12, decode=5)
    for seconds in (0.25, 0.5, -1.0):  # a clock that went backwards counts nothing
        decoded.decoded(seconds)
    assert decoded.decode_s == 0.75
    prefilled.add(hops, prefill=12)
    prefilled.decoded(0.5)  # no decode positions: the seconds judge nothing, and are not sent
    long.add(hops, decode=5)
    long.decoded(2 * MAX_DECODE_S)  # the tracker refuses more than MAX_DECODE_S: sent capped
    outbox = BillingOutbox(_dead_url(), spool_dir=tmp_path)
    for name, usage in (("decoded", decoded), ("prefilled", prefilled), ("long", long)):
        outbox.submit(RoutePlan(f"ses-{name}", "rte-1", hops), usage, "completed")
    outbox.close(flush_s=0.1)
    sent = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert sent["ses-decoded"]["decode_s"] == 0.75
    assert "decode_s" not in sent["ses-prefilled"]
    assert sent["ses-long"]["decode_s"] == MAX_DECODE_S


def test_a_node_caught_lying_is_left_out_of_the_bill_and_a_forged_answer_bills_no_one(tmp_path: Path) -> None:
    hops = [Hop(n, f"http://{n}", LayerRange.parse(r, 30)) for n, r in (("head", "0:15"), ("tail", "15:30"))]
    usage = Usage()
    usage.add(hops, prefill=12, decode=3)
    usage.unpaid.add("tail")  # it signed a token its own draw does not give (route_engine._check_tokens)
    assert [r["node_id"] for r in usage.records()] == ["head"]
    usage.void()  # RouteInconsistent: which relaying hop forged the answer is unknown
    assert usage.records() == []
    outbox = BillingOutbox("http://127.0.0.1:9", spool_dir=tmp_path)
    try:
        outbox.submit(RoutePlan("ses-1", "r1", tuple(hops)), usage, "failed")  # type: ignore[arg-type]
        assert not list(tmp_path.glob("*.json"))  # nothing to deliver
    finally:
        outbox.close()
