"""The decode channel's frames (golden bytes) and both of its ends, over real WebSockets on
loopback: a node's ``channel.serve`` with a scripted step handler, and the gateway's ``Channels``
(asyncio: each test runs its scenario on an event loop of its own, as the gateway's would be)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.sync.client import connect

from meshnet.errors import BadGateway, HopFailed, InvalidRequest, PayloadTooLarge, SeamMismatch, SessionBroken
from meshnet.ids import SessionId
from meshnet.node import channel
from meshnet.node.channel import Direct
from meshnet.protocol import channel_client
from meshnet.protocol.channel import (
    CHANNEL_PATH,
    Credit,
    Kind,
    credit_frame,
    decode_frame,
    encode_frame,
    read_credit,
    read_step,
    relayed_of,
    step_frame,
    step_ids,
    token_frame,
    ws_url,
)
from meshnet.protocol.channel_client import Channels, ChannelUnavailable, _answer, _Report
from meshnet.protocol.messages import HopAnswer, HopEntry, HopRequest, Payload, TokenAnswer, Verb, ids_payload
from meshnet.protocol.wire import encode_tensor
from meshnet.security.identity import MemberRequest, SwarmCA, make_csr, new_member_key
from meshnet.security.tls import save_member
from tests.asgi import serve_in_thread

HELLO_GOLDEN = bytes.fromhex("4d4e030128000000") + b'{"channel":"c1","node":"n1","version":3}'


def test_frames_have_the_documented_bytes() -> None:
    assert encode_frame(Kind.HELLO, {"channel": "c1", "node": "n1", "version": 3}) == HELLO_GOLDEN
    request = HopRequest(Verb.DECODE, SessionId("ses-1"), 5, 1, ids_payload([42]), model="m", route_id="r")
    step = step_frame(request, 7, ["c1"])
    header = (
        "0700000000000000" "05" + b"ses-1".hex()  # seq u64, session
        + "00" "05000000" "00000000" "03" "02" "0000"  # flags, position, guess, dtype (int32), rank, drafts
        + "01000000" "01000000"  # shape 1 x 1
        + "01" "02" + b"c1".hex()  # one return id
        + "01000000" + b"m".hex() + "01000000" + b"r".hex()  # model, route id
        + "ffffffff" * 3  # no ticket, sampling, next hops
    )  # fmt: skip
    prefix = b"MN\x03\x02" + (len(header) // 2).to_bytes(4, "little")
    assert step == prefix + bytes.fromhex(header) + b"\x2a\x00\x00\x00"
    frame = decode_frame(step)
    assert frame.kind is Kind.STEP and frame.header == {} and frame.body == b"\x2a\x00\x00\x00"
    read = read_step(frame)
    assert (read.session, read.seq, read.returns) == ("ses-1", 7, ("c1",)) and step_ids(frame) == ("ses-1", 7)
    assert read.request(1024) == request


def test_a_step_frame_carries_every_field_of_a_decode_step_or_verify_chunk() -> None:
    values = np.arange(12, dtype=np.float32).reshape(1, 3, 4)
    ids = np.asarray([5, 6, 7], dtype="<i4").tobytes()
    request = HopRequest(
        Verb.VERIFY, SessionId("ses-2"), 40, 3, Payload(encode_tensor(values, "bfloat16"), ids),
        model="SmolLM2-135M", route_id="rte-9", next_hops=("https://b:1", "https://c:2"), sampling='{"seed": 3}',
        drafts=(6, 7), rewind=True, guess=5, ticket="tkt.é",
    )  # fmt: skip
    step = read_step(decode_frame(step_frame(request, 2**40, ["x", "y", "z"])))
    assert (step.seq, step.returns) == (2**40, ("x", "y", "z")) and step.request(1 << 20) == request
    plain = HopRequest(Verb.DECODE, SessionId("s"), 0, 1, Payload(encode_tensor(values[:, :1], "float16")))
    assert read_step(decode_frame(step_frame(plain, 0, ["r"]))).request(1 << 20) == plain
    with pytest.raises(ValueError, match="no replay"):
        step_frame(dataclasses.replace(plain, replay=1), 0, ["r"])
    with pytest.raises(ValueError, match="not a prefill"):
        step_frame(dataclasses.replace(plain, verb=Verb.PREFILL), 0, ["r"])


def _step_bytes(**changes: Any) -> bytes:
    """A STEP frame of a one-position float32 decode step, with header fields replaced by ``changes``
    (raw bytes by name, in the layout's order)."""
    fields = {
        "seq": (9).to_bytes(8, "little"), "session": b"\x05ses-9", "flags": b"\x00",
        "position": (3).to_bytes(4, "little"), "guess": bytes(4), "dtype": b"\x00", "rank": b"\x02",
        "drafts": bytes(2), "shape": bytes.fromhex("0100000002000000"), "drafted": b"", "returns": b"\x01\x02r1",
        "strings": b"\xff\xff\xff\xff" * 5,
    }  # fmt: skip
    fields.update(changes)
    body = fields.pop("body", np.zeros(2, dtype="<f4").tobytes())
    header = b"".join(fields.values())
    return b"MN\x03\x02" + len(header).to_bytes(4, "little") + header + body


@pytest.mark.parametrize(
    ("changes", "error", "needle"),
    [
        ({"session": b"\x00"}, InvalidRequest, "session id is 1..128"),
        ({"session": b"\x03s\xffs"}, InvalidRequest, "session id is not ASCII"),
        ({"flags": b"\x10"}, InvalidRequest, "flags 0x10 set bits this node does not know"),
        ({"dtype": b"\x07"}, SeamMismatch, "dtype 7 is not one of 0..3"),
        ({"flags": b"\x01"}, InvalidRequest, "a verify chunk carries its drafted token ids"),
        ({"drafts": b"\x01\x00", "drafted": bytes(4)}, InvalidRequest, "a decode step none"),
        ({"returns": b"\x00"}, InvalidRequest, "needs the return ids"),
        ({"returns": b"\x02\x02r1"}, InvalidRequest, "ends before its return ids"),
        ({"strings": b"\xff\xff\xff\xff" * 4}, InvalidRequest, "ends before its next hops"),
        ({"strings": b"\xff\xff\xff\xff" * 5 + b"!"}, InvalidRequest, "1 bytes after its last field"),
        ({"strings": b"\x01\x00\x00\x00\xff" + b"\xff\xff\xff\xff" * 4}, InvalidRequest, "model is not UTF-8"),
        ({"shape": bytes(4) + b"\x02\x00\x00\x00"}, SeamMismatch, "must have 1-4 positive dimensions"),
        ({"body": bytes(7)}, SeamMismatch, "body is 7 bytes but shape 1,2 of float32 needs 8 bytes"),
        ({"flags": b"\x08", "body": bytes(3)}, SeamMismatch, "shorter than the 1 token ids"),
        ({"body": bytes(2048)}, PayloadTooLarge, "2048 bytes exceeds this node's limit of 1024"),
    ],
)
def test_a_bad_step_frame_says_which_field_is_wrong(changes: dict[str, bytes], error: type, needle: str) -> None:
    frame = decode_frame(_step_bytes(**changes))
    with pytest.raises(error, match=needle):
        read_step(frame).request(1024)
    assert step_ids(frame)[1] == 9  # the error names the step where the header's start is readable
    assert read_step(decode_frame(_step_bytes())).request(1024).start == 3  # (the unchanged frame is good)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"MN", "at least 8 bytes"),
        (b"XX\x01\x01\x00\x00\x00\x00", "not a Meshnet channel frame"),
        (b"MN\x02\x01\x00\x00\x00\x00", "version 2; this node speaks version 3"),
        (b"MN\x03\x09\x00\x00\x00\x00", "unknown channel frame kind 9"),
        (b"MN\x03\x02\xff\x00\x00\x00{}", "does not fit"),
        (b"MN\x03\x03\x02\x00\x00\x00{x", "not JSON"),
        (b"MN\x03\x03\x02\x00\x00\x00[]", "JSON object"),
    ],
)
def test_a_bad_frame_says_what_is_wrong(data: bytes, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        decode_frame(data)


def test_channel_urls() -> None:
    assert ws_url("http://10.0.0.1:7000/") == "ws://10.0.0.1:7000/v1/channel"
    assert ws_url("https://node.example") == "wss://node.example/v1/channel"
    with pytest.raises(ValueError, match="http"):
        ws_url("ftp://x")


TAIL_ENTRY = {"node": "tail", "layers": "10:30", "compute_ms": 1.0, "held": 3, "input_digest": "ab" * 16}


class ScriptedHop:
    """A node whose step handler is a script: session "ok-*" answers a token, "broken" fails naming
    the hop ``blame``, "bad" is the node's own 400, "slow" answers after ``release`` is set."""

    def __init__(self) -> None:
        self.blame = "http://deeper"  # the hop a "broken" session names
        self.peers: dict[str, channel.Peer] = {}
        self.release = threading.Event()
        self.steps: list[tuple[str, HopRequest, Direct]] = []
        self.log: list[tuple[str, str, int]] = []  # ("in" | "out", session, seq) of the "order*" sessions

    async def on_step(self, request: HopRequest, direct: Direct) -> tuple[dict[str, Any], int | None] | None:
        sid = request.session
        self.steps.append((sid, request, direct))
        if sid == "broken":
            raise SessionBroken("session broken on this node", failed_hop=self.blame)
        if sid == "bad":
            raise InvalidRequest("header X-Meshnet-Position must be the step's absolute position")
        if sid == "slow":
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        if sid.startswith("order"):
            self.log.append(("in", sid, direct.seq))
            await asyncio.sleep(0.05)
            self.log.append(("out", sid, direct.seq))
        return {"token": 7, "logprob": -0.5, "position": 3, "hops": [TAIL_ENTRY]}, None

    def app(self) -> Starlette:
        async def endpoint(websocket: WebSocket) -> None:
            await channel.serve(websocket, node_id="tail", peers=self.peers, max_body_bytes=1024, on_step=self.on_step)

        return Starlette(routes=[WebSocketRoute(CHANNEL_PATH, endpoint)])


@pytest.fixture
def hop() -> Iterator[tuple[ScriptedHop, str]]:
    scripted = ScriptedHop()
    with serve_in_thread(scripted.app(), ws="websockets-sansio", ws_per_message_deflate=False) as url:
        yield scripted, url
    scripted.release.set()


async def _computed(_url: str, _seq: int) -> bool | None:
    return True


def _request(session: str, *, drafts: tuple[int, ...] = ()) -> HopRequest:
    """A decode step (a verify chunk with ``drafts``) of ``session`` at position 2: token ids for a head."""
    verb = Verb.VERIFY if drafts else Verb.DECODE
    return HopRequest(verb, SessionId(session), 2, 1 + len(drafts), ids_payload([1, *drafts]), drafts=drafts)


async def _step(channels: Channels, url: str, session: str, **kw: Any) -> HopAnswer:
    args: dict[str, Any] = {"timeout_s": 10.0, "probe": _computed, **kw}
    urls = args.pop("urls", [url])
    request = _request(session, drafts=args.pop("drafts", ()))
    return await (await channels.start(urls, request, **args))


def test_a_step_comes_back_as_the_tails_answer_with_every_hops_entry(hop: tuple[ScriptedHop, str]) -> None:
    scripted, url = hop

    async def scenario() -> None:
        channels = Channels()
        try:
            answer = await _step(channels, url, "ok-1", drafts=(4,))
            assert answer == TokenAnswer((HopEntry.from_json(TAIL_ENTRY),), position=3, token=7, logprob=-0.5)
            sid, request, direct = scripted.steps[-1]
            assert (sid, request) == ("ok-1", _request("ok-1", drafts=(4,)))
            assert direct.returns == tuple(scripted.peers)  # the gateway's own channel is the return address
            assert (await _step(channels, url, "ok-2")).token == 7  # the same kept-open channel serves the next one
            assert len(scripted.peers) == 1
        finally:
            await channels.aclose()

    asyncio.run(scenario())


def test_a_sessions_steps_run_one_at_a_time_in_the_order_they_came_and_others_do_not_wait(
    hop: tuple[ScriptedHop, str],
) -> None:
    """Pipelined speculation keeps several rounds of a session in flight: a hop takes them in order,
    each after the one before it has ended (never a 409 for the second), other sessions beside them."""
    scripted, url = hop

    async def scenario() -> None:
        channels = Channels()
        args: dict[str, Any] = {"timeout_s": 10.0, "probe": _computed}
        try:
            tasks = [await channels.start([url], _request("order-a"), **args) for _ in range(3)]
            other = await channels.start([url], _request("order-b"), **args)
            answers = await asyncio.gather(*tasks, other)
            assert all(a.token == 7 for a in answers)
        finally:
            await channels.aclose()
        mine = [(what, seq) for what, sid, seq in scripted.log if sid == "order-a"]
        seqs = [seq for what, seq in mine if what == "in"]
        assert seqs == sorted(seqs) and len(seqs) == 3
        assert mine == [(what, seq) for seq in seqs for what in ("in", "out")]  # never two at once
        other_in = next(i for i, entry in enumerate(scripted.log) if entry[:2] == ("in", "order-b"))
        last_in = max(i for i, entry in enumerate(scripted.log) if entry[:2] == ("in", "order-a"))
        assert other_in < last_in  # the other session ran beside them, not after them

    asyncio.run(scenario())


def test_errors_map_as_over_http(hop: tuple[ScriptedHop, str]) -> None:
    scripted, url = hop

    async def scenario() -> None:
        channels = Channels()
        try:
            scripted.blame = url
            with pytest.raises(HopFailed) as failed:
                await _step(channels, url, "broken")
            assert failed.value.failed_hop == url and "session broken" in failed.value.message
            scripted.blame = "http://deeper"  # a node off the route: blaming it is the sender's own failure
            with pytest.raises(HopFailed, match="not a hop at or after it") as blamed:
                await _step(channels, url, "broken")
            assert blamed.value.failed_hop == url
            with pytest.raises(BadGateway, match="absolute position") as own:  # the head's own error names no hop
                await _step(channels, url, "bad")
            assert not isinstance(own.value, HopFailed)
        finally:
            await channels.aclose()

    asyncio.run(scenario())


def test_only_the_tails_channel_answers_a_step() -> None:
    head, tail = ScriptedHop(), ScriptedHop()
    serve = {"ws": "websockets-sansio", "ws_per_message_deflate": False}

    async def scenario(head_url: str, tail_url: str) -> None:
        channels = Channels()
        try:
            # The head answers the step itself, skipping the tail: a forged answer, the head's failure.
            with pytest.raises(HopFailed, match="only the tail") as forged:
                await _step(channels, head_url, "ok-1", urls=[head_url, tail_url])
            assert forged.value.failed_hop == head_url
            head.blame = tail_url  # a hop may name one after it (the next hop it could not reach)
            with pytest.raises(HopFailed) as failed:
                await _step(channels, head_url, "broken", urls=[head_url, tail_url])
            assert failed.value.failed_hop == tail_url
        finally:
            await channels.aclose()

    with serve_in_thread(head.app(), **serve) as head_url, serve_in_thread(tail.app(), **serve) as tail_url:
        asyncio.run(scenario(head_url, tail_url))


@pytest.mark.parametrize(
    ("sender", "named", "blamed"),
    [(1, 0, 1), (1, None, 1), (1, 2, 2), (0, 2, 2), (2, 1, 2), (0, "http://elsewhere", 0)],
)
def test_an_error_frame_blames_the_sender_or_a_hop_after_it(sender: int, named: int | str | None, blamed: int) -> None:
    route = ["https://a", "https://b", "https://c"]
    name = route[named] if isinstance(named, int) else named
    frame = decode_frame(encode_frame(Kind.ERROR, {"status": 502, "error": {"message": "x", "failed_hop": name}}))
    with pytest.raises(HopFailed) as failed:
        _answer(_Report(route[sender], frame), route)
    assert failed.value.failed_hop == route[blamed]


def test_a_malformed_frame_gets_an_error_and_the_channel_serves_the_next_step(hop: tuple[ScriptedHop, str]) -> None:
    scripted, url = hop
    with connect(ws_url(url), compression=None) as ws:
        hello = decode_frame(bytes(ws.recv(timeout=5, decode=False)))
        assert hello.kind is Kind.HELLO and hello.header["node"] == "tail"
        ws.send(b"garbage!")
        error = decode_frame(bytes(ws.recv(timeout=5, decode=False)))
        assert error.kind is Kind.ERROR and error.header["status"] == 400 and error.header["session"] is None
        assert "not a Meshnet channel frame" in error.header["error"]["message"]
        ws.send("text")
        assert "binary" in decode_frame(bytes(ws.recv(timeout=5, decode=False))).header["error"]["message"]
        ws.send(_step_bytes(session=b"\x04ok-3", seq=(1).to_bytes(8, "little"), flags=b"\x40"))
        error = decode_frame(bytes(ws.recv(timeout=5, decode=False)))
        assert (error.header["session"], error.header["seq"]) == ("ok-3", 1) and "flags" in error.header["error"][
            "message"
        ]
        returns = {"returns": b"\x01\x06nobody"}  # an unknown return id: reports come back on this channel
        ws.send(_step_bytes(session=b"\x04ok-3", body=b"\x00" * 2048, **returns))
        assert decode_frame(bytes(ws.recv(timeout=5, decode=False))).header["status"] == 413
        ws.send(_step_bytes(session=b"\x04ok-3", seq=(2).to_bytes(8, "little"), **returns))
        token = decode_frame(bytes(ws.recv(timeout=5, decode=False)))
        assert token.kind is Kind.TOKEN and token.header["answer"]["token"] == 7
    assert [s[0] for s in scripted.steps] == ["ok-3"]


def test_a_closed_channel_names_its_node_and_silence_is_located_by_probing(hop: tuple[ScriptedHop, str]) -> None:
    scripted, url = hop

    async def scenario() -> None:
        channels = Channels()
        try:
            asked: list[tuple[str, int]] = []

            async def probe(at: str, seq: int) -> bool | None:
                asked.append((at, seq))
                return False

            with pytest.raises(HopFailed, match="did not pass step") as silent:
                await _step(channels, url, "slow", timeout_s=0.5, probe=probe)
            assert silent.value.failed_hop == url and asked and asked[0][0] == url
            scripted.release.set()
            # the node goes away mid-step: the waiting step fails at once, naming it
            scripted.release.clear()
            waiting = asyncio.create_task(_step(channels, url, "slow", timeout_s=30.0))
            for _ in range(50):
                if any(s[0] == "slow" for s in scripted.steps[1:]):
                    break
                await asyncio.sleep(0.05)
            for open_channel in list(channels._open.values()):
                await open_channel.connection.close()  # what a killed node looks like from the gateway
            with pytest.raises(HopFailed) as lost:
                await asyncio.wait_for(waiting, 10)
            assert lost.value.failed_hop == url
        finally:
            scripted.release.set()
            await channels.aclose()

    asyncio.run(scenario())


class _FakeChannel:
    """An open channel that only records what is sent on it: the step's waiting, not the network."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.return_id = f"ret-{url}"
        self.closed = False
        self.sent: list[bytes] = []

    async def send(self, data: bytes) -> None:
        self.sent.append(data)


HEAD_ENTRY = {"node": "head", "layers": "0:10", "compute_ms": 2.0, "held": 3, "input_digest": "cd" * 16,
              "output_digest": "ef" * 16, "sig": "c2ln"}  # fmt: skip


def _entry_report(url: str, session: str, seq: int, entry: Any = None) -> _Report:
    """An ``ENTRY`` frame from the node at ``url`` (the head's entry unless given)."""
    raw = encode_frame(Kind.ENTRY, {"session": session, "seq": seq, "entry": HEAD_ENTRY if entry is None else entry})
    return _Report(url, decode_frame(raw))


def test_the_tails_answer_waits_for_the_other_hops_entries_and_takes_them_first_in_route_order() -> None:
    """The hops before the tail send their entries (ENTRY) on their own channels: the tail's token
    may come first and waits for them; a hop's first entry counts; the answer lists them in route
    order before the tail's. An ENTRY from the tail, or one without an entry, is that hop's failure."""
    route = ["http://a", "http://b", "http://c"]
    middle = {**HEAD_ENTRY, "node": "middle", "layers": "10:20"}
    tail = {"token": 5, "logprob": -0.1, "position": 4, "hops": [TAIL_ENTRY]}

    async def scenario() -> None:
        channels = Channels()
        for url in route:
            channels._open[url] = _FakeChannel(url)  # type: ignore[assignment]

        async def step() -> tuple[asyncio.Future[HopAnswer], int]:
            task = await channels.start(route, _request("s"), timeout_s=10.0,
                                        probe=_computed)  # fmt: skip
            ((_, seq),) = channels._waiters
            return task, seq

        task, seq = await step()
        channels.deliver(_entry_report(route[1], "s", seq, middle))
        channels.deliver(_Report(route[2], decode_frame(token_frame("s", seq, tail))))
        channels.deliver(_entry_report(route[1], "s", seq, {**middle, "held": 9}))  # a second one: ignored
        await asyncio.sleep(0.05)
        assert not task.done()
        channels.deliver(_entry_report(route[0], "s", seq))
        answer = await asyncio.wait_for(task, 5)
        assert [e.to_json() for e in answer.hops] == [HEAD_ENTRY, middle, TAIL_ENTRY] and not channels._waiters

        for sender, entry, needle in ((route[2], None, "a tail's entry comes with its TOKEN"),
                                      (route[1], {"node": 3}, "ENTRY without an entry")):  # fmt: skip
            task, seq = await step()
            channels.deliver(_entry_report(sender, "s", seq, entry))
            with pytest.raises(HopFailed, match=needle) as failed:
                await asyncio.wait_for(task, 5)
            assert failed.value.failed_hop == sender and not channels._waiters

    asyncio.run(scenario())


def test_a_hop_that_withholds_its_entry_is_named_when_it_closes_or_at_the_deadline() -> None:
    """Once the tail has answered, the step waits only for the entries still missing: a hop whose
    channel closes without having sent its entry is named at once (one that sent it, or the tail,
    is no concern of this step), and at the deadline the first hop whose entry is missing is named."""
    route = ["http://a", "http://b", "http://c"]
    tail = {"token": 5, "logprob": -0.1, "position": 4, "hops": [TAIL_ENTRY]}

    async def scenario() -> None:
        channels = Channels()

        async def step(timeout_s: float) -> tuple[asyncio.Future[HopAnswer], int]:
            for url in route:
                channels._open[url] = _FakeChannel(url)  # type: ignore[assignment]
            task = await channels.start(route, _request("s"), timeout_s=timeout_s,
                                        probe=_computed)  # fmt: skip
            ((_, seq),) = channels._waiters
            channels.deliver(_Report(route[2], decode_frame(token_frame("s", seq, tail))))
            return task, seq

        task, seq = await step(10.0)
        channels.deliver(_entry_report(route[0], "s", seq))
        channels.lost(channels._open[route[0]], "gone")  # its entry is in: this step does not mind
        channels.lost(channels._open[route[2]], "gone")  # the tail has answered: nor does it mind the tail's
        await asyncio.sleep(0.05)
        assert not task.done()
        channels.lost(channels._open[route[1]], "gone")
        with pytest.raises(HopFailed, match="closed \\(gone\\) before it sent its entry") as closed:
            await asyncio.wait_for(task, 5)
        assert closed.value.failed_hop == route[1]

        task, seq = await step(0.2)
        channels.deliver(_entry_report(route[0], "s", seq))
        with pytest.raises(HopFailed, match=r"passed step \d+ on but sent no entry") as silent:
            await asyncio.wait_for(task, 5)
        assert silent.value.failed_hop == route[1] and not channels._waiters

    asyncio.run(scenario())


def test_a_lost_hop_waits_for_its_upstreams_report_and_strangers_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    """A hop whose channel closes is named at once only if the hop before it has computed the step;
    else that hop's own report is awaited (it names the lost one). A report from a node off the
    route is ignored."""
    route = ["http://a", "http://b"]

    async def scenario() -> None:
        channels = Channels()
        computed: dict[str, bool | None] = {}

        async def probe(url: str, _seq: int) -> bool | None:
            return computed.get(url)

        async def step() -> tuple[asyncio.Task[HopAnswer], int]:
            for url in route:
                channels._open[url] = _FakeChannel(url)  # type: ignore[assignment]
            task = await channels.start(route, _request("s"), timeout_s=10.0,
                                        probe=probe)  # fmt: skip
            ((_, seq),) = channels._waiters
            return task, seq

        computed["http://a"] = False
        task, seq = await step()
        channels.lost(channels._open["http://b"], "gone")
        stranger = encode_frame(Kind.TOKEN, {"session": "s", "seq": seq, "answer": {}})
        channels.deliver(_Report("http://elsewhere", decode_frame(stranger)))
        await asyncio.sleep(0.05)
        assert not task.done() and "not on; ignored" in caplog.text
        error = {"session": "s", "seq": seq, "status": 502, "error": {"message": "next hop", "failed_hop": route[1]}}
        channels.deliver(_Report(route[0], decode_frame(encode_frame(Kind.ERROR, error))))
        with pytest.raises(HopFailed, match="next hop") as reported:
            await task
        assert reported.value.failed_hop == route[1]

        computed["http://a"] = True  # the head has computed it: the lost tail is named at once
        task, seq = await step()
        channels.lost(channels._open["http://b"], "gone")
        with pytest.raises(HopFailed, match="decode channel closed") as named:
            await asyncio.wait_for(task, 5)
        assert named.value.failed_hop == route[1]
        assert not channels._waiters

    asyncio.run(scenario())


def test_a_peer_that_does_tls_but_never_answers_the_upgrade_costs_the_open_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole open (TCP, TLS, upgrade, HELLO) is bounded: cancelling it wakes the TLS read that
    a peer which completes TLS and then says nothing leaves it in, every time."""
    monkeypatch.setattr(channel_client, "_OPEN_TIMEOUT_S", 0.5)
    ca = SwarmCA.init(tmp_path / "swarm", name="lab")
    creds = {}
    for member, role in (("node-1", "node"), ("gw-1", "gateway")):
        key = new_member_key()
        cert = ca.issue(MemberRequest(make_csr(key, member), role=role, sans=("127.0.0.1",)))
        creds[member] = save_member(tmp_path / member, cert, key, ca_pem=ca.cert_pem)
    server_tls = creds["node-1"].server_context()
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[ssl.SSLSocket] = []

    def accept() -> None:  # complete TLS, then say nothing
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with contextlib.suppress(OSError, ssl.SSLError):
                    held.append(server_tls.wrap_socket(conn, server_side=True))

    threading.Thread(target=accept, daemon=True).start()
    url = f"https://127.0.0.1:{listener.getsockname()[1]}"

    async def scenario() -> None:
        for _ in range(3):  # a Channels each: one remembers a refusal for _RETRY_S
            channels = Channels(creds["gw-1"].client_context())
            began = time.monotonic()
            try:
                with pytest.raises(ChannelUnavailable, match="refused its decode channel") as refused:
                    await _step(channels, url, "ok-1")
            finally:
                await channels.aclose()
            assert time.monotonic() - began < channel_client._OPEN_TIMEOUT_S + 1
            assert url in str(refused.value) and "TimeoutError" in str(refused.value)

    try:
        asyncio.run(scenario())
        assert len(held) == 3
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_a_node_without_a_channel_is_unavailable_and_redialed_after_a_wait_that_doubles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node that refuses its channel gets HTTP steps (``ChannelUnavailable``) without a dial at
    every step: it is dialed again after a wait (2 s; 0.2 here), twice as long after each refusal in
    a row, up to ``_RETRY_S`` (30 s; 0.5 here). So a channel that failed to open once on a loaded
    machine is back within seconds, and one that never opens costs a dial every 30 s."""
    monkeypatch.setattr(channel_client, "_RETRY_FIRST_S", 0.2)
    monkeypatch.setattr(channel_client, "_RETRY_S", 0.5)
    dials: list[float] = []

    async def endpoint(websocket: WebSocket) -> None:  # counts the dials, refuses each
        dials.append(time.monotonic())
        await websocket.close(code=1008)

    async def scenario(url: str) -> tuple[int, set[str]]:
        channels = Channels()
        steps, waits = 0, set()
        try:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:  # a step every ~20 ms, each refused
                with pytest.raises(ChannelUnavailable, match="refused its decode channel") as refused:
                    await _step(channels, url, "ok-1")
                steps += 1
                if "less than" in str(refused.value):  # an HTTP step: no dial
                    waits.add(str(refused.value).split("less than ")[1])
                await asyncio.sleep(0.02)
        finally:
            await channels.aclose()
        return steps, waits

    app = Starlette(routes=[WebSocketRoute(CHANNEL_PATH, endpoint)])
    with serve_in_thread(app) as url:
        steps, waits = asyncio.run(scenario(url))
    assert waits == {"0.2 s ago", "0.4 s ago", "0.5 s ago"}, waits
    gaps = [b - a for a, b in itertools.pairwise(dials)]
    assert 4 <= len(dials) <= 6 < steps, (len(dials), steps)  # dialed after each wait, not at every step
    assert all(gap >= wait for gap, wait in zip(gaps, (0.2, 0.4, 0.5, 0.5), strict=False)), gaps


def test_a_credit_frame_reads_back_and_a_bad_one_says_what_is_wrong() -> None:
    credit = Credit("ses-1", 7, 8, "https://head:7000", ("r1", "r2"), "m", "rte-1", frozenset({2, 0}))
    assert read_credit(decode_frame(credit_frame(credit))) == credit
    good = decode_frame(credit_frame(credit)).header
    for field, value, needle in [
        ("session", "", '"session"'),
        ("after", -1, '"after" and "seq"'),
        ("seq", True, '"after" and "seq"'),
        ("head", "ftp://x", '"head"'),
        ("returns", [], '"returns"'),
        ("route_id", 3, '"model" and "route_id"'),
        ("stop", ["eos"], '"stop"'),
    ]:
        with pytest.raises(InvalidRequest, match=needle):
            read_credit(decode_frame(encode_frame(Kind.CREDIT, {**good, field: value})))
    token = decode_frame(token_frame("ses-1", 7, {"token": 1}, relayed=8))
    assert relayed_of(token) == 8 and relayed_of(decode_frame(token_frame("ses-1", 7, {"token": 1}))) is None


def test_a_relayed_step_is_out_once_the_tails_token_says_so_and_a_credit_goes_to_the_tail() -> None:
    """A reserved step waits unsent, without a deadline; the token of the step before it, from the
    tail, saying it relayed that one, starts its deadline; a credit names every hop's return id."""
    route = ["http://a", "http://b"]

    async def scenario() -> None:
        channels = Channels()

        async def probe(url: str, _seq: int) -> bool | None:
            return None

        fakes = {url: _FakeChannel(url) for url in route}
        channels._open.update(fakes)  # type: ignore[arg-type]
        slot = await channels.reserve(route, "s", timeout_s=10.0, probe=probe)
        assert not slot.launched and slot.timer is None
        assert await channels.credit(slot, after=3, model="m", route_id="rte", stop=[0])
        (sent,) = fakes["http://b"].sent
        assert read_credit(decode_frame(sent)) == Credit("s", 3, slot.seq, "http://a", ("ret-http://a",
                                                         "ret-http://b"), "m", "rte", frozenset({0}))  # fmt: skip
        first = await channels.start(route, _request("s"), timeout_s=10.0, probe=probe)
        seq = next(s for (_, s) in channels._waiters if s != slot.seq)
        answer = {"token": 5, "logprob": -0.1, "position": 4, "hops": [TAIL_ENTRY]}
        assert not slot.launched
        channels.deliver(_entry_report("http://a", "s", seq))
        channels.deliver(_Report("http://b", decode_frame(token_frame("s", seq, answer, relayed=slot.seq))))
        assert isinstance(await first, TokenAnswer) and slot.launched and slot.timer is not None
        channels.deliver(_entry_report("http://a", "s", slot.seq))
        channels.deliver(_Report("http://b", decode_frame(token_frame("s", slot.seq, answer))))
        assert isinstance(await slot.answer, TokenAnswer)
        assert not channels._waiters
        unused = await channels.reserve(route, "s", timeout_s=10.0, probe=probe)
        unused.answer.cancel()  # a leave withdrawn: nothing waits for it any more
        await asyncio.sleep(0)
        assert not channels._waiters

    asyncio.run(scenario())


def test_a_dialer_sends_at_once_and_a_next_hop_that_stops_reading_is_a_hop_failure_in_time() -> None:
    """A hop's kept-open channel to its next hop: small frames go out at once, without a deadline of
    their own (nothing can wait); once a next hop stops reading and the socket's buffers fill, a
    send waits only until the hop timeout and fails naming that hop."""
    from websockets.asyncio.server import serve as ws_serve

    hello = encode_frame(Kind.HELLO, {"channel": "c1", "node": "next", "version": 3})

    async def scenario() -> None:
        got: list[bytes] = []
        stop_reading = asyncio.Event()

        async def next_hop(websocket: Any) -> None:
            await websocket.send(hello)
            async for message in websocket:
                got.append(message)
                if stop_reading.is_set():
                    await websocket.wait_closed()  # never reads again: its buffers, then ours, fill up
                    return

        async with ws_serve(next_hop, "127.0.0.1", 0, max_size=None, max_queue=1, compression=None,
                            close_timeout=1) as server:  # fmt: skip
            port = server.sockets[0].getsockname()[1]
            url = f"http://127.0.0.1:{port}"
            dialer = channel.Dialer(1 << 20)
            try:
                for i in range(3):
                    await dialer.send(url, b"step %d" % i, timeout_s=5.0)
                for _ in range(100):
                    if len(got) == 3:
                        break
                    await asyncio.sleep(0.02)
                assert got == [b"step 0", b"step 1", b"step 2"]
                stop_reading.set()
                await dialer.send(url, b"the last it reads", timeout_s=5.0)
                began = time.monotonic()
                with pytest.raises(HopFailed, match="TimeoutError") as failed:
                    for _ in range(1000):  # 1 MiB each: far more than every buffer on the way holds
                        await dialer.send(url, bytes(1 << 20), timeout_s=0.5)
                assert failed.value.failed_hop == url and time.monotonic() - began < 10
            finally:
                await dialer.close()

    asyncio.run(asyncio.wait_for(scenario(), 20))  # a send that never ends fails the test, not the run
