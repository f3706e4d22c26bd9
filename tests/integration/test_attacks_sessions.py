"""The session attacks of issue #28 (item 1, and the stale tickets of items 5 and 6), replayed
against a running private swarm (tracker ``--swarm``, a head and two tails, a gateway ``gw``) by
members with real credentials: a node credential ``spy`` that serves nothing and a second gateway
``gw2``. Every request on a session must come from its driver: the gateway that opened it, and on
each hop the hop before it on the ticket's route (docs/security.md, "Route tickets"). Meanwhile an
honest streamed chat through the gateway keeps its greedy text."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest

from meshnet.ids import SessionId
from meshnet.protocol.channel import Kind, decode_frame, step_frame
from meshnet.protocol.http_binding import encode_request, encode_reroute
from meshnet.protocol.messages import HopRequest, Payload, RerouteRequest, Verb
from meshnet.protocol.wire import encode_tensor
from meshnet.security.tls import Credentials
from tests.private_swarm import PrivateSwarm, node_urls, private_swarm, wait_nodes
from tests.procs import member_client
from tests.ws import open_channel

pytestmark = pytest.mark.real

NODES = (("head", "0:15"), ("tail", "15:30"), ("spare", "15:30"))
NODE_ARGS = ["--threads", "1", "--ctx", "256", "--max-sessions", "8", "--max-body-mb", "8"]
CHAT = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 8, "temperature": 0}
SECRET = [1, 15, 27, 99, 310, 42]  # the victim's prompt: "what is my locker code", as token ids


@dataclass
class Scene:
    swarm: PrivateSwarm
    model: str
    text: str  # the streamed chat's greedy text before any attack
    victim: dict[str, Any]  # a live session gw opened (tracker answer) and prefilled with SECRET
    token: int  # the token its tail answered after SECRET
    control: int  # the token after that one, from an identical session: what the victim must answer next

    @property
    def head(self) -> str:
        return str(self.victim["hops"][0]["url"])


def _ids(tokens: list[int]) -> Payload:
    return Payload(encode_tensor(np.array([tokens], dtype=np.int32), "int32"))


def _session_request(session: dict[str, Any], verb: Verb, start: int, tokens: list[int], **kw: Any) -> HopRequest:
    first = start == 0
    return HopRequest(verb, SessionId(session["session_id"]), start, len(tokens), _ids(tokens),
                      route_id=session["route_id"], sample=verb is Verb.PREFILL,
                      next_hops=tuple(h["url"] for h in session["hops"][1:]) if first else None,
                      ticket=kw.pop("ticket", session.get("ticket") if first else None), **kw)  # fmt: skip


def _post(client: httpx.Client, url: str, request: HopRequest) -> httpx.Response:
    path, headers, body = encode_request(request)
    return client.post(f"{url}{path}", content=body, headers=headers)


def _refused(answer: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


def _open(gw: httpx.Client, swarm: PrivateSwarm, model: str) -> dict[str, Any]:
    opened = gw.post(f"{swarm.tracker.url}/v1/sessions", json={"model": model, "total_layers": 30})
    assert opened.status_code == 201, opened.text
    return dict(opened.json())


def _generate(gw: httpx.Client, session: dict[str, Any], steps: int) -> list[int]:
    """Prefill SECRET on the session's head and decode ``steps`` greedy tokens; every token."""
    head = session["hops"][0]["url"]
    answer = _post(gw, head, _session_request(session, Verb.PREFILL, 0, SECRET))
    assert answer.status_code == 200, answer.text
    tokens = [int(answer.json()["token"])]
    for i in range(steps):
        answer = _post(gw, head, _session_request(session, Verb.DECODE, len(SECRET) + i, tokens[-1:]))
        assert answer.status_code == 200, answer.text
        tokens.append(int(answer.json()["token"]))
    return tokens


def _free(gw: httpx.Client, url: str, session: dict[str, Any], ticket: str) -> None:
    """End the session on the node at ``url`` (and down the chain from it), as the gateway does."""
    freed = gw.delete(f"{url}/v1/sessions/{session['session_id']}", headers={"X-Meshnet-Ticket": ticket})
    assert freed.status_code == 200, freed.text


def _close(gw: httpx.Client, swarm: PrivateSwarm, session: dict[str, Any], url: str, ticket: str) -> None:
    _free(gw, url, session, ticket)
    gw.delete(f"{swarm.tracker.url}/v1/sessions/{session['session_id']}")


def _stream_chat(gateway: str, model: str) -> str:
    text = []
    body = {**CHAT, "model": model, "stream": True}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=180) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    with private_swarm(tmp_path_factory.mktemp("session-attacks"), NODES, node_args=NODE_ARGS) as swarm:
        assert swarm.gateway is not None
        swarm.join("gateway", "gw2")
        swarm.join("node", "spy")
        model = httpx.get(f"{swarm.gateway.url}/v1/models", timeout=10).json()["data"][0]["id"]
        text = _stream_chat(swarm.gateway.url, model)
        with member_client(swarm.member("gw")) as gw:
            control = _open(gw, swarm, model)
            expected = _generate(gw, control, 1)
            _close(gw, swarm, control, control["hops"][0]["url"], control["ticket"])
            victim = _open(gw, swarm, model)
            token = _generate(gw, victim, 0)[0]
        assert token == expected[0]
        yield Scene(swarm, model, text, victim, token, expected[1])


def test_a_member_sees_only_its_own_sessions_on_the_tracker(scene: Scene) -> None:
    """Why: "GET /v1/sessions on the tracker answers any member": an untrusted node that serves
    nothing listed the open sessions (their ids, routes and nodes)."""
    tracker, sid = scene.swarm.tracker.url, scene.victim["session_id"]
    for member in ("spy", "gw2"):
        with member_client(scene.swarm.member(member)) as other:
            listed = other.get(f"{tracker}/v1/sessions")
            assert listed.status_code == 200, listed.text
            assert sid not in {s["session_id"] for s in listed.json()["sessions"]}
            _refused(other.get(f"{tracker}/v1/sessions/{sid}"), 404)
    for member in (scene.swarm.member("gw"), scene.swarm.admin):  # its owner, and an admin
        with member_client(member) as allowed:
            assert sid in {s["session_id"] for s in allowed.get(f"{tracker}/v1/sessions").json()["sessions"]}
            assert allowed.get(f"{tracker}/v1/sessions/{sid}").json()["route_id"] == scene.victim["route_id"]


def test_no_other_member_appends_a_step_to_a_live_session_or_rewinds_it(scene: Scene) -> None:
    """Why: an untrusted node "appended 'What is my locker code?' to a victim's live session on its
    head and read the secret back from the victim's KV, then rewound every hop". Over HTTP and the
    decode channel, on the head and on the tail, with and without X-Meshnet-Rewind: 403, and the
    victim's session goes on with the token an untouched one gives, while a streamed chat runs."""
    chats: list[str] = []
    chat = threading.Thread(target=lambda: chats.append(_stream_chat(scene.swarm.gateway.url, scene.model)))  # type: ignore[union-attr]
    chat.start()
    victim, position = scene.victim, len(SECRET)
    tail = victim["hops"][1]["url"]
    with member_client(scene.swarm.member("gw")) as gw:
        seam = gw.get(f"{scene.head}/v1/health").json()["seam"]
    hidden = Payload(encode_tensor(np.zeros((1, 1, *seam), dtype=np.float32), "float32"))
    for member in ("spy", "gw2"):
        with member_client(scene.swarm.member(member)) as other:
            appended = _session_request(victim, Verb.DECODE, position, [99])
            _refused(_post(other, scene.head, appended), 403, "session_not_yours")
            rewound = _session_request(victim, Verb.DECODE, 1, [99], rewind=True)
            _refused(_post(other, scene.head, rewound), 403, "session_not_yours")
            on_tail = HopRequest(Verb.DECODE, SessionId(victim["session_id"]), position, 1, hidden,
                                 route_id=victim["route_id"], rewind=True)  # fmt: skip
            _refused(_post(other, tail, on_tail), 403, "session_not_yours")
    credentials = Credentials.at(scene.swarm.member("spy"))
    with open_channel(scene.head, ssl=credentials.client_context(), open_timeout_s=30, compression=None,
                      close_timeout=5) as channel:  # fmt: skip
        hello = decode_frame(bytes(channel.recv(timeout=10, decode=False)))
        rewinding = _session_request(victim, Verb.DECODE, position, [99], rewind=True)
        channel.send(step_frame(rewinding, 0, [hello.header["channel"]]))
        answer = decode_frame(bytes(channel.recv(timeout=30, decode=False)))
        assert answer.kind is Kind.ERROR and answer.header["status"] == 403, answer.header
    with member_client(scene.swarm.member("gw")) as gw:
        for url in (scene.head, tail):  # nothing was appended nor rewound on any hop
            assert gw.get(f"{url}/v1/sessions/{victim['session_id']}").json()["position"] == position
        step = _post(gw, scene.head, _session_request(victim, Verb.DECODE, position, [scene.token]))
        assert step.status_code == 200, step.text
        assert step.json()["token"] == scene.control
    chat.join(timeout=180)
    assert chats == [scene.text]


def test_no_other_member_reads_or_closes_a_live_session_on_a_node(scene: Scene) -> None:
    """Why: "GET /v1/sessions/{id} on a node answers any member"; a DELETE must not end it either."""
    sid = scene.victim["session_id"]
    for member in ("spy", "gw2"):
        with member_client(scene.swarm.member(member)) as other:
            for url in (hop["url"] for hop in scene.victim["hops"]):
                _refused(other.get(f"{url}/v1/sessions/{sid}"), 403, "session_not_yours")
                ticket = {"X-Meshnet-Ticket": scene.victim["ticket"]}  # even one that learned the ticket
                _refused(other.delete(f"{url}/v1/sessions/{sid}", headers=ticket), 403, "session_not_yours")
    with member_client(scene.swarm.member("gw")) as gw:
        state = gw.get(f"{scene.head}/v1/sessions/{sid}")
        assert state.status_code == 200 and state.json()["broken"] is None, state.text


def test_a_route_ticket_replayed_after_its_session_closed_is_refused(scene: Scene) -> None:
    """Why: "a route ticket replayed after its session closed re-opens it"."""
    with member_client(scene.swarm.member("gw")) as gw:
        session = _open(gw, scene.swarm, scene.model)
        _generate(gw, session, 0)
        _close(gw, scene.swarm, session, session["hops"][0]["url"], session["ticket"])
        replayed = _post(gw, session["hops"][0]["url"], _session_request(session, Verb.PREFILL, 0, SECRET))
        _refused(replayed, 401, "route_ticket_closed")
        tail = session["hops"][1]["url"]
        assert gw.get(f"{tail}/v1/sessions/{session['session_id']}").status_code in (404, 410)


def _repair(gw: httpx.Client, scene: Scene, session: dict[str, Any], failed: str, position: int) -> dict[str, Any]:
    """Repair ``session`` after its tail ``failed``, once the tracker lists it again (a repair suspends
    the failed node until its next heartbeat); the tracker's answer."""
    swarm = scene.swarm
    wait_nodes(swarm.tracker.url, swarm.admin, {name for name, _ in NODES}, timeout_s=30)
    body = {"failed_node": failed, "position": position}
    answer = gw.post(f"{swarm.tracker.url}/v1/sessions/{session['session_id']}/repair", json=body)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _reroute(gw: httpx.Client, session: dict[str, Any], repaired: dict[str, Any], step: int) -> httpx.Response:
    request = RerouteRequest(SessionId(session["session_id"]), (repaired["hops"][1]["url"],), session["route_id"],
                             replay=1, step=step, ticket=repaired["ticket"])  # fmt: skip
    path, headers = encode_reroute(request)
    return gw.post(f"{session['hops'][0]['url']}{path}", headers=headers)


def test_a_superseded_repair_ticket_is_refused(scene: Scene) -> None:
    """Why: "a superseded repair ticket still reroutes the session (the head replayed its seam log to
    the node it named)". Two repairs of one session's tail, each used as the gateway uses it (reroute,
    then free the session on the hop cut out); the first repair's ticket no longer reroutes it."""
    with member_client(scene.swarm.member("gw")) as gw:
        session = _open(gw, scene.swarm, scene.model)
        tokens = _generate(gw, session, 1)
        step = len(SECRET)  # the newest position, a decode step: what a repair resends
        first_tail = session["hops"][1]
        once = _repair(gw, scene, session, first_tail["node_id"], step)
        assert once["hops"][1]["node_id"] != first_tail["node_id"]
        moved = _reroute(gw, session, once, step)
        assert moved.status_code == 200 and moved.json()["token"] == tokens[1], moved.text
        _free(gw, first_tail["url"], session, session["ticket"])  # the hop cut out of the route
        twice = _repair(gw, scene, session, once["hops"][1]["node_id"], step)
        assert twice["hops"][1]["node_id"] == first_tail["node_id"]
        moved = _reroute(gw, session, twice, step)
        assert moved.status_code == 200 and moved.json()["token"] == tokens[1], moved.text
        second_tail = once["hops"][1]["url"]
        _free(gw, second_tail, session, once["ticket"])
        _refused(_reroute(gw, session, once, step), 401, "route_ticket_superseded")
        assert gw.get(f"{second_tail}/v1/sessions/{session['session_id']}").status_code in (404, 410)
        _close(gw, scene.swarm, session, session["hops"][0]["url"], twice["ticket"])
    wait_nodes(scene.swarm.tracker.url, scene.swarm.admin, {name for name, _ in NODES}, timeout_s=30)


def test_the_honest_chat_is_unchanged_after_every_attack(scene: Scene) -> None:
    deadline = time.monotonic() + 30
    while len(node_urls(scene.swarm.tracker.url, scene.swarm.admin)) < len(NODES) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _stream_chat(scene.swarm.gateway.url, scene.model) == scene.text  # type: ignore[union-attr]
