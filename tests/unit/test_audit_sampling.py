"""Audit sampling's parts, in-process (protocol.audits, node.audit, gateway.audits): a chain of
fake-shard nodes serves a session, an auditor of each hop's layers re-executes it from the hops'
seam logs, and the verdicts are judged; the records' encodings and every malformed input."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest

from meshnet.errors import Conflict, Forbidden, InvalidRequest, SeamMismatch
from meshnet.gateway.audits import Audits, numerics_class
from meshnet.node.audit import reexecute
from meshnet.node.service import NodeConfig, NodeService
from meshnet.protocol.audits import (
    PROBABILITY_TOLERANCE,
    RESIDUAL_TOLERANCE,
    AuditRequest,
    AuditStatement,
    AuditStep,
    Finding,
    draw_deviation,
    judge,
    sign_statement,
    statement_signed_by,
    token_at,
)
from meshnet.protocol.messages import AnswerKind, HopAnswer, HopEntry, TokenAnswer
from meshnet.protocol.signing import HopKey, claim_of
from meshnet.protocol.wire import frame_values
from meshnet.sampling import Draw
from tests.unit.test_node_service import PROMPT, SID, MixShard, Swarm, chain, prefill, step

CHUNK = 4


def _serve(swarm: Swarm, route: list[str], n: int) -> tuple[list[int], list[int], list[HopAnswer]]:
    """Prefill ``PROMPT`` in chunks of ``CHUNK`` and decode ``n`` greedy tokens: the route's token ids
    (every position it holds), the chunks, and the tail's answers."""

    async def main() -> tuple[list[int], list[int], list[HopAnswer]]:
        answers: list[HopAnswer] = []
        chunks: list[int] = []
        for start in range(0, len(PROMPT), CHUNK):
            part = PROMPT[start : start + CHUNK]
            final = start + CHUNK >= len(PROMPT)
            answer = await swarm.send(route[0], prefill(part, start, route=route, final=final, first=start == 0))
            chunks.append(len(part))
        answers.append(answer)
        tokens = [*PROMPT, answer.token]
        while len(tokens) < len(PROMPT) + n:
            answer = await swarm.send(route[0], step(tokens[-1], len(tokens) - 1))
            chunks.append(1)
            answers.append(answer)
            tokens.append(answer.token)
        return tokens[:-1], chunks, answers  # the route holds every token but the newest

    return asyncio.run(main())


def _request(services: list[NodeService], index: int, ids: list[int], chunks: list[int], sampling: dict[str, Any]):
    service = services[index]
    ids_bytes = np.asarray(ids, dtype="<i4").tobytes()
    if index == 0:
        dtype, inputs = "int32", ids_bytes
    else:
        frame, served = services[index - 1].seam_log(SID)
        assert list(served) == chunks
        dtype, inputs = frame.dtype, frame.body
    tail = service.info.layers.is_tail
    positions = tuple(range(len(PROMPT), len(ids) + 1)) if tail else ()
    return AuditRequest("s1", service.config.node_id, str(service.info.layers), tuple(chunks), dtype, inputs,
                        "float32", ids_bytes, sampling if tail else None, positions)  # fmt: skip


def _answers(answers: list[HopAnswer]) -> dict[int, tuple[HopEntry, dict[str, Any]]]:
    kept = {}
    for a in answers:
        claim = claim_of(a)
        assert isinstance(a, TokenAnswer) and claim is not None and a.draw is not None
        kept[a.position] = (a.hops[-1], claim)
    return kept


def _served(n: int) -> tuple[list[NodeService], list[int], list[int], list[HopAnswer], dict[str, HopEntry]]:
    """A three-hop chain that served ``n`` tokens: its services, token ids, chunks, the tail's answers
    and each hop's receipt (its entry in the last answer)."""
    swarm = Swarm()
    route = chain(swarm)
    services = [swarm.transport.services[u] for u in route]
    ids, chunks, answers = _serve(swarm, route, n)
    return services, ids, chunks, answers, {e.node: e for e in answers[-1].hops}  # type: ignore[return-value]


def test_an_auditor_of_each_hops_layers_re_executes_the_session_bit_for_bit_and_the_hops_pass() -> None:
    services, ids, chunks, answers, receipts = _served(6)
    key = HopKey.generate()
    sampling = {"temperature": 0.0}
    for index, service in enumerate(services):
        auditor = MixShard(str(service.info.layers))
        statement = reexecute(auditor, key, "auditor", _request(services, index, ids, chunks, sampling))
        assert statement_signed_by(key.public, statement)
        found = judge(statement, receipts[service.config.node_id], _answers(answers))
        assert found == Finding("pass", found.reason), found
        assert not list(auditor.store.ids())  # the scratch session is gone


def test_a_hop_whose_layers_give_other_outputs_fails_and_a_tail_that_commits_other_draws_fails() -> None:
    services, ids, chunks, answers, receipts = _served(6)
    key = HopKey.generate()
    liar_view = MixShard("4:8")
    liar_view.salt += 1  # what honest layers 4:8 give is not what the middle hop sent
    statement = reexecute(liar_view, key, "auditor", _request(services, 1, ids, chunks, {}))
    assert judge(statement, receipts["http://middle"]).verdict == "fail"
    # The tail: an answer whose token (or committed draw) is not what its layers give.
    greedy = {"temperature": 0.0}
    tail_statement = reexecute(MixShard("8:12"), key, "auditor", _request(services, 2, ids, chunks, greedy))
    committed = _answers(answers)
    position = sorted(committed)[2]
    entry, claim = committed[position]
    forged = {**claim, "token": (claim["token"] + 1) % 50}
    found = judge(tail_statement, receipts["http://tail"], {**committed, position: (entry, forged)})
    assert (found.verdict, found.position) == ("fail", position)
    draw = dict(claim["draw"], probs=[0.5, *claim["draw"]["probs"][1:]])
    found = judge(tail_statement, receipts["http://tail"], {**committed, position: (entry, {**claim, "draw": draw})})
    assert (found.verdict, found.position) == ("fail", position) and "distribution" in found.reason
    # Evidence alone (the tracker's view): the one forged answer judges the same.
    alone = judge(tail_statement, receipts["http://tail"], {position: (entry, forged)}, complete=False)
    assert alone.verdict == "fail"


def test_a_statement_about_other_work_is_no_verdict_and_a_changed_statement_loses_its_signature() -> None:
    entry = HopEntry("n1", "0-4", 1.0, 8, "aa" * 16, "bb" * 16)
    statement = AuditStatement("s1", "n1", "0-4", "aud", 8, "aa" * 16, "bb" * 16)
    key = HopKey.generate()
    signed = sign_statement(key, statement)
    assert statement_signed_by(key.public, signed)
    assert not statement_signed_by(HopKey.generate().public, signed)
    assert not statement_signed_by(key.public, dataclasses.replace(signed, output_digest="cc" * 16))
    assert not statement_signed_by(key.public, statement)  # unsigned
    assert judge(signed, entry).verdict == "pass"
    with pytest.raises(ValueError, match="other inputs"):
        judge(signed, dataclasses.replace(entry, input_digest="dd" * 16))
    with pytest.raises(ValueError, match="other inputs"):
        judge(signed, dataclasses.replace(entry, held=9))
    with pytest.raises(ValueError, match="about node"):
        judge(signed, dataclasses.replace(entry, node="n2"))
    assert AuditStatement.from_json(signed.to_json()) == signed
    for bad in ({}, {**signed.to_json(), "held": -1}, {**signed.to_json(), "steps": "x"}, [], None):
        with pytest.raises(ValueError):
            AuditStatement.from_json(bad)
    step = AuditStep(3, "aa", 7, Draw((7, 2), (0.6, 0.3), 1.0, 50))
    assert AuditStep.from_json(step.to_json()) == step


def test_an_audit_request_round_trips_and_a_malformed_one_is_a_400() -> None:
    request = AuditRequest("s1", "n1", "4-8", (4, 4, 2, 1, 1), "float32", b"\0" * 96, "float16", b"\1\0\0\0" * 12,
                           {"temperature": 0.5, "seed": 3}, (10, 11, 12))  # fmt: skip
    assert AuditRequest.decode(request.encode()) == request
    body = request.encode()
    for bad in (b"", b"XXXX" + body[4:], body[:-1], body + b"\0", body[:8] + b"[" + body[9:]):
        with pytest.raises(InvalidRequest):
            AuditRequest.decode(bad)
    for change in ({"positions": (0,)}, {"positions": (13,)}, {"ids": b"\0" * 4}, {"dtype": "int8"}):
        with pytest.raises(InvalidRequest):
            AuditRequest.decode(dataclasses.replace(request, **change).encode())  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        AuditRequest.decode(dataclasses.replace(request, chunks=()).encode())


def test_an_auditor_refuses_inputs_of_another_shape_or_range_and_a_plain_node_refuses_audits() -> None:
    key = HopKey.generate()
    good = AuditRequest("s1", "n", "4:8", (2,), "float32", np.zeros((2, 2), np.float32).tobytes())
    shard = MixShard("4:8")
    good = dataclasses.replace(good, layers=str(shard.info.layers))
    assert reexecute(shard, key, "a", good).held == 2
    with pytest.raises(SeamMismatch):
        reexecute(shard, key, "a", dataclasses.replace(good, inputs=b"\0" * 8))
    with pytest.raises(SeamMismatch):
        reexecute(shard, key, "a", dataclasses.replace(good, dtype="int32"))
    with pytest.raises(InvalidRequest, match="layers"):
        reexecute(MixShard("0:4"), key, "a", good)
    middle = MixShard("4:8")  # a middle hop holds no vocabulary: the session's ids pass it unchecked
    middle.info = dataclasses.replace(middle.info, n_vocab=0)
    assert reexecute(middle, key, "a", dataclasses.replace(good, ids=np.array([5, 7], "<i4").tobytes())).held == 2
    swarm = Swarm()
    node = swarm.node("http://plain", "4:8")
    with pytest.raises(Forbidden, match="--auditor"):
        asyncio.run(node.audit(good.encode()))
    auditor = NodeService(MixShard("4:8"), NodeConfig(node_id="aud", url="http://aud", auditor=True), swarm.transport)
    statement = asyncio.run(auditor.audit(good.encode()))
    assert statement.auditor == "aud" and statement_signed_by(auditor.config.hop_key.public, statement)


def test_a_tail_has_no_seam_log_to_hand_over_and_the_head_hands_over_what_it_sent() -> None:
    swarm = Swarm()
    route = chain(swarm)
    services = [swarm.transport.services[u] for u in route]
    ids, chunks, answers = _serve(swarm, route, 3)
    with pytest.raises(Conflict, match="tail"):
        services[2].seam_log(SID)
    frame, served = services[0].seam_log(SID)
    assert frame.shape == (1, len(ids), 2) and list(served) == chunks
    assert frame_values(frame).shape == (1, len(ids), 2)
    assert answers[-1].kind is AnswerKind.TOKEN


def test_audits_are_chosen_at_the_rate_and_numerics_classes_ignore_threads() -> None:
    assert not any(Audits("http://t", 0.0).chosen() for _ in range(200))
    assert all(Audits("http://t", 1.0).chosen() for _ in range(200))
    picked = sum(Audits("http://t", 0.25).chosen() for _ in range(4000))
    assert 800 < picked < 1200
    with pytest.raises(ValueError):
        Audits("http://t", 1.5)
    one = "llama.cpp 0.3.36 cpu x86_64 Xeon; threads 1; n_batch 512; flash-attn; kv f16"
    assert numerics_class(one) == numerics_class(one.replace("threads 1", "threads 16"))
    assert numerics_class(one) != numerics_class(one.replace("kv f16", "kv q8_0"))
    assert numerics_class(None) is None


def test_across_numerics_classes_an_auditor_measures_the_deviation_of_what_the_hop_sent() -> None:
    services, ids, chunks, _, receipts = _served(4)
    key = HopKey.generate()
    frame, _ = services[1].seam_log(SID)
    request = dataclasses.replace(_request(services, 1, ids, chunks, {}), cross=True, outputs=frame.body)
    assert AuditRequest.decode(request.encode()) == request
    same = reexecute(MixShard("4:8"), key, "a", request)
    assert (same.tolerance, same.deviation) == (RESIDUAL_TOLERANCE, 0.0)
    assert AuditStatement.from_json(same.to_json()) == same
    assert judge(same, receipts["http://middle"]).verdict == "pass"
    other = MixShard("4:8")
    other.salt += 1  # other layers: every position's update differs
    found = judge(reexecute(other, key, "a", request), receipts["http://middle"])
    assert found.verdict == "fail" and "tolerance" in found.reason
    with pytest.raises(ValueError, match="other activations"):  # it compared something the hop did not sign
        judge(dataclasses.replace(same, compared_digest="00" * 16), receipts["http://middle"])


def test_across_numerics_classes_the_tails_draws_are_compared_within_the_tolerance() -> None:
    entry = HopEntry("t", "8:12", 1.0, 5, "aa" * 16)
    draw = Draw((4, 9), (0.6, 0.3), 1.0, 50)
    near = Draw((4, 9), (0.58, 0.33), 1.0, 50)
    far = Draw((9, 4), (0.8, 0.1), 1.0, 50)
    statement = AuditStatement("s1", "t", "8:12", "a", 5, "aa" * 16, steps=(AuditStep(5, "aa" * 16, 4, near),),
                               tolerance=PROBABILITY_TOLERANCE, deviation=0.0)  # fmt: skip
    claim = {"token": 4, "logprob": -0.5, "draw": draw.to_json(), "position": 5}
    assert judge(statement, entry, {5: (entry, claim)}).verdict == "pass"
    lied = {**claim, "draw": far.to_json()}
    assert judge(statement, entry, {5: (entry, lied)}).verdict == "fail"
    assert draw_deviation(draw, near) == pytest.approx(0.03)
    assert draw_deviation(draw, Draw((5,), (0.9,), 1.0, 50)) == pytest.approx(0.9)


def test_a_greedy_verify_chunks_tokens_are_judged_one_position_each() -> None:
    """A verify chunk's answer carries no draw: at each position it fills, its token must be the one
    the auditor's logits give (greedy: the most likely); its entry describes the whole chunk."""
    entry = HopEntry("t", "8:12", 1.0, 12, "ee" * 16)
    claim = {"tokens": [3, 5, 9], "logprobs": [-0.1, -0.2, -0.3], "position": 12, "drafted": 2, "accepted": 2}
    assert [token_at(claim, p) for p in (9, 10, 11, 12, 13)] == [None, 3, 5, 9, None]
    assert token_at({"token": 4, "position": 7}, 7) == 4 and token_at({"token": 4, "position": 7}, 8) is None
    draws = {10: Draw((3,), (0.9,), 1.0, 50), 11: Draw((5,), (0.8,), 1.0, 50), 12: Draw((9,), (0.7,), 1.0, 50)}
    steps = tuple(AuditStep(p, f"{p:02d}" * 16, d.ids[0], d) for p, d in draws.items())
    statement = AuditStatement("s1", "t", "8:12", "a", 12, "ee" * 16, steps=steps)
    answers = {p: (entry, claim) for p in draws}
    assert judge(statement, entry, answers).verdict == "pass"
    flipped = {**claim, "tokens": [3, 6, 9]}
    found = judge(statement, entry, {p: (entry, flipped) for p in draws})
    assert (found.verdict, found.position) == ("fail", 11)
