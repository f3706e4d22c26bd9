"""Audit sampling on the tracker (tracker.audits): auditor nodes are never routed; a report is taken
only on evidence the tracker checks itself (the audited node's pinned key, the auditors' registered
keys, the verdict recomputed); a verified fail suspends the node for good, voids its unsettled pay
and, in a private swarm, once two auditors failed it, revokes it; a withheld seam log counts as one
failure and voids that session's pay only.

The tracker is the real ASGI app over a SQLite file; every key is a real Ed25519 key, every
statement and entry really signed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from meshnet.protocol.audits import AuditStatement, AuditStep, answer_at, sign_statement
from meshnet.protocol.messages import HopEntry, TokenAnswer
from meshnet.protocol.signing import HopKey, claim_of
from meshnet.sampling import Draw
from meshnet.security.identity import SwarmCA, make_csr, new_member_key
from meshnet.security.invites import mint_invite
from meshnet.security.membership import SwarmAuthority
from meshnet.tracker.app import create_tracker_app
from meshnet.tracker.db import TrackerDB
from tests.unit.test_tracker_trust import _as_member

MODEL = "m"
NUMERICS = "fake 1; threads 1"
HELD = 40
IN, OUT = "aa" * 16, "bb" * 16  # what the head computed from and sent on (the tail's input)
KEYS: dict[str, HopKey] = {}
DRAW_7 = Draw((7, 9), (0.625, 0.375), 1.0, 100)  # what the tail committed to
DRAW_9 = Draw((9, 7), (0.625, 0.375), 1.0, 100)  # what its layers give


def key(node_id: str) -> HopKey:
    return KEYS.setdefault(node_id, HopKey.generate())


def node_body(node_id: str, layers: str, *, scheme: str = "http", **fields: Any) -> dict[str, Any]:
    return {"node_id": node_id, "url": f"{scheme}://{node_id}.local:7000", "model": MODEL, "layers": layers,
            "total_layers": 30, "backend": "fake", "kv_bytes_free": 1 << 30, "prefill_tps": 1000.0,
            "decode_tps": 100.0, "numerics": NUMERICS, "hop_key": key(node_id).public, **fields}  # fmt: skip


# -- the evidence --------------------------------------------------------------------------------
def head_receipt(sid: str, *, signer: str = "head") -> dict[str, Any]:
    """The head's latest signed entry: HELD positions from IN, OUT sent on."""
    return {"entry": key(signer).sign(sid, HopEntry("head", "0:15", 1.5, HELD, IN, OUT, HELD)).to_json()}


def statement(sid: str, auditor: str, *, output: str | None = OUT, signer: str | None = None, **about: Any) -> Any:
    """An auditor's signed re-execution of the head (``output``: the digest it would have sent on)."""
    fields = {"session": sid, "node": "head", "layers": "0:15", "auditor": auditor, "held": HELD,
              "input_digest": IN, "output_digest": output, **about}  # fmt: skip
    return sign_statement(key(signer or auditor), AuditStatement(**fields)).to_json()


def report(sid: str, statements: list[Any], *, verdict: str = "fail", **fields: Any) -> dict[str, Any]:
    return {"session_id": sid, "node_id": "head", "layers": "0:15", "kind": "reexecuted", "verdict": verdict,
            "reason": "the gateway's words", "receipt": head_receipt(sid), "statements": statements,
            "answer": None, **fields}  # fmt: skip


def tail_evidence(sid: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tail's receipt and its signed answer at position HELD (token 7 drawn from DRAW_7)."""
    entry = HopEntry("tail", "15:30", 2.0, HELD, OUT, None, 1)
    answer = TokenAnswer((entry,), position=HELD, token=7, logprob=-0.5, draw=DRAW_7)
    signed, claim = key("tail").sign(sid, entry, answer), claim_of(answer)
    assert claim is not None
    return {"entry": signed.to_json(), "answer": claim}, answer_at(HELD, signed, claim)


def tail_statement(sid: str, auditor: str, token: int, draw: Draw) -> Any:
    step = AuditStep(HELD, OUT, token, draw)
    return sign_statement(
        key(auditor), AuditStatement(sid, "tail", "15:30", auditor, HELD, OUT, None, (step,))
    ).to_json()


# -- an open swarm's tracker ---------------------------------------------------------------------
class Tracker:
    """The tracker over a SQLite file, restartable on it."""

    def __init__(self, path: Path) -> None:
        self.url = f"sqlite:///{path}"
        self.db = TrackerDB(self.url)
        self.client = TestClient(create_tracker_app(self.db))

    def restart(self) -> None:
        self.db.close()
        self.db = TrackerDB(self.url)
        self.client = TestClient(create_tracker_app(self.db))

    def register(self, node_id: str, layers: str, **fields: Any) -> Any:
        return self.client.post("/v1/nodes", json=node_body(node_id, layers, **fields))

    def swarm(self) -> None:
        """head 0:15 and tail 15:30; auditors of both ranges, ten times faster (routes would love them)."""
        for node_id, layers, auditor in (("head", "0:15", False), ("tail", "15:30", False), ("aud1", "0:15", True),
                                         ("aud2", "0:15", True), ("aud3", "15:30", True)):  # fmt: skip
            fast = {"decode_tps": 1000.0, "auditor": True} if auditor else {}
            assert self.register(node_id, layers, **fast).status_code in (200, 201)

    def open(self) -> dict[str, Any]:
        answer = self.client.post("/v1/sessions", json={"model": MODEL, "total_layers": 30})
        assert answer.status_code == 201, answer.text
        assert [h["node_id"] for h in answer.json()["hops"]] == ["head", "tail"]
        return dict(answer.json())

    def bill(self, session: dict[str, Any]) -> None:
        records = [{"node_id": n, "layers": la, "prefill_tokens": 30, "decode_tokens": 10}
                   for n, la in (("head", "0:15"), ("tail", "15:30"))]  # fmt: skip
        body = {"session_id": session["session_id"], "route_id": session["route_id"], "records": records}
        assert self.client.post("/v1/billing", json=body).status_code == 201

    def billing(self, **params: str) -> dict[str, Any]:
        return dict(self.client.get("/v1/billing", params=params).json())

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in self.client.get("/v1/nodes").json()["nodes"]}

    def audits(self, **params: Any) -> dict[str, Any]:
        answer = self.client.get("/v1/audits", params=params)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())


@pytest.fixture
def tracker(tmp_path: Path) -> Iterator[Tracker]:
    held = Tracker(tmp_path / "tracker.db")
    try:
        held.swarm()
        yield held
    finally:
        held.db.close()


def voided(tracker: Tracker, session_id: str) -> dict[str, str | None]:
    return {r["node_id"]: r["voided"] for r in tracker.billing(session_id=session_id)["records"]}


def test_an_auditor_is_listed_but_never_routed(tracker: Tracker) -> None:
    nodes = tracker.nodes()
    assert {k: n["auditor"] for k, n in nodes.items()} == {"head": False, "tail": False, "aud1": True,
                                                          "aud2": True, "aud3": True}  # fmt: skip
    for _ in range(5):
        tracker.open()  # the ten times faster auditors never make the route
    heartbeat = tracker.register("head", "0:15").json()
    assert heartbeat["next_hops"] == ["http://tail.local:7000"]  # no latency to measure to an auditor
    assert tracker.register("aud1", "0:15", auditor=True).json()["next_hops"] == []
    # Only auditors hold the head's layers: there is no route, and no repair takes one.
    session = tracker.open()
    tracker.client.post("/v1/nodes/head/failures", json={"session_id": session["session_id"]})
    answer = tracker.client.post("/v1/sessions", json={"model": MODEL})
    assert answer.status_code == 503 and "no node serves layers 0:15" in answer.text, answer.text
    repair = tracker.client.post(f"/v1/sessions/{session['session_id']}/repair", json={"failed_node": "tail"})
    assert repair.status_code == 503, repair.text
    models = tracker.client.get("/v1/models").json()["models"]
    assert models[0]["routable"] is False


def test_placement_counts_no_auditor_as_coverage(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path / "placement.db")
    try:
        assert tracker.register("aud1", "0:15", auditor=True).status_code == 201
        assert tracker.register("tail", "15:30").status_code == 201
        ask = {"node_id": "new", "model": MODEL, "total_layers": 30, "layer_bytes": [1000] * 30,
               "budget_bytes": 10**9, "boundaries": list(range(31))}  # fmt: skip
        answer = tracker.client.post("/v1/placement", json=ask)
        assert answer.status_code == 200 and answer.json()["layers"] == "0:15", answer.text  # the auditor's hole
    finally:
        tracker.db.close()


def test_an_auditor_registers_with_a_hop_key_and_a_real_boolean(tracker: Tracker) -> None:
    answer = tracker.register("aud9", "0:15", auditor=True, hop_key=None)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "hop_key", answer.text
    assert "auditor" in answer.json()["error"]["message"]
    assert tracker.register("aud9", "0:15", auditor="yes").status_code == 400
    assert "aud9" not in tracker.nodes()


def test_a_verified_fail_suspends_voids_the_unsettled_pay_and_is_listed(tracker: Tracker) -> None:
    billed, running = tracker.open(), tracker.open()
    tracker.bill(billed)
    before = tracker.billing()["totals"]
    sid = billed["session_id"]
    answer = tracker.client.post("/v1/audits", json=report(sid, [statement(sid, "aud1", output="cc" * 16)]))
    assert answer.status_code == 201, answer.text
    record = answer.json()
    assert record["audit_id"].startswith("aud-") and record["verdict"] == "fail" and record["auditors"] == ["aud1"]
    assert "other activations than it sent on" in record["reason"] and record["duplicate"] is False
    # Suspended: listed with the reason, heartbeats and all, and never routed.
    assert tracker.register("head", "0:15").status_code == 200
    assert record["audit_id"] in tracker.nodes()["head"]["suspended"]
    assert tracker.client.post("/v1/sessions", json={"model": MODEL}).status_code == 503
    # Voided: the billed session's head record now, the running session's when it is billed.
    assert voided(tracker, billed["session_id"])["tail"] is None
    assert record["audit_id"] in str(voided(tracker, billed["session_id"])["head"])
    tracker.bill(running)
    assert voided(tracker, running["session_id"])["tail"] is None
    assert record["audit_id"] in str(voided(tracker, running["session_id"])["head"])
    totals = tracker.billing()["totals"]
    head_units = before["units"] / 2  # head and tail bill the same
    assert totals["voided_records"] == 2 and totals["voided_units"] == pytest.approx(2 * head_units)
    assert totals["units"] == pytest.approx(2 * head_units) and totals["records"] == 4
    listed = tracker.audits()
    assert [a["audit_id"] for a in listed["audits"]] == [record["audit_id"]]
    assert listed["suspended"][0]["node_id"] == "head" and listed["suspended"][0]["audit_id"] == record["audit_id"]
    # A restart on the same file: still suspended once the node heartbeats again, still void.
    tracker.restart()
    tracker.swarm()
    assert tracker.nodes()["head"]["suspended"] is not None
    assert tracker.client.post("/v1/sessions", json={"model": MODEL}).status_code == 503
    assert tracker.billing()["totals"]["voided_records"] == 2


def test_a_lifted_suspension_routes_the_node_again_and_its_new_work_is_paid(tracker: Tracker) -> None:
    session = tracker.open()
    body = report(session["session_id"], [statement(session["session_id"], "aud1", output="cc" * 16)])
    assert tracker.client.post("/v1/audits", json=body).status_code == 201
    lifted = tracker.client.delete("/v1/suspensions/head")
    assert lifted.status_code == 200 and lifted.json()["lifted"] == "head", lifted.text
    assert tracker.nodes()["head"]["suspended"] is None
    after = tracker.open()  # routed again
    tracker.bill(after)
    assert voided(tracker, after["session_id"]) == {"head": None, "tail": None}
    assert tracker.audits()["suspended"] == []
    missing = tracker.client.delete("/v1/suspensions/head")
    assert missing.status_code == 404 and "not suspended" in missing.json()["error"]["message"]


def test_a_pass_changes_nothing(tracker: Tracker) -> None:
    session = tracker.open()
    tracker.bill(session)
    sid = session["session_id"]
    statements = [statement(sid, "aud1"), statement(sid, "aud2")]
    answer = tracker.client.post("/v1/audits", json=report(sid, statements, verdict="pass"))
    assert answer.status_code == 201, answer.text
    assert answer.json()["auditors"] == ["aud1", "aud2"] and "bit for bit" in answer.json()["reason"]
    assert tracker.nodes()["head"]["suspended"] is None and tracker.nodes()["head"]["reliability"] == 1.0
    assert voided(tracker, sid) == {"head": None, "tail": None}
    assert tracker.audits()["suspended"] == []
    tracker.open()


def test_a_failed_tail_is_failed_on_the_answer_it_signed(tracker: Tracker) -> None:
    sid = tracker.open()["session_id"]
    receipt, evidence = tail_evidence(sid)
    body = {"session_id": sid, "node_id": "tail", "layers": "15:30", "kind": "reexecuted", "verdict": "fail",
            "reason": "", "receipt": receipt, "statements": [tail_statement(sid, "aud3", 9, DRAW_9)],
            "answer": None}  # fmt: skip
    without = tracker.client.post("/v1/audits", json=body)
    assert without.status_code == 400 and without.json()["error"]["param"] == "answer", without.text
    forged = {**evidence, "answer": {**evidence["answer"], "token": 9}}  # not what it signed
    assert tracker.client.post("/v1/audits", json={**body, "answer": forged}).status_code == 400
    honest = {**body, "statements": [tail_statement(sid, "aud3", 7, DRAW_7)], "answer": evidence}
    refused = tracker.client.post("/v1/audits", json=honest)
    assert refused.status_code == 400 and "do not bear out verdict 'fail'" in refused.text
    assert tracker.audits()["audits"] == []
    answer = tracker.client.post("/v1/audits", json={**body, "answer": evidence})
    assert answer.status_code == 201, answer.text
    assert "answered token 7" in answer.json()["reason"]
    assert tracker.nodes()["tail"]["suspended"] is not None
    passed = tracker.client.post("/v1/audits", json={**honest, "verdict": "pass", "statements": [
        tail_statement(sid, "aud3", 7, DRAW_7)]})  # fmt: skip
    assert passed.status_code == 200 and passed.json()["duplicate"] is True  # aud3 already reported on it


def _refused(tracker: Tracker, body: dict[str, Any], says: str, status: int = 400) -> None:
    answer = tracker.client.post("/v1/audits", json=body)
    assert answer.status_code == status, (says, answer.text)
    error = answer.json()["error"]
    assert says in error["message"] + str(error["param"]), (says, error)


def test_forged_or_unfounded_reports_are_refused_and_change_nothing(tracker: Tracker) -> None:
    session, other = tracker.open(), tracker.open()
    tracker.bill(session)
    sid = session["session_id"]
    bad = "cc" * 16

    def failing(**fields: Any) -> Any:
        return statement(sid, "aud1", output=bad, **fields)

    cases = [
        (report(sid, [failing(signer="aud2")]), "signature of auditor aud1"),  # another auditor's key
        (report(sid, [statement(sid, "ghost", output=bad)]), "not a live node"),  # never registered
        (report(sid, [statement(sid, "tail", output=bad)]), "not registered as an auditor"),
        (report(sid, [statement(sid, "aud3", output=bad)]), "serves layers 15:30"),  # not the head's layers
        (report(sid, [failing(session=other["session_id"])]), "is about session"),
        (report(sid, [failing(node="tail")]), "is about session"),
        (report(sid, [failing()], receipt=head_receipt(sid, signer="aud1")), "signature over session"),
        (report(sid, [failing()], receipt=head_receipt(other["session_id"])), "signature over session"),
        (report(sid, [statement(sid, "aud1")]), "do not bear out verdict 'fail'"),  # it computed the same
        (report(sid, [failing()], verdict="pass"), "do not bear out verdict 'pass'"),
        (report(sid, [failing(), statement(sid, "aud2")]), "do not bear out"),  # the auditors disagree
        (report(sid, [failing(), failing()]), "a second statement of auditor aud1"),
        (report(sid, [failing(held=HELD - 1)]), "other inputs"),  # not the receipt's work
        (report(sid, []), "statements"),
        (report(sid, [failing()] * 5), "statements"),
        (report(sid, [{"session": sid}]), "statements.0"),
        (report(sid, [failing()], layers="0:16"), "never served layers"),
        (report(sid, [failing()], node_id="aud1"), "never served"),
        (report(sid, [failing()], layers="zero"), "layers"),
        (report(sid, [failing()], reason="x" * 2001), "reason"),
        (report(sid, [failing()], kind="guessed"), "kind"),
        (report(sid, [failing()], extra=1), "extra"),
        (report(sid, [failing()], answer=tail_evidence(sid)[1]), "answer"),  # evidence is a tail's
        (report(sid, [failing()], receipt={"entry": {"node": "head"}}), "receipt.entry"),
        (report(sid, [], kind="withheld", verdict="pass"), "is a fail"),
        (report(sid, [failing()], kind="withheld"), "carries no statements"),
    ]
    for body, says in cases:
        _refused(tracker, body, says)
    _refused(tracker, report("ses-none", [failing()]), "no session ses-none", 404)
    assert tracker.client.post("/v1/audits", content=b"{not json").status_code == 400
    assert tracker.audits() == {"audits": [], "suspended": []}
    assert tracker.nodes()["head"]["suspended"] is None and voided(tracker, sid) == {"head": None, "tail": None}


def test_a_withheld_seam_log_is_one_failure_and_voids_that_session_only(tracker: Tracker) -> None:
    audited, other = tracker.open(), tracker.open()
    tracker.bill(audited)
    tracker.bill(other)
    body = report(audited["session_id"], [], kind="withheld", reason="")
    answer = tracker.client.post("/v1/audits", json=body)
    assert answer.status_code == 201, answer.text
    assert answer.json()["kind"] == "withheld" and answer.json()["auditors"] == []
    assert "did not hand over its seam log" in answer.json()["reason"]
    assert "head" not in tracker.nodes()  # off the live set until its next heartbeat, as a failure report does
    assert tracker.register("head", "0:15").status_code == 201
    head = tracker.nodes()["head"]
    assert head["suspended"] is None and head["reliability"] < 1.0  # counted once; not suspended for good
    assert voided(tracker, audited["session_id"])["tail"] is None
    assert "withheld" in str(voided(tracker, audited["session_id"])["head"])
    assert voided(tracker, other["session_id"]) == {"head": None, "tail": None}
    again = tracker.client.post("/v1/audits", json=body)
    assert again.status_code == 200 and again.json()["audit_id"] == answer.json()["audit_id"]
    tail = report(audited["session_id"], [], kind="withheld", node_id="tail", layers="15:30",
                  receipt=tail_evidence(audited["session_id"])[0])  # fmt: skip
    _refused(tracker, tail, "no seam log to withhold")


def test_a_resent_report_answers_the_stored_one(tracker: Tracker) -> None:
    sid = tracker.open()["session_id"]
    body = report(sid, [statement(sid, "aud1", output="cc" * 16)])
    first = tracker.client.post("/v1/audits", json=body)
    again = tracker.client.post("/v1/audits", json=body)
    assert first.status_code == 201 and again.status_code == 200, again.text
    assert {k: v for k, v in again.json().items() if k != "duplicate"} == {
        k: v for k, v in first.json().items() if k != "duplicate"
    }
    assert len(tracker.audits()["audits"]) == 1
    assert tracker.billing()["totals"]["voided_records"] == 0  # nothing was billed; nothing voided twice


def test_the_audit_list_filters_and_refuses_bad_values(tracker: Tracker) -> None:
    one, two = tracker.open(), tracker.open()
    for session, auditor in ((one, "aud1"), (two, "aud1"), (two, "aud2")):
        sid = session["session_id"]
        answer = tracker.client.post("/v1/audits", json=report(sid, [statement(sid, auditor)], verdict="pass"))
        assert answer.status_code == 201, answer.text
    newest_first = tracker.audits()["audits"]
    assert [(a["session_id"], a["auditors"]) for a in newest_first] == [
        (two["session_id"], ["aud2"]), (two["session_id"], ["aud1"]), (one["session_id"], ["aud1"])]  # fmt: skip
    assert set(newest_first[0]) == {"audit_id", "session_id", "node_id", "layers", "kind", "verdict", "reason",
                                    "auditors", "recorded_at"}  # fmt: skip
    assert len(tracker.audits(session_id=one["session_id"])["audits"]) == 1
    assert len(tracker.audits(node_id="head")["audits"]) == 3 and tracker.audits(node_id="tail")["audits"] == []
    assert len(tracker.audits(verdict="pass")["audits"]) == 3 and tracker.audits(verdict="fail")["audits"] == []
    assert [a["auditors"] for a in tracker.audits(limit=1)["audits"]] == [["aud2"]]
    for params, param in (({"verdict": "maybe"}, "verdict"), ({"limit": "0"}, "limit"), ({"limit": "1001"}, "limit"),
                          ({"limit": "ten"}, "limit")):  # fmt: skip
        answer = tracker.client.get("/v1/audits", params=params)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


# -- a private swarm -----------------------------------------------------------------------------
class PrivateSwarm:
    """A private swarm's tracker whose members joined with real invites (the registry knows them,
    so ``revoke_member`` can revoke them); a client per member stands for its TLS connection."""

    def __init__(self, directory: Path) -> None:
        self.db = TrackerDB(f"sqlite:///{directory}/tracker.db")
        self.ca = SwarmCA.init(directory / "swarm", name="lab")
        self.app = create_tracker_app(self.db, swarm=SwarmAuthority.load(directory / "swarm"))
        self.clients: dict[str, TestClient] = {}

    def join(self, member_id: str, role: str = "node", *, trusted: bool = False) -> TestClient:
        token = mint_invite(self.ca, role=role, trusted=trusted, member_id=member_id)
        csr = make_csr(new_member_key(), member_id).decode()
        sans = [f"{member_id}.local"] if role == "node" else []
        body = {"token": token, "csr": csr, "member_id": member_id, "sans": sans}
        answer = TestClient(self.app).post("/v1/swarm/join", json=body)
        assert answer.status_code == 201, answer.text
        self.clients[member_id] = TestClient(_as_member(self.app, answer.json()["certificate"].encode()))
        return self.clients[member_id]

    def register(self, node_id: str, layers: str, **fields: Any) -> Any:
        return self.clients[node_id].post("/v1/nodes", json=node_body(node_id, layers, scheme="https", **fields))


@pytest.fixture
def private(tmp_path: Path) -> Iterator[PrivateSwarm]:
    swarm = PrivateSwarm(tmp_path)
    try:
        yield swarm
    finally:
        swarm.db.close()


def test_a_private_swarm_takes_only_trusted_auditors_and_revokes_on_two_auditors(private: PrivateSwarm) -> None:
    for node_id, trusted in (("head", False), ("tail", False), ("aud1", True), ("aud2", True), ("evil", False)):
        private.join(node_id, trusted=trusted)
    gateway, other = private.join("gw", "gateway"), private.join("gw2", "gateway")
    refused = private.register("evil", "0:15", auditor=True)
    assert refused.status_code == 403 and "an auditor must be a trusted member" in refused.json()["error"]["message"]
    for node_id, layers in (("head", "0:15"), ("tail", "15:30"), ("aud1", "0:15"), ("aud2", "0:15")):
        answer = private.register(node_id, layers, auditor=node_id.startswith("aud"))
        assert answer.status_code == 201, answer.text
    session = gateway.post("/v1/sessions", json={"model": MODEL, "total_layers": 30}).json()
    assert [h["node_id"] for h in session["hops"]] == ["head", "tail"]
    sid = session["session_id"]
    first = report(sid, [statement(sid, "aud1", output="cc" * 16)])
    not_owner = other.post("/v1/audits", json=first)
    assert not_owner.status_code == 403 and "was opened by 'gw'" in not_owner.json()["error"]["message"]
    assert gateway.post("/v1/audits", json=first).status_code == 201
    assert private.register("head", "0:15").status_code == 200  # one auditor's word: suspended, not revoked
    assert other.get("/v1/audits").json()["suspended"][0]["node_id"] == "head"  # any member reads them
    untrusted_lift = gateway.delete("/v1/suspensions/head")
    assert untrusted_lift.status_code == 403 and "trusted" in untrusted_lift.json()["error"]["message"]
    second = gateway.post("/v1/audits", json=report(sid, [statement(sid, "aud2", output="cc" * 16)]))
    assert second.status_code == 201, second.text
    revoked = private.register("head", "0:15")  # two auditors' word: its certificate is revoked
    assert revoked.status_code == 401 and revoked.json()["error"]["code"] == "certificate_revoked"
    listed = {n["node_id"] for n in gateway.get("/v1/nodes").json()["nodes"]}
    assert "head" not in listed and {"tail", "aud1", "aud2"} <= listed
    admin = private.join("ops", "gateway", trusted=True)
    assert admin.delete("/v1/suspensions/head").status_code == 200  # the suspension lifts; the revocation stays
