"""The attack suite of issue #13: every item of its "Why" list, replayed against a running private
swarm (tracker ``--swarm``, two nodes, a gateway, joined by invites) by members that are not on
the route (a second gateway ``gw2``, a node credential ``spy`` that serves nothing) and by
outsiders. Each is refused with its status and error code; the last test checks that the route
still answers with identical greedy text and that no record changed (the tracker's node list,
the victim session's pinned route and position, its billing records)."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest

from meshnet.ids import SessionId
from meshnet.protocol.http_binding import encode_request, encode_reroute
from meshnet.protocol.messages import HopRequest, Payload, RerouteRequest, Verb
from meshnet.protocol.signing import HopKey
from meshnet.protocol.wire import encode_tensor
from tests.private_swarm import PrivateSwarm, node_urls, private_swarm
from tests.procs import member_client

pytestmark = pytest.mark.real

CHAT = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 10, "temperature": 0}


@dataclass
class Scene:
    swarm: PrivateSwarm
    model: str
    text: str  # the fixed chat completion's greedy text before any attack
    nodes: dict[str, str]  # the tracker's node list before
    victim: dict[str, Any]  # a live session the gateway credential opened and prefilled
    position: int  # what its head holds

    @property
    def head(self) -> str:
        return self.nodes["head"]


def _chat(gateway: str, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/chat/completions", json={**CHAT, "model": model, **extra}, timeout=180)


def _prefill(client: httpx.Client, url: str, session: dict[str, Any], ids: list[int], **kw: Any) -> httpx.Response:
    payload = Payload(encode_tensor(np.array([ids], dtype=np.int32), "int32"))
    request = HopRequest(Verb.PREFILL, SessionId(session["session_id"]), 0, len(ids), payload,
                         route_id=session["route_id"], next_hops=tuple(h["url"] for h in session["hops"][1:]),
                         sample=True, ticket=session.get("ticket"), **kw)  # fmt: skip
    path, headers, body = encode_request(request)
    return client.post(f"{url}{path}", content=body, headers=headers)


def _refused(answer: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    with private_swarm(tmp_path_factory.mktemp("attacks")) as swarm:
        assert swarm.gateway is not None
        swarm.join("gateway", "gw2")
        swarm.join("node", "spy")
        model = httpx.get(f"{swarm.gateway.url}/v1/models", timeout=10).json()["data"][0]["id"]
        first = _chat(swarm.gateway.url, model)
        assert first.status_code == 200, first.text
        with member_client(swarm.member("gw")) as gw:
            opened = gw.post(f"{swarm.tracker.url}/v1/sessions", json={"model": model, "total_layers": 30})
            assert opened.status_code == 201, opened.text
            victim = opened.json()
            answer = _prefill(gw, victim["hops"][0]["url"], victim, [1, 2, 3])
            assert answer.status_code == 200, answer.text
        yield Scene(swarm, model, first.json()["choices"][0]["message"]["content"],
                    node_urls(swarm.tracker.url, swarm.admin), victim, 3)  # fmt: skip


def _registration(scene: Scene, **fields: Any) -> dict[str, Any]:
    body = {"node_id": "spy", "url": "https://127.0.0.1:9", "model": scene.model, "layers": "0:15",
            "total_layers": 30, "hop_key": HopKey.generate().public}  # fmt: skip
    return {**body, **fields}


def test_a_node_cannot_register_as_another_node_or_claim_absurd_speeds(scene: Scene) -> None:
    """Why: "register a node that claims huge speed: it wins every route ...; re-registering an honest
    node's id silently replaces it" and "one registration with prefill_tps: 1e-300 makes every route
    request a 500"."""
    tracker = scene.swarm.tracker.url
    with member_client(scene.swarm.member("spy")) as spy:
        _refused(spy.post(f"{tracker}/v1/nodes", json=_registration(scene, node_id="head", url=scene.head)), 403)
        for tps in (1e12, 1e-300, float("nan"), float("inf")):
            body = _registration(scene, prefill_tps=tps, decode_tps=tps)
            _refused(spy.post(f"{tracker}/v1/nodes", content=_dumps(body), headers=_JSON), 400)
        _refused(spy.post(f"{tracker}/v1/nodes", json=_registration(scene, latency_ms={scene.head: 1e300})), 400)
    with member_client(scene.swarm.member("gw2")) as gw2:  # a gateway registers no node at all
        _refused(gw2.post(f"{tracker}/v1/nodes", json=_registration(scene)), 403, "forbidden")
    with httpx.Client(verify=ssl.create_default_context(cafile=str(scene.swarm.dir / "ca.pem")), timeout=10) as anon:
        _refused(anon.post(f"{tracker}/v1/nodes", json=_registration(scene)), 401, "certificate_required")


def test_a_node_advertising_an_address_nobody_can_dial_is_refused(scene: Scene) -> None:
    """Why: "--host 0.0.0.0 makes a node register http://0.0.0.0:PORT, which no other host can reach"."""
    with member_client(scene.swarm.member("spy")) as spy:
        for url in ("https://0.0.0.0:8100", "http://0.0.0.0:8100", "https://127.0.0.1", "https://127.0.0.1:9/x"):
            _refused(spy.post(f"{scene.swarm.tracker.url}/v1/nodes", json=_registration(scene, url=url)), 400)


def test_ssrf_through_next_hops_or_a_registered_url_is_refused(scene: Scene) -> None:
    """Why: "nodes POST to any URL named in X-Meshnet-Next-Hops, and /v1/swarm fetches any registered
    URL (SSRF)". A node forwards only along the tracker's ticket; a private swarm's tracker takes
    only https URLs of members (and every member dials peers with mutual TLS checked against the CA)."""
    with member_client(scene.swarm.member("gw2")) as gw2:
        opened = gw2.post(f"{scene.swarm.tracker.url}/v1/sessions", json={"model": scene.model, "total_layers": 30})
        session = opened.json()
        aimed = {**session, "hops": [session["hops"][0], {"url": "https://169.254.169.254:443"}]}
        error = _refused(_prefill(gw2, scene.head, aimed, [1, 2]), 401, "route_ticket_mismatch")
        assert "along its ticket" in error["message"]
        gw2.delete(f"{scene.swarm.tracker.url}/v1/sessions/{session['session_id']}")
    with member_client(scene.swarm.member("spy")) as spy:
        body = _registration(scene, url="http://169.254.169.254:80")
        _refused(spy.post(f"{scene.swarm.tracker.url}/v1/nodes", json=body), 400)
    view = httpx.get(f"{scene.swarm.gateway.url}/v1/swarm", timeout=30).json()  # type: ignore[union-attr]
    assert {n["node_id"]: n["url"] for n in view["nodes"]} == scene.nodes


def test_a_member_off_the_route_cannot_reroute_replay_or_repair_a_live_session(scene: Scene) -> None:
    """Why: "read session and route ids ..., then POST .../reroute on the head with one's own URL: the
    head replays the user's prompt activations to the attacker"."""
    sid, route_id = SessionId(scene.victim["session_id"]), scene.victim["route_id"]
    evil = ("https://127.0.0.1:9",)
    with member_client(scene.swarm.member("gw2")) as gw2:
        for ticket, code in ((None, "route_ticket_missing"), (scene.victim["ticket"], "route_ticket_mismatch")):
            path, headers = encode_reroute(RerouteRequest(sid, evil, route_id, replay=1, step=2, ticket=ticket))
            _refused(gw2.post(f"{scene.head}{path}", headers=headers), 401, code)
        repair = {"failed_node": "tail", "position": scene.position}
        _refused(gw2.post(f"{scene.swarm.tracker.url}/v1/sessions/{sid}/repair", json=repair), 403, "forbidden")


def test_a_member_off_the_route_cannot_delete_a_session(scene: Scene) -> None:
    """Why: "DELETE kills any session". A private swarm's node ends a session only for a holder of its
    tracker-signed ticket (the gateway that opened it, the route's hops); the tracker's record only
    for its owner."""
    sid = scene.victim["session_id"]
    with member_client(scene.swarm.member("gw2")) as gw2:
        _refused(gw2.delete(f"{scene.head}/v1/sessions/{sid}"), 401, "route_ticket_missing")
        forged = scene.victim["ticket"][:-4] + ("AAAA" if not scene.victim["ticket"].endswith("AAAA") else "BBBB")
        _refused(gw2.delete(f"{scene.head}/v1/sessions/{sid}", headers={"X-Meshnet-Ticket": forged}), 401)
        _refused(gw2.delete(f"{scene.swarm.tracker.url}/v1/sessions/{sid}"), 403, "forbidden")


def test_failure_report_spam_suspends_nothing(scene: Scene) -> None:
    """Why: "POST /v1/nodes/{id}/failures in a loop suspends any node"."""
    tracker, sid = scene.swarm.tracker.url, scene.victim["session_id"]
    with member_client(scene.swarm.member("gw2")) as gw2:
        for _ in range(5):
            _refused(gw2.post(f"{tracker}/v1/nodes/head/failures", json={"session_id": sid}), 403, "forbidden")
    with member_client(scene.swarm.member("gw")) as gw:  # even the owner: only nodes on its route
        for _ in range(3):
            _refused(gw.post(f"{tracker}/v1/nodes/spy/failures", json={"session_id": sid}), 400)
    with member_client(scene.swarm.member("spy")) as spy:
        _refused(spy.post(f"{tracker}/v1/nodes/head/failures", json={"session_id": sid}), 403, "forbidden")
    assert node_urls(tracker, scene.swarm.admin) == scene.nodes


def test_billing_cannot_be_forged_or_erased(scene: Scene) -> None:
    """Why: "forge or erase billing records"."""
    tracker, sid = scene.swarm.tracker.url, scene.victim["session_id"]
    record = {"node_id": "head", "layers": "0:15", "prefill_tokens": 10**6, "decode_tokens": 0}
    forged = {"session_id": sid, "route_id": scene.victim["route_id"], "records": [record]}
    with member_client(scene.swarm.member("gw2")) as gw2:
        _refused(gw2.post(f"{tracker}/v1/billing", json=forged), 403, "forbidden")
    with member_client(scene.swarm.member("spy")) as spy:  # a node bills nothing itself
        _refused(spy.post(f"{tracker}/v1/billing", json=forged), 403, "forbidden")
    with member_client(scene.swarm.member("gw")) as gw:  # the owner: only nodes of the route, bounded counts
        spy_record = {**forged, "records": [{**record, "node_id": "spy"}]}
        _refused(gw.post(f"{tracker}/v1/billing", json=spy_record), 400)
        huge = {**forged, "records": [{**record, "prefill_tokens": 2**40}]}
        _refused(gw.post(f"{tracker}/v1/billing", json=huge), 400)


def test_a_pathological_temperature_is_greedy(scene: Scene) -> None:
    """Why: 'one chat request with "temperature": 1e-310 makes the tail fail and takes the route down'."""
    answer = _chat(scene.swarm.gateway.url, scene.model, temperature=1e-310)  # type: ignore[union-attr]
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == scene.text


def test_out_of_vocabulary_token_ids_are_a_clear_4xx(scene: Scene) -> None:
    """Why: "an out-of-vocabulary token id from any hop aborts the gateway process"; here sent to the
    head as a prompt (the gateway's own range check of a hop's answer is tested in unit tests)."""
    with member_client(scene.swarm.member("gw")) as gw:
        for ids in ([10**9], [-5], [1, 2**31 - 1]):
            opened = gw.post(f"{scene.swarm.tracker.url}/v1/sessions", json={"model": scene.model, "total_layers": 30})
            session = opened.json()
            answer = _prefill(gw, session["hops"][0]["url"], session, ids)
            assert 400 <= answer.status_code < 500, answer.text
            assert set(answer.json()["error"]) >= {"message", "type", "code"}
            ticket = {"X-Meshnet-Ticket": session["ticket"]}
            gw.delete(f"{session['hops'][0]['url']}/v1/sessions/{session['session_id']}", headers=ticket)
            gw.delete(f"{scene.swarm.tracker.url}/v1/sessions/{session['session_id']}")


def test_sessions_per_client_quota(scene: Scene) -> None:
    """Why: "four sessions opened by anyone fill a node for 10 minutes": one member holds at most
    --max-sessions-per-client (2) sessions on a node; the next is 429 and the others go on."""
    opened: list[dict[str, Any]] = []
    with member_client(scene.swarm.member("gw2")) as gw2:
        try:
            for i in range(3):
                plan = gw2.post(
                    f"{scene.swarm.tracker.url}/v1/sessions", json={"model": scene.model, "total_layers": 30}
                )
                assert plan.status_code == 201, plan.text
                opened.append(plan.json())
                answer = _prefill(gw2, scene.head, opened[-1], [5, 6, 7])
                if i < 2:
                    assert answer.status_code == 200, answer.text
                else:
                    assert answer.status_code == 429 and answer.json()["error"]["code"] == "rate_limit_exceeded"
                    assert "Retry-After" in answer.headers
            # the gateway's own generations still find room
            assert _chat(scene.swarm.gateway.url, scene.model).json()["choices"][0]["message"]["content"] == scene.text
        finally:
            for session in opened:
                ticket = {"X-Meshnet-Ticket": session["ticket"]}
                gw2.delete(f"{scene.head}/v1/sessions/{session['session_id']}", headers=ticket)
                gw2.delete(f"{scene.swarm.tracker.url}/v1/sessions/{session['session_id']}")


def test_a_64_mib_prompt_is_413_at_the_gateway(scene: Scene) -> None:
    """Why: "a 64 MiB prompt stalls the gateway's event loop"."""
    body = _dumps({**CHAT, "model": scene.model, "messages": [{"role": "user", "content": "a" * 64 * 2**20}]})
    answer = httpx.post(f"{scene.swarm.gateway.url}/v1/chat/completions", content=body, headers=_JSON, timeout=120)  # type: ignore[union-attr]
    _refused(answer, 413, "payload_too_large")


def test_a_chunked_body_past_the_nodes_limit_is_413(scene: Scene) -> None:
    """Why: "chunked uploads bypass the node's body limit" (the nodes here take 8 MiB)."""

    def chunks() -> Iterator[bytes]:
        for _ in range(12):
            yield b"\0" * 2**20

    path = f"/v1/sessions/{scene.victim['session_id']}/prefill"
    with member_client(scene.swarm.member("gw2")) as gw2:
        _refused(gw2.post(f"{scene.head}{path}", content=chunks()), 413, "payload_too_large")


def test_zz_the_route_answers_identically_and_no_record_changed(scene: Scene) -> None:
    """After every attack above: the same greedy text, the same nodes, the victim session as it was."""
    answer = _chat(scene.swarm.gateway.url, scene.model)  # type: ignore[union-attr]
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == scene.text
    tracker, sid = scene.swarm.tracker.url, scene.victim["session_id"]
    assert node_urls(tracker, scene.swarm.admin) == scene.nodes
    with member_client(scene.swarm.admin) as admin:
        pinned = admin.get(f"{tracker}/v1/sessions/{sid}").json()
        assert pinned["status"] == "open" and pinned["hops"] == scene.victim["hops"]
        assert pinned["route_id"] == scene.victim["route_id"] and pinned["repairs"] == 0
        assert admin.get(f"{tracker}/v1/billing", params={"session_id": sid}).json()["records"] == []
        state = admin.get(f"{scene.head}/v1/sessions/{sid}").json()
        assert state["position"] == scene.position and not state["broken"], state


_JSON = {"Content-Type": "application/json"}


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()
