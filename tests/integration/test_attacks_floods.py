"""Issue #28's floods and the harvesting node, replayed against a running private swarm: a tracker
``--swarm``, a trusted head and tail (as ``meshnet up`` joins its own nodes) and a gateway, plus
members that misbehave with real credentials: a gateway ``rogue`` and node certificates ``spy`` and
``spy2`` that serve nothing.

- a repair flood (a gateway repairing its own session in a loop) used to suspend the head every
  time: 0 of 20 honest chats served;
- a heartbeat flood (a registration every 50 ms) washed a recorded failure out in seconds, and a
  node that failed at prefill was never floored;
- a fresh untrusted node claiming the largest allowed speed became the head of every route (and
  read every prompt);
- a registration could name a URL host its certificate does not list.

Each test fails on the code before issue #28 and passes after it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from meshnet.protocol.signing import HopKey
from meshnet.tracker.plausibility import MAX_FLOOR_S
from tests.private_swarm import PrivateSwarm, node_urls, private_swarm
from tests.procs import member_client

pytestmark = pytest.mark.real

CHAT = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 8, "temperature": 0}
FLOOD_S = 6.0


@dataclass
class Scene:
    swarm: PrivateSwarm
    model: str
    text: str  # the fixed chat's greedy text before any attack

    @property
    def tracker(self) -> str:
        return self.swarm.tracker.url


def _chat(scene: Scene) -> httpx.Response:
    assert scene.swarm.gateway is not None
    return httpx.post(f"{scene.swarm.gateway.url}/v1/chat/completions", json={**CHAT, "model": scene.model},
                      timeout=180)  # fmt: skip


def _nodes(scene: Scene) -> dict[str, dict[str, Any]]:
    with member_client(scene.swarm.admin) as admin:
        return {n["node_id"]: n for n in admin.get(f"{scene.tracker}/v1/nodes").json()["nodes"]}


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    with private_swarm(tmp_path_factory.mktemp("floods"), trusted=True) as swarm:
        assert swarm.gateway is not None
        swarm.join("gateway", "rogue")
        swarm.join("node", "spy")
        swarm.join("node", "spy2")
        model = httpx.get(f"{swarm.gateway.url}/v1/models", timeout=10).json()["data"][0]["id"]
        scene = Scene(swarm, model, "")
        first = _chat(scene)
        assert first.status_code == 200, first.text
        scene.text = first.json()["choices"][0]["message"]["content"]
        yield scene


def _registration(node_id: str, model: str, **fields: Any) -> dict[str, Any]:
    return {"node_id": node_id, "url": "https://127.0.0.1:9", "model": model, "layers": "0:30",
            "total_layers": 30, "hop_key": HopKey.generate().public, **fields}  # fmt: skip


def _served_throughout(scene: Scene, attack: threading.Thread) -> list[int]:
    """Honest chats, one after another, while ``attack`` runs (at least two): their statuses."""
    statuses: list[int] = []
    attack.start()
    while attack.is_alive() or len(statuses) < 2:
        answer = _chat(scene)
        statuses.append(answer.status_code)
        if answer.status_code == 200:
            assert answer.json()["choices"][0]["message"]["content"] == scene.text
    attack.join()
    return statuses


def test_a_registration_whose_url_host_is_not_in_its_certificate_is_refused(scene: Scene) -> None:
    """The spy's certificate lists loopback and this host's name: 192.0.2.7 is none of them."""
    with member_client(scene.swarm.member("spy2")) as spy2:
        answer = spy2.post(
            f"{scene.tracker}/v1/nodes", json=_registration("spy2", "decoy", url="https://192.0.2.7:8443")
        )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "url" and "192.0.2.7" in error["message"] and "--san" in error["message"]
    assert "spy2" not in _nodes(scene)


def test_a_repair_flood_suspends_nothing_and_honest_chats_are_served(scene: Scene) -> None:
    """Finding 3: a gateway repairing its own session in a loop (no replacement exists) kept the head
    suspended. Now the failure counts once, nothing is suspended, and the loop is rate-limited."""
    answers: list[httpx.Response] = []
    seen: list[set[str]] = []
    with member_client(scene.swarm.member("rogue")) as rogue:
        opened = rogue.post(f"{scene.tracker}/v1/sessions", json={"model": scene.model, "total_layers": 30})
        assert opened.status_code == 201, opened.text
        sid = opened.json()["session_id"]

        def flood() -> None:
            deadline = time.monotonic() + FLOOD_S
            while time.monotonic() < deadline:
                answers.append(rogue.post(f"{scene.tracker}/v1/sessions/{sid}/repair", json={"failed_node": "head"}))
                if len(answers) % 10 == 0:
                    seen.append(set(node_urls(scene.tracker, scene.swarm.admin)))

        statuses = _served_throughout(scene, threading.Thread(target=flood))
        rogue.delete(f"{scene.tracker}/v1/sessions/{sid}")
    assert statuses and set(statuses) == {200}, statuses
    assert seen and all({"head", "tail"} <= s for s in seen), seen  # never off the live set
    codes = {a.status_code for a in answers}
    assert codes <= {429, 503} and 429 in codes, codes
    limited = next(a for a in answers if a.status_code == 429)
    assert limited.headers["Retry-After"] and limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert "repairs" in limited.json()["error"]["message"]


def test_a_heartbeat_flood_washes_out_no_failure_and_a_node_failing_at_prefill_is_floored(scene: Scene) -> None:
    """Finding 4: a node that failed at prefill (here: the only node of a decoy model, reported by the
    gateway that routed over it) heartbeat every 50 ms and had its reliability back in seconds."""
    with member_client(scene.swarm.member("spy")) as spy, member_client(scene.swarm.member("rogue")) as rogue:
        body = _registration("spy", "decoy", decode_tps=1e7, prefill_tps=1e7, heartbeat_s=0.05)
        assert spy.post(f"{scene.tracker}/v1/nodes", json=body).status_code == 201
        opened = rogue.post(f"{scene.tracker}/v1/sessions", json={"model": "decoy", "total_layers": 30})
        assert opened.status_code == 201 and [h["node_id"] for h in opened.json()["hops"]] == ["spy"], opened.text
        sid = opened.json()["session_id"]
        report = rogue.post(f"{scene.tracker}/v1/nodes/spy/failures", json={"session_id": sid, "reason": "prefill"})
        assert report.status_code == 200 and report.json()["duplicate"] is False, report.text
        beats: list[int] = []

        def flood() -> None:
            deadline = time.monotonic() + FLOOD_S
            while time.monotonic() < deadline:
                beats.append(spy.post(f"{scene.tracker}/v1/nodes", json=body).status_code)
                time.sleep(0.05)

        statuses = _served_throughout(scene, threading.Thread(target=flood))
        rogue.delete(f"{scene.tracker}/v1/sessions/{sid}")
    assert statuses and set(statuses) == {200}, statuses
    listed = _nodes(scene)["spy"]
    assert listed["reliability"] < 0.1, listed  # the failure still weighs (it was ~0.5 after the flood)
    assert listed["decode_floor_s"] is not None and listed["decode_floor_s"] > 0.9 * MAX_FLOOR_S, listed
    assert listed["probation"] is True
    assert 429 in beats, beats  # the flood is refused past the member's rate


def test_a_fresh_untrusted_node_claiming_speed_does_not_become_head(scene: Scene) -> None:
    """Finding 4: the largest allowed speed claim won the head of every route for a node never
    measured. On probation it heads no route while the trusted head can."""
    with member_client(scene.swarm.member("spy2")) as spy2:
        body = _registration("spy2", scene.model, layers="0:15", decode_tps=1e7, prefill_tps=1e7,
                             kv_bytes_free=2**49, idle_s=0.0, weight_bytes=2**20)  # fmt: skip
        assert spy2.post(f"{scene.tracker}/v1/nodes", json=body).status_code in (200, 201)
    with member_client(scene.swarm.member("rogue")) as rogue:
        for _ in range(3):
            opened = rogue.post(f"{scene.tracker}/v1/sessions", json={"model": scene.model, "total_layers": 30})
            assert opened.status_code == 201, opened.text
            session = opened.json()
            rogue.delete(f"{scene.tracker}/v1/sessions/{session['session_id']}")
            assert [h["node_id"] for h in session["hops"]] == ["head", "tail"], session["hops"]
            assert all(alt[0]["node_id"] != "spy2" for alt in session["alternatives"]), session["alternatives"]
    listed = _nodes(scene)
    assert listed["spy2"]["probation"] is True and listed["head"]["probation"] is False
    answer = _chat(scene)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == scene.text


def test_a_failure_report_flood_counts_once_and_is_rate_limited(scene: Scene) -> None:
    """Finding 3: failure reports were taken without limit. A gateway reporting the head of its own
    session in a loop: the first report counts, the same session's others are duplicates, and past
    the member's rate the reports are 429 with ``Retry-After``; the head stays listed, and an honest
    chat is served with its usual text once the head's next heartbeat ends the one suspension."""
    answers: list[httpx.Response] = []
    with member_client(scene.swarm.member("rogue")) as rogue:
        opened = rogue.post(f"{scene.tracker}/v1/sessions", json={"model": scene.model, "total_layers": 30})
        assert opened.status_code == 201, opened.text
        sid = opened.json()["session_id"]
        deadline = time.monotonic() + FLOOD_S
        while time.monotonic() < deadline and len(answers) < 200:
            body = {"session_id": sid, "reason": "decode"}
            answers.append(rogue.post(f"{scene.tracker}/v1/nodes/head/failures", json=body))
        rogue.delete(f"{scene.tracker}/v1/sessions/{sid}")
    counted = [a for a in answers if a.status_code == 200 and a.json()["duplicate"] is False]
    assert len(counted) <= 1, [a.json() for a in counted]
    codes = {a.status_code for a in answers}
    assert codes <= {200, 429} and 429 in codes, codes
    limited = next(a for a in answers if a.status_code == 429)
    assert limited.headers["Retry-After"] and limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert "failure reports" in limited.json()["error"]["message"], limited.json()
    assert "head" in _nodes(scene)
    deadline = time.monotonic() + 30
    while (answer := _chat(scene)).status_code != 200 and time.monotonic() < deadline:
        time.sleep(1.0)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == scene.text
