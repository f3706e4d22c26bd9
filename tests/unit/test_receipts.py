"""Billing on evidence (tracker.receipts): a private swarm's tracker bills a node only for work its
signed receipt bears out — signed by the key it was pinned with, no more positions than it holds,
and, over the route the session ended on, receipts that cover every hop and chain hop to hop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshnet.protocol.messages import HopEntry, TokenAnswer
from meshnet.protocol.signing import COUNTERSIGNATURE, HopKey, claim_of, countersign
from meshnet.tracker.db import TrackerDB
from tests.unit.test_tracker_standby import Swarm

KEYS = {"head": HopKey.generate(), "tail": HopKey.generate()}
HELD = 40


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    db = TrackerDB(f"sqlite:///{tmp_path}/tracker.db")
    try:
        swarm = Swarm(tmp_path, db)
        swarm.register("head", "0:15", hop_key=KEYS["head"].public)
        swarm.register("tail", "15:30", hop_key=KEYS["tail"].public)
        yield swarm
    finally:
        db.close()


def _open(swarm: Swarm) -> dict[str, Any]:
    answer = swarm.member("gw", "gateway").post("/v1/sessions", json={"model": "m", "total_layers": 30})
    assert answer.status_code == 201, answer.text
    assert [h["node_id"] for h in answer.json()["hops"]] == ["head", "tail"]
    return dict(answer.json())


def _receipts(session: str, *, held: int = HELD, tail_input: str = "bb" * 16, signer: str = "tail") -> list[Any]:
    """What a gateway sends: each node's latest signed entry, the tail's over its answer."""
    head = KEYS["head"].sign(session, HopEntry("head", "0:15", 3.5, held, "aa" * 16, "bb" * 16, 1))
    tail_entry = HopEntry("tail", "15:30", 4.25, held, tail_input, None, 1)
    answer = TokenAnswer((tail_entry,), position=held + 1, token=7, logprob=-0.5)
    tail = KEYS[signer].sign(session, tail_entry, answer)
    return [{"entry": head.to_json(), "answer": None}, {"entry": tail.to_json(), "answer": claim_of(answer)}]


def _bill(swarm: Swarm, session: dict[str, Any], receipts: list[Any] | None, *, prefill: int = 30, decode: int = 10):
    records = [{"node_id": node, "layers": layers, "prefill_tokens": prefill, "decode_tokens": decode}
               for node, layers in (("head", "0:15"), ("tail", "15:30"))]  # fmt: skip
    body: dict[str, Any] = {"session_id": session["session_id"], "route_id": session["route_id"], "records": records}
    if receipts is not None:
        body["receipts"] = receipts
    return swarm.member("gw", "gateway").post("/v1/billing", json=body)


def test_receipts_that_bear_the_work_out_are_billed_and_kept(swarm: Swarm) -> None:
    session = _open(swarm)
    answer = _bill(swarm, session, _receipts(session["session_id"]))
    assert answer.status_code == 201, answer.text
    rows = swarm.member("gw", "gateway").get("/v1/billing", params={"session_id": session["session_id"]}).json()
    kept = {r["node_id"]: r["receipt"] for r in rows["records"]}
    assert '"sig"' in kept["head"] and '"token":7' in kept["tail"]


def _refused(answer: Any, says: str) -> None:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "receipts" and says in error["message"], error


def test_billing_without_receipts_is_refused_in_a_private_swarm(swarm: Swarm) -> None:
    _refused(_bill(swarm, _open(swarm), None), "without receipts")


def test_a_receipt_signed_by_another_key_or_for_another_session_is_refused(swarm: Swarm) -> None:
    session = _open(swarm)
    _refused(_bill(swarm, session, _receipts(session["session_id"], signer="head")), "signature")
    other = _open(swarm)
    _refused(_bill(swarm, session, _receipts(other["session_id"])), "signature")
    receipts = _receipts(session["session_id"])
    receipts[1]["answer"]["token"] = 8  # the receipt's answer changed after the tail signed it
    _refused(_bill(swarm, session, receipts), "signature")


def test_billing_more_positions_than_the_receipt_holds_is_refused(swarm: Swarm) -> None:
    session = _open(swarm)
    _refused(_bill(swarm, session, _receipts(session["session_id"]), prefill=HELD, decode=1), "holding 40")


def test_receipts_must_cover_the_route_and_chain(swarm: Swarm) -> None:
    session = _open(swarm)
    sid = session["session_id"]
    _refused(_bill(swarm, session, _receipts(sid)[:1]), "node tail is billed without its receipt")
    _refused(_bill(swarm, session, _receipts(sid, tail_input="cc" * 16)), "other inputs than node head sent")
    head_only = _receipts(sid, held=HELD + 1)[:1] + _receipts(sid)[1:]
    _refused(_bill(swarm, session, head_only), "holds 40 positions, the hop before it 41")
    answer = _bill(swarm, session, _receipts(sid))  # nothing was written by the refusals
    assert answer.status_code == 201, answer.text


def test_a_malformed_receipt_is_a_400(swarm: Swarm) -> None:
    session = _open(swarm)
    receipts = _receipts(session["session_id"])
    receipts[0]["entry"]["held"] = -1
    _refused(_bill(swarm, session, receipts), "receipts")
    twice = [*_receipts(session["session_id"]), _receipts(session["session_id"])[0]]
    _refused(_bill(swarm, session, twice), "two receipts")


def test_a_node_a_repair_replaced_is_billed_on_the_key_it_was_pinned_with(swarm: Swarm) -> None:
    spare_key = HopKey.generate()
    swarm.register("spare", "15:30", hop_key=spare_key.public)
    gateway = swarm.member("gw", "gateway")
    answer = gateway.post("/v1/sessions", json={"model": "m", "total_layers": 30, "exclude": ["spare"]})
    session = dict(answer.json())
    sid = session["session_id"]
    fixed = gateway.post(f"/v1/sessions/{sid}/repair", json={"failed_node": "tail"})
    assert fixed.status_code == 200 and [h["node_id"] for h in fixed.json()["hops"]] == ["head", "spare"], fixed.text
    receipts = _receipts(sid)  # the replaced tail's last entry before it failed
    tail_entry = HopEntry("spare", "15:30", 4.0, HELD, "bb" * 16, None, 1)
    spare = TokenAnswer((tail_entry,), position=HELD + 1, token=7, logprob=-0.5)
    receipts.append({"entry": spare_key.sign(sid, tail_entry, spare).to_json(), "answer": claim_of(spare)})
    records = [{"node_id": node, "layers": layers, "prefill_tokens": 30, "decode_tokens": 2}
               for node, layers in (("head", "0:15"), ("tail", "15:30"), ("spare", "15:30"))]  # fmt: skip
    body = {"session_id": sid, "route_id": session["route_id"], "records": records, "receipts": receipts}
    billed = gateway.post("/v1/billing", json=body)
    assert billed.status_code == 201, billed.text


def test_a_session_opened_with_a_gateway_key_is_billed_only_countersigned_by_it(swarm: Swarm) -> None:
    """The gateway pins its key with the route (``gateway_key``) and countersigns the report
    (protocol.signing.countersign): the tracker keeps the countersignature with every record, and
    refuses a report without it, signed by another key, or changed after it was signed."""
    gateway = HopKey.generate()
    client = swarm.member("gw", "gateway")
    opened = client.post("/v1/sessions", json={"model": "m", "total_layers": 30, "gateway_key": gateway.public})
    assert opened.status_code == 201, opened.text
    session = opened.json()
    records = [{"node_id": node, "layers": layers, "prefill_tokens": 30, "decode_tokens": 10}
               for node, layers in (("head", "0:15"), ("tail", "15:30"))]  # fmt: skip
    body = {"session_id": session["session_id"], "route_id": session["route_id"], "records": records,
            "outcome": "completed", "receipts": _receipts(session["session_id"])}  # fmt: skip
    signed = countersign(gateway, body)
    inflated = {**signed, "records": [{**records[0], "decode_tokens": 11}, records[1]]}
    for report in (body, countersign(HopKey.generate(), body), inflated):
        answer = client.post("/v1/billing", json=report)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == COUNTERSIGNATURE, answer.text
    answer = client.post("/v1/billing", json=signed)
    assert answer.status_code == 201, answer.text
    rows = client.get("/v1/billing", params={"session_id": session["session_id"]}).json()["records"]
    assert {r["countersignature"] for r in rows} == {signed[COUNTERSIGNATURE]}
    bad = client.post("/v1/sessions", json={"model": "m", "total_layers": 30, "gateway_key": "!" * 43})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "gateway_key", bad.text
