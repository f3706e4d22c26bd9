"""Issue #28's grammar bomb, against a running private swarm (tracker ``--swarm``, a head and a tail
node, a gateway, joined by invites): a GBNF grammar of 9,000 identical alternatives fits the 64 KiB
cap, and one check of the vocabulary under it takes a second or more. The gateway refuses it by its
measured cost (a 400 naming ``grammar``) before any route is opened; a gateway member that skips that
check and drives a route itself gets its own generation failed by the tail's per-token deadline, while
the tail goes on answering health checks, heartbeating, and serving another client's chat. A bomb the
gateway's check cannot see (behind a literal longer than the steps it walks) is the client's 400 too,
when the tail meets it: the honest tail is neither reported nor replaced for it.

The tail's deadline here is a quarter of the default, so that the bomb's check of the vocabulary
(about a second on these machines) passes it on any machine, and a plain sampling step (milliseconds)
never does."""

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
from meshnet.protocol.http_binding import encode_request
from meshnet.protocol.messages import HopRequest, Payload, Verb
from meshnet.protocol.wire import encode_tensor
from tests.private_swarm import NODE_ARGS, PrivateSwarm, private_swarm
from tests.procs import member_client

pytestmark = pytest.mark.real

BOMB = "root ::= " + " | ".join(['"ab"'] * 9000)
# The same alternatives behind a literal of ten words: the gateway's check walks four tokens into a
# grammar, so it times only the literal; the tail meets the alternatives after the tenth word.
HIDDEN = 'root ::= "' + " hello" * 10 + '" bomb\nbomb ::= ' + " | ".join(['"ab"'] * 9000)
DEADLINE_S = 0.5
CHAT = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 8, "temperature": 0}


@dataclass
class Scene:
    swarm: PrivateSwarm
    model: str
    text: str  # the fixed chat's greedy text before any attack

    @property
    def gateway(self) -> str:
        assert self.swarm.gateway is not None
        return self.swarm.gateway.url


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    args = [*NODE_ARGS, "--sample-deadline", str(DEADLINE_S)]
    with private_swarm(tmp_path_factory.mktemp("grammar"), node_args=args) as swarm:
        assert swarm.gateway is not None
        model = httpx.get(f"{swarm.gateway.url}/v1/models", timeout=10).json()["data"][0]["id"]
        first = _chat(swarm.gateway.url, model)
        assert first.status_code == 200, first.text
        yield Scene(swarm, model, first.json()["choices"][0]["message"]["content"])


def _chat(gateway: str, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/chat/completions", json={**CHAT, "model": model, **extra}, timeout=60)


def _sessions(scene: Scene) -> int:
    with member_client(scene.swarm.admin) as admin:
        return len(admin.get(f"{scene.swarm.tracker.url}/v1/sessions").json()["sessions"])


def test_the_bomb_is_a_400_naming_grammar_before_any_route_opens(scene: Scene) -> None:
    before = _sessions(scene)
    began = time.monotonic()
    for path, body in (
        ("completions", {"prompt": "Say ab:", "max_tokens": 4}),
        ("chat/completions", {"messages": [{"role": "user", "content": "Say ab."}], "max_tokens": 4}),
    ):
        answer = httpx.post(
            f"{scene.gateway}/v1/{path}", json={**body, "model": scene.model, "grammar": BOMB}, timeout=30
        )
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}, error
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "grammar",
                                                                  "grammar_too_costly"), error  # fmt: skip
    assert time.monotonic() - began < 20  # measured and refused in well under a second each when idle
    assert _sessions(scene) == before  # no route was opened for it
    assert _chat(scene.gateway, scene.model).json()["choices"][0]["message"]["content"] == scene.text


def _prefill_with(client: httpx.Client, session: dict[str, Any], ids: list[int], sampling: str) -> httpx.Response:
    """A route's first request, as a gateway sends it, with the tail's sampling parameters."""
    payload = Payload(encode_tensor(np.array([ids], dtype=np.int32), "int32"))
    request = HopRequest(Verb.PREFILL, SessionId(session["session_id"]), 0, len(ids), payload,
                         route_id=session["route_id"], next_hops=tuple(h["url"] for h in session["hops"][1:]),
                         sampling=sampling, sample=True, ticket=session.get("ticket"))  # fmt: skip
    path, headers, body = encode_request(request)
    return client.post(f"{session['hops'][0]['url']}{path}", content=body, headers=headers, timeout=60)


def test_a_bomb_past_the_gateway_fails_only_its_own_generation(scene: Scene) -> None:
    """A gateway member that skips the cost check drives a route itself with the bomb: the tail
    fails that generation at its deadline; meanwhile it answers every health check within a second,
    another client's chat is served with its usual text, and the tracker still lists it as fresh."""
    swarm = scene.swarm
    tail = next(url for node_id, url in swarm.nodes.items() if node_id == "tail")
    with member_client(swarm.member("gw")) as gw:
        opened = gw.post(f"{swarm.tracker.url}/v1/sessions", json={"model": scene.model, "total_layers": 30})
        assert opened.status_code == 201, opened.text
    session = opened.json()
    sampling = json.dumps({"temperature": 1.0, "seed": 1, "grammar": BOMB, "generated_from": 3})
    outcome: dict[str, Any] = {}

    def attack() -> None:
        began = time.monotonic()
        try:
            with member_client(swarm.member("gw"), timeout_s=60) as client:
                outcome["answer"] = _prefill_with(client, session, [1, 2, 3], sampling)
        except httpx.HTTPError as exc:
            outcome["answer"] = exc
        outcome["took"] = time.monotonic() - began

    def honest() -> None:
        outcome["chat"] = _chat(scene.gateway, scene.model)

    threads = [threading.Thread(target=attack, daemon=True), threading.Thread(target=honest, daemon=True)]
    threads[0].start()
    time.sleep(0.3)  # the bomb reaches the tail first
    threads[1].start()
    slowest = 0.0
    with member_client(swarm.admin, timeout_s=2) as admin:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(t.is_alive() for t in threads):
            began = time.monotonic()
            try:
                health = admin.get(f"{tail}/v1/health")
            except httpx.TimeoutException:
                pytest.fail("the tail stopped answering /v1/health while it sampled the bomb")
            assert health.status_code == 200, health.text
            slowest = max(slowest, time.monotonic() - began)
            time.sleep(0.2)
        for t in threads:
            t.join(5)
        assert not any(t.is_alive() for t in threads), "the bomb or the honest chat is still waiting"
        assert slowest < 1.5, slowest
        answer = outcome["answer"]
        assert isinstance(answer, httpx.Response), answer
        assert answer.status_code == 400, answer.text  # the tail's 400, as the head passes it on
        assert "grammar" in answer.text and "deadline" in answer.text, answer.text
        assert outcome["took"] < 20, outcome["took"]  # the deadline, not the seconds a step takes
        chat = outcome["chat"]
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"] == scene.text
        time.sleep(6)  # one more heartbeat interval: the tail was never dropped
        nodes = {n["node_id"]: n for n in admin.get(f"{swarm.tracker.url}/v1/nodes").json()["nodes"]}
        assert "tail" in nodes and time.time() - nodes["tail"]["last_seen"] < 12, nodes.get("tail")
        ticket = {"X-Meshnet-Ticket": session["ticket"]}
        with member_client(swarm.member("gw")) as gw:
            gw.delete(f"{session['hops'][0]['url']}/v1/sessions/{session['session_id']}", headers=ticket)
            gw.delete(f"{swarm.tracker.url}/v1/sessions/{session['session_id']}")
    again = _chat(scene.gateway, scene.model)
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == scene.text


def test_a_bomb_the_gateway_cannot_see_is_the_clients_400_and_no_hops_failure(scene: Scene) -> None:
    """Through the public API: the bomb behind a literal passes the gateway's check; the tail fails
    the generation at its deadline, the client gets a 400 naming ``grammar``, and neither hop is
    reported, suspended, floored or replaced (no route retry in the gateway's metrics: a report goes
    with a reroute, a repair with a repair). Reliability is not compared: it counts time, and a
    heartbeat late on a loaded machine lowers it a little."""
    before, retries = _nodes(scene), _retries(scene)
    answer = httpx.post(
        f"{scene.gateway}/v1/completions",
        json={"model": scene.model, "prompt": "Say hello:", "max_tokens": 64, "temperature": 1.0, "seed": 7,
              "grammar": HIDDEN},
        timeout=120,
    )  # fmt: skip
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "grammar",
                                                              "grammar_too_costly"), error  # fmt: skip
    assert "deadline" in error["message"], error
    after = _nodes(scene)
    for node in ("head", "tail"):
        assert node in after, after.keys()  # never suspended (a suspended node is off the list)
        assert after[node]["decode_floor_s"] == before[node]["decode_floor_s"], (before[node], after[node])
    assert _retries(scene) == retries  # no repair, no reroute
    chat = _chat(scene.gateway, scene.model)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == scene.text


def _retries(scene: Scene) -> list[str]:
    """The gateway's counts of route repairs and reroutes."""
    metrics = httpx.get(f"{scene.gateway}/metrics", timeout=10).text
    return sorted(line for line in metrics.splitlines() if line.startswith("meshnet_route_retries_total"))


def _nodes(scene: Scene) -> dict[str, dict[str, Any]]:
    with member_client(scene.swarm.admin) as admin:
        return {n["node_id"]: n for n in admin.get(f"{scene.swarm.tracker.url}/v1/nodes").json()["nodes"]}
