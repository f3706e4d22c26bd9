"""Signed hop entries (protocol.signing): the gateway takes an entry only signed by its own hop's
pinned key, and the tail's entry only over the answer it came with — a hop that makes up another's
entry, or changes the tail's token on the way, fails the check on that step."""

from __future__ import annotations

import dataclasses

import pytest

from meshnet.errors import InvalidRequest, RouteInconsistent
from meshnet.gateway.billing_outbox import Usage
from meshnet.layers import LayerRange
from meshnet.protocol.messages import AnswerKind, HopAnswer, HopEntry, TokenAnswer, VerifyAnswer, answer_from_json
from meshnet.protocol.signing import HopKey, check_public_key, check_signatures
from meshnet.routes import Hop
from meshnet.sampling import Draw
from meshnet.tracker.app import Registration
from meshnet.tracker.db import TrackerDB
from meshnet.tracker.sessions import parse_body

SESSION = "sess-1"
HEAD, TAIL = HopKey.generate(), HopKey.generate()
ROUTE = (
    Hop("head", "http://h", LayerRange(0, 6, 12), key=HEAD.public),
    Hop("tail", "http://t", LayerRange(6, 12, 12), key=TAIL.public),
)


def _entry(node: str, layers: str, held: int = 5) -> HopEntry:
    return HopEntry(node, layers, 1.25, held, "aa" * 16, "bb" * 16 if node == "head" else None, positions=1)


def honest(kind: AnswerKind = AnswerKind.TOKEN) -> HopAnswer:
    """What the route answers: the head's entry before the tail's, each signed by its own node."""
    head = HEAD.sign(SESSION, _entry("head", "0:6"))
    tail = TAIL.sign(SESSION, _entry("tail", "6:12"))
    answer: HopAnswer
    if kind is AnswerKind.TOKENS:
        answer = VerifyAnswer((tail,), position=7, tokens=(11, 12), logprobs=(-0.5, -0.25), drafted=2, accepted=1)
    else:
        answer = TokenAnswer((tail,), position=5, token=42, logprob=-0.125, top=((42, -0.125), (7, -2.5)))
    return TAIL.sign_answer(SESSION, answer).after(head)


def wire(answer: HopAnswer) -> HopAnswer:
    """The answer as the gateway parses it from the JSON a node sent."""
    return answer_from_json(answer.status, answer.to_json())


@pytest.mark.parametrize("kind", [AnswerKind.TOKEN, AnswerKind.TOKENS])
def test_an_honest_answer_passes_after_the_wire(kind: AnswerKind) -> None:
    check_signatures(SESSION, ROUTE, wire(honest(kind)))


def test_a_hop_that_changes_the_tails_token_is_caught() -> None:
    answer = wire(honest())
    with pytest.raises(RouteInconsistent, match=r"node tail .* and the answer it vouches for"):
        check_signatures(SESSION, ROUTE, dataclasses.replace(answer, token=43))
    with pytest.raises(RouteInconsistent):
        check_signatures(SESSION, ROUTE, dataclasses.replace(answer, logprob=-0.0))
    with pytest.raises(RouteInconsistent):
        check_signatures(SESSION, ROUTE, dataclasses.replace(answer, top=((43, -0.125),)))


def test_a_hop_cannot_make_up_another_hops_entry() -> None:
    answer = wire(honest())
    head, tail = answer.hops
    forged = HEAD.sign(SESSION, _entry("tail", "6:12"))  # the head signs the tail's entry with its own key
    with pytest.raises(RouteInconsistent, match="node tail"):
        check_signatures(SESSION, ROUTE, dataclasses.replace(answer, hops=(head, forged)))
    unsigned = dataclasses.replace(tail, signature=None)
    with pytest.raises(RouteInconsistent, match="is not signed"):
        check_signatures(SESSION, ROUTE, dataclasses.replace(answer, hops=(head, unsigned)))
    changed = dataclasses.replace(head, compute_ms=0.5)  # a later hop rewrites the head's entry
    with pytest.raises(RouteInconsistent, match="node head"):
        check_signatures(SESSION, ROUTE, dataclasses.replace(answer, hops=(changed, tail)))
    garbled = dataclasses.replace(head, signature="!" * 86)
    with pytest.raises(RouteInconsistent, match="node head"):
        check_signatures(SESSION, ROUTE, dataclasses.replace(answer, hops=(garbled, tail)))


def test_tail_only_checks_the_tails_signature_and_that_the_others_carry_one() -> None:
    answer = wire(honest())
    head, tail = answer.hops
    changed = dataclasses.replace(head, compute_ms=0.5)
    check_signatures(SESSION, ROUTE, dataclasses.replace(answer, hops=(changed, tail)), tail_only=True)
    with pytest.raises(RouteInconsistent, match="is not signed"):
        check_signatures(SESSION, ROUTE, dataclasses.replace(answer, hops=(dataclasses.replace(head, signature=None),
                                                                          tail)), tail_only=True)  # fmt: skip
    with pytest.raises(RouteInconsistent, match="node tail"):
        check_signatures(SESSION, ROUTE, dataclasses.replace(answer, token=43), tail_only=True)


def test_receipts_checked_late_void_the_pay_when_a_relayed_entry_was_forged() -> None:
    answer = wire(honest())
    keys = {h.node: h.key for h in ROUTE}
    usage = Usage()
    usage.add(ROUTE, decode=2)
    usage.signed(answer, SESSION, keys)
    assert set(usage.unchecked) == {"head"}  # the tail's was checked with its tokens
    assert usage.check_receipts() == [] and not usage.unchecked and len(usage.records()) == 2
    head, tail = answer.hops
    usage.signed(dataclasses.replace(answer, hops=(dataclasses.replace(head, compute_ms=0.5), tail)), SESSION, keys)
    assert usage.check_receipts() == ["head"] and usage.records() == []  # which relaying hop forged it is unknown


def test_a_hop_that_answers_alone_and_signs_the_token_itself_is_caught_before_the_tail_is_blamed() -> None:
    head = _entry("head", "0:6")
    alone = TokenAnswer((head,), position=5, token=42, logprob=-0.125)
    with pytest.raises(RouteInconsistent, match="answered for nodes"):
        check_signatures(SESSION, ROUTE, wire(HEAD.sign_answer(SESSION, alone)))


def test_an_entry_of_another_session_does_not_pass() -> None:
    with pytest.raises(RouteInconsistent):
        check_signatures("sess-2", ROUTE, wire(honest()))


def test_hops_pinned_without_a_key_are_not_checked() -> None:
    unkeyed = tuple(dataclasses.replace(h, key=None) for h in ROUTE)
    answer = wire(honest())
    check_signatures(SESSION, unkeyed, dataclasses.replace(answer, token=43))


def test_a_hop_key_is_checked_where_a_node_registers_it() -> None:
    assert check_public_key(HEAD.public) == HEAD.public
    for bad in ("", "!" * 43, HEAD.public[:-1], HEAD.public[:-1] + "+"):
        with pytest.raises(ValueError):
            check_public_key(bad)
    base = '{"node_id":"n","url":"http://10.0.0.1:7000","model":"m","layers":"0:6","total_layers":12'
    assert parse_body(Registration, f'{base},"hop_key":"{HEAD.public}"}}'.encode()).hop_key == HEAD.public
    with pytest.raises(InvalidRequest, match="hop_key"):
        parse_body(Registration, f'{base},"hop_key":"{"A" * 42}"}}'.encode())


def test_a_private_swarm_takes_no_node_that_does_not_sign(tmp_path) -> None:
    from tests.unit.test_tracker_trust import PrivateTracker

    db = TrackerDB(f"sqlite:///{tmp_path}/private.db")
    try:
        tracker = PrivateTracker(tmp_path, db)
        body = {"node_id": "n", "url": "https://n.local:7000", "model": "m", "layers": "0:30", "total_layers": 30}
        refused = tracker.member("n", trusted=False).post("/v1/nodes", json=body)
        assert refused.status_code == 400 and "hop_key" in refused.json()["error"]["message"], refused.text
        signed = tracker.member("n", trusted=False).post("/v1/nodes", json={**body, "hop_key": HEAD.public})
        assert signed.status_code in (200, 201), signed.text
        assert tracker.member("n", trusted=False).get("/v1/nodes").json()["nodes"][0]["hop_key"] == HEAD.public
    finally:
        db.close()


def test_the_tails_signature_covers_the_distribution_it_committed_to() -> None:
    draw = Draw((42, 7), (0.75, 0.125), 1.0, 100)
    tail = TAIL.sign(SESSION, _entry("tail", "6:12"))
    answer = TokenAnswer((tail,), position=5, token=42, logprob=-0.125, draw=draw)
    signed = wire(TAIL.sign_answer(SESSION, answer).after(HEAD.sign(SESSION, _entry("head", "0:6"))))
    assert signed.draw == draw
    check_signatures(SESSION, ROUTE, signed)
    forged = dataclasses.replace(draw, ids=(7, 42))  # a hop on the way makes the token look drawn
    with pytest.raises(RouteInconsistent, match="node tail"):
        check_signatures(SESSION, ROUTE, dataclasses.replace(signed, draw=forged))
