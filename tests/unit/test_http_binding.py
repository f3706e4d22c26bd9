"""The HTTP binding of the hop records (protocol.http_binding, protocol.messages): golden headers
and bodies as docs/protocol.md writes them, round trips, and every malformed field refused."""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest

from meshnet.errors import BadGateway, HopFailed, InvalidRequest, SeamMismatch, SessionBroken
from meshnet.ids import SessionId
from meshnet.protocol import headers as H
from meshnet.protocol.http_binding import (
    answer_from_response,
    decode_request,
    decode_reroute,
    encode_request,
    encode_reroute,
    error_from_response,
)
from meshnet.protocol.messages import (
    Accepted,
    AnswerKind,
    Cached,
    HopAnswer,
    HopEntry,
    HopRequest,
    Payload,
    Replayed,
    Rerouted,
    RerouteRequest,
    Restored,
    TokenAnswer,
    Verb,
    VerifyAnswer,
    Voided,
    answer_from_json,
    remote_error,
)
from meshnet.protocol.wire import encode_tensor
from meshnet.sampling import Draw

SID = SessionId("abc")
BIG = 1 << 20


def activations(n: int, ids: list[int] | None = None) -> Payload:
    frame = encode_tensor(np.arange(n * 2, dtype=np.float32).reshape(1, n, 2), "float32")
    return Payload(frame, None if ids is None else np.array(ids, dtype="<i4").tobytes())


def test_a_first_prefill_chunk_encodes_to_the_documented_headers_and_body() -> None:
    ids = Payload(encode_tensor(np.array([[1, 258]], dtype=np.int32), "int32"))
    request = HopRequest(
        Verb.PREFILL, SID, 0, 2, ids, model="m", route_id="r", next_hops=("http://b:1", "http://c:2"),
        sampling='{"temperature":0.0}', chunks=(1, 1), sample=True,
    )  # fmt: skip
    path, headers, body = encode_request(request)
    assert path == "/v1/sessions/abc/prefill"
    assert headers == {
        H.MODEL: "m",
        H.ROUTE_ID: "r",
        H.TOKEN_RANGE: "0-1",
        H.NEXT_HOPS: "http://b:1,http://c:2",
        H.SAMPLING: '{"temperature":0.0}',
        H.CHUNKS: "1x2",
        H.SAMPLE: "1",
        H.SHAPE: "1,2",
        H.DTYPE: "int32",
        "Content-Type": "application/octet-stream",
    }
    assert body.hex() == "0100000002010000"


def test_a_verify_chunk_with_token_ids_puts_the_ids_first_in_the_body() -> None:
    request = HopRequest(Verb.VERIFY, SID, 7, 3, activations(3, [5, 6, 7]), route_id="r", drafts=(6, 7), rewind=True)
    path, headers, body = encode_request(request)
    assert path == "/v1/sessions/abc/verify"
    assert headers[H.POSITION] == "7" and headers[H.DRAFT] == "6,7" and headers[H.REWIND] == "1"
    assert headers[H.TOKEN_IDS] == "3" and headers[H.SHAPE] == "1,3,2" and headers[H.DTYPE] == "float32"
    assert body[:12] == np.array([5, 6, 7], dtype="<i4").tobytes()
    assert len(body) == 12 + 3 * 2 * 4


@pytest.mark.parametrize(
    "request_",
    [
        HopRequest(Verb.PREFILL, SID, 4, 3, activations(3), model="m", route_id="r", chunks=(2, 1), replay=2),
        HopRequest(Verb.PREFILL, SID, 0, 3, activations(3, [1, 2, 3]), next_hops=(), sampling="{}", sample=True),
        HopRequest(Verb.DECODE, SID, 9, 1, activations(1), route_id="r", rewind=True, replay=1),
        HopRequest(Verb.VERIFY, SID, 9, 4, activations(4), drafts=(1, 2, 3)),
        HopRequest(Verb.VERIFY, SID, 9, 4, activations(4), drafts=(1, 2, 3), guess=40),
        HopRequest(Verb.DECODE, SID, 9, 1, activations(1), guess=0),
    ],
)
def test_every_request_survives_the_round_trip(request_: HopRequest) -> None:
    path, headers, body = encode_request(request_)
    verb = Verb(path.rsplit("/", 1)[1])
    assert decode_request(verb, SID, headers, body, max_body_bytes=BIG) == request_


@pytest.mark.parametrize(
    ("verb", "change", "error", "message"),
    [
        (Verb.DECODE, {H.POSITION: "-1"}, SeamMismatch, "absolute position"),
        (Verb.PREFILL, {H.TOKEN_RANGE: "5-2"}, SeamMismatch, "FIRST <= LAST"),
        (Verb.VERIFY, {H.DRAFT: "1,x"}, InvalidRequest, "drafted token ids"),
        (Verb.VERIFY, {H.REPLAY: "1"}, InvalidRequest, "never replayed"),
        (Verb.DECODE, {H.REPLAY: "0"}, InvalidRequest, ">= 1"),
        (Verb.PREFILL, {H.REPLAY: "1", H.SAMPLE: "1"}, InvalidRequest, "answers no token"),
        (Verb.PREFILL, {H.CHUNKS: "5"}, InvalidRequest, "X-Meshnet-Chunks"),
        (Verb.DECODE, {H.SHAPE: "1,1,3"}, SeamMismatch, "needs 12 bytes"),
        (Verb.DECODE, {H.DTYPE: "int8"}, SeamMismatch, "not supported"),
        (Verb.DECODE, {H.TOKEN_IDS: "2"}, SeamMismatch, "position count 1"),
        (Verb.DECODE, {H.GUESS: "-3"}, InvalidRequest, "token id, guessed"),
        (Verb.PREFILL, {H.GUESS: "3"}, InvalidRequest, "only a decode step or a verify chunk"),
        (Verb.DECODE, {H.GUESS: "3", H.REPLAY: "1"}, InvalidRequest, "never replayed"),
    ],
)
def test_a_malformed_request_is_refused_with_what_to_fix(
    verb: Verb, change: dict[str, str], error: type[Exception], message: str
) -> None:
    n = 3 if verb is Verb.PREFILL else 1
    base = {H.TOKEN_RANGE: "0-2", H.POSITION: "0", H.DRAFT: "4", H.SHAPE: f"1,{n + int(verb is Verb.VERIFY)},2"}
    base[H.DTYPE] = "float32"
    if verb is Verb.VERIFY:
        n = 2
    headers = {**base, **change}
    body = np.zeros((1, n, 2), dtype=np.float32).tobytes()
    with pytest.raises(error, match=message):
        decode_request(verb, SID, headers, body, max_body_bytes=BIG)


def test_a_reroute_round_trips_and_bounds_its_replay() -> None:
    request = RerouteRequest(SID, ("http://b:1", "http://c:2"), "r", model="m", replay=2, sampling="{}", step=12)
    path, headers = encode_reroute(request)
    assert path == "/v1/sessions/abc/reroute"
    assert decode_reroute(SID, headers) == request
    with pytest.raises(InvalidRequest, match=r"0\.\.2"):
        decode_reroute(SID, {**headers, H.REPLAY: "3"})
    with pytest.raises(InvalidRequest, match=r"0\.\.2"):
        decode_reroute(SID, {**headers, H.REPLAY: "x"})
    without = dataclasses.replace(request, resend=False)
    _, headers = encode_reroute(without)
    assert headers[H.RESEND] == "0" and decode_reroute(SID, headers) == without
    with pytest.raises(InvalidRequest, match="X-Meshnet-Resend"):
        decode_reroute(SID, {**headers, H.RESEND: "no"})


ENTRY = HopEntry("n1", "0:10/30", 1.5, 12, "aa" * 16, "bb" * 16, positions=1)


ANSWERS = [
    Accepted((ENTRY,), count=4),
    Replayed((ENTRY,), count=4),
    Cached((ENTRY, ENTRY), count=256),
    Restored((ENTRY,), count=12),
    TokenAnswer((ENTRY, ENTRY), position=13, token=5, logprob=-0.25, top=((5, -0.25), (7, -2.0))),
    TokenAnswer((ENTRY,), position=13, token=42, logprob=-0.125, draw=Draw((42, 7), (0.75, 0.125), 1.0, 100)),
    VerifyAnswer(
        (ENTRY,),
        position=15,
        tokens=(1, 2, 3),
        logprobs=(0.0, -1.0, -2.0),
        drafted=3,
        accepted=2,
        tops=(((1, 0.0),), ((2, -1.0),), ((3, -2.0),)),
    ),
    VerifyAnswer((ENTRY,), position=13, tokens=(9,), logprobs=(-0.5,), drafted=2),
    Rerouted((ENTRY,), position=12, session=SID, next_hops=("http://b:1",)),
    Voided((ENTRY, ENTRY), count=17),
]


@pytest.mark.parametrize("answer", ANSWERS)
def test_every_answer_survives_json_and_an_http_response(answer: HopAnswer) -> None:
    assert answer_from_json(answer.status, answer.to_json()) == answer
    response = httpx.Response(answer.status, json=answer.to_json())
    assert answer_from_response(response, "http://b:1") == answer


def test_every_kind_round_trips_to_a_record_of_its_own_class() -> None:
    kinds = {type(answer): answer.kind for answer in ANSWERS}
    assert sorted(kinds.values()) == sorted(AnswerKind)  # one record class per kind, each tested
    for answer in ANSWERS:
        back = answer_from_json(answer.status, answer.to_json())
        assert type(back) is type(answer) and back.kind is answer.kind and back == answer
        assert back.to_json() == answer.to_json()
    assert [a.status for a in ANSWERS if a.status != 200] == [202]  # only a pipelined chunk is accepted


def test_a_record_has_its_own_kinds_fields_and_no_others() -> None:
    accepted, token = Accepted((ENTRY,), count=4), ANSWERS[4]
    assert accepted.kind is AnswerKind.ACCEPTED and accepted.count == 4
    for field in ("token", "position", "tokens", "session", "draw"):
        assert not hasattr(accepted, field)
    assert isinstance(token, TokenAnswer) and token.token == 5
    for field in ("count", "tokens", "logprobs", "drafted", "accepted", "next_hops"):
        assert not hasattr(token, field)
    assert {f.name for f in dataclasses.fields(Rerouted)} == {"hops", "position", "session", "next_hops"}
    assert {f.name for f in dataclasses.fields(Cached)} == {"hops", "count"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        accepted.count = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        object.__setattr__(accepted, "token", 5)  # slots: no room for another kind's field


def test_an_answer_gains_the_entries_of_the_hops_before_it() -> None:
    tail = HopEntry("n2", "10:20/30", 1.0, 12, "bb" * 16)
    answer = Restored((tail,), count=12).after(ENTRY)
    assert answer == Restored((ENTRY, tail), count=12)


def test_a_token_answer_has_the_documented_fields() -> None:
    answer = TokenAnswer((ENTRY,), position=13, token=5, logprob=-0.25)
    assert answer.to_json() == {
        "token": 5,
        "logprob": -0.25,
        "position": 13,
        "hops": [
            {
                "node": "n1",
                "layers": "0:10/30",
                "positions": 1,
                "compute_ms": 1.5,
                "held": 12,
                "input_digest": "aa" * 16,
                "output_digest": "bb" * 16,
            }
        ],
    }


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"token": 5, "logprob": -1.0, "position": 3},
        {"token": "5", "logprob": -1.0, "position": 3, "hops": []},
        {"token": True, "logprob": -1.0, "position": 3, "hops": []},
        {"token": 5, "logprob": -1.0, "position": -3, "hops": []},
        {"token": 5, "logprob": -1.0, "position": 3, "hops": [{"node": "n"}]},
        {"tokens": [1], "logprobs": [], "position": 3, "drafted": 1, "accepted": 0, "hops": []},
        {"token": 5, "logprob": -1.0, "position": 3, "top": [[1]], "hops": []},
    ],
)
def test_an_answer_that_is_not_one_is_a_failure_of_the_hop_that_sent_it(raw: object) -> None:
    with pytest.raises(HopFailed, match="not a hop answer") as failed:
        answer_from_response(httpx.Response(200, json=raw), "http://b:1")
    assert failed.value.failed_hop == "http://b:1"


def test_one_error_map_for_http_answers_and_in_process_errors() -> None:
    deeper = httpx.Response(409, json={"error": {"message": "broken", "failed_hop": "http://c:2"}})
    assert error_from_response(deeper, "http://b:1", sender_is_head=False).failed_hop == "http://c:2"
    own = httpx.Response(400, json={"error": {"message": "bad shape"}})
    assert error_from_response(own, "http://b:1", sender_is_head=False).failed_hop == "http://b:1"
    assert type(error_from_response(own, "http://a:0", sender_is_head=True)) is BadGateway
    # the same error raised in process maps the same way
    local = remote_error(SessionBroken("broken", failed_hop="http://c:2"), sender="http://b:1", sender_is_head=False)
    assert isinstance(local, HopFailed) and local.failed_hop == "http://c:2"
    assert type(remote_error(SeamMismatch("bad shape"), sender="http://a:0", sender_is_head=True)) is BadGateway


def test_onward_keeps_every_field_but_what_the_next_hop_gets_new() -> None:
    """``HopRequest.onward`` and ``HopEntry.signed`` build their records field by field (cheaper than
    ``dataclasses.replace`` on a decode step's path): every other field, a new one included, is kept."""
    from meshnet.protocol.messages import PrefixClaim
    from meshnet.protocol.wire import TensorFrame

    frame = TensorFrame((1, 1), "int32", b"\x07\x00\x00\x00")
    request = HopRequest(
        Verb.PREFILL, SessionId("s"), 0, 4, Payload(frame), model="m", route_id="r", next_hops=("b", "c"),
        sampling='{"temperature": 0.5}', chunks=(2, 2), replay=2, rewind=True, ticket="t",
        prefix=PrefixClaim(4, ("h",)),
    )  # fmt: skip
    other = Payload(TensorFrame((1, 4, 2), "float32", bytes(32)))
    expected = dataclasses.replace(request, payload=other, model="m2", route_id="r2", next_hops=("c",), replay=1)
    assert request.onward(other, ("b", "c"), model="m2", route_id="r2") == expected
    verify = HopRequest(Verb.VERIFY, SessionId("s"), 9, 3, Payload(frame), drafts=(5, 6), rewind=True, guess=7)
    assert verify.onward(other, ("b",), model="m", route_id="r") == dataclasses.replace(
        verify, payload=other, model="m", route_id="r"
    )
    entry = HopEntry("n", "0:4", 1.5, 4, "ab", "cd", 4)
    assert entry.signed("sig") == dataclasses.replace(entry, signature="sig")
