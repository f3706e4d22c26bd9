"""API keys on the gateway: the key file, 401/429 in OpenAI's shape, per-key limits, open endpoints."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from meshnet.backends.fake import FakeEngine
from meshnet.errors import RateLimited, Unauthorized
from meshnet.gateway import create_app
from meshnet.gateway.auth import COOKIE, KeyPolicy, KeyRing, digest, load_keys
from meshnet.routes import RoutePlan

pytestmark = pytest.mark.timeout(20)

ALICE = "sk-alice+0123456789/abcdef=="  # base64 characters: the cookie carries it URI-encoded
BOB = "sk-bob-0123456789abcdef00"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def test_a_file_of_lines_gives_every_key_the_default_limits(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# the team\n{ALICE}\n\n{BOB}  # bob's laptop\n")
    ring = load_keys(path)
    assert len(ring) == 2
    assert ring.authenticate(BOB).name == "key-2"


def test_a_json_file_sets_a_policy_per_key(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": ALICE, "name": "alice", "max_concurrency": 1,
                                          "requests_per_minute": 3}]}))  # fmt: skip
    policy = load_keys(path).authenticate(ALICE)
    assert (policy.name, policy.max_concurrency, policy.requests_per_minute) == ("alice", 1, 3)
    assert policy.key_digest == digest(ALICE) and ALICE not in repr(policy)


@pytest.mark.parametrize(
    ("content", "fault"),
    [
        ("", "no API keys"),
        ("short\n", "at least 16"),
        ("{not json", "not valid JSON"),
        ('{"keys": {}}', "expected"),
        (json.dumps({"keys": [{"key": ALICE, "rpm": 3}]}), "unknown fields"),
        (json.dumps({"keys": [{"key": ALICE, "max_concurrency": 0}]}), "max_concurrency"),
        (json.dumps({"keys": [{"key": ALICE, "max_concurrency": "2"}]}), "integer"),
        (json.dumps({"keys": [{"key": ALICE, "name": "a"}, {"key": BOB, "name": "a"}]}), "unique"),
        (json.dumps({"keys": [{"key": ALICE}, {"key": ALICE}]}), "twice"),
        (json.dumps({"keys": [{"key": ALICE, "trusted_only": "yes"}]}), "trusted_only must be true or false"),
    ],
)
def test_a_bad_key_file_says_what_to_fix(tmp_path: Path, content: str, fault: str) -> None:
    path = tmp_path / "keys"
    path.write_text(content)
    with pytest.raises(ValueError, match=fault):
        load_keys(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_keys(tmp_path / "missing")


def test_limits_per_key_with_a_clock() -> None:
    now = [1000.0]
    ring = KeyRing([KeyPolicy("alice", digest(ALICE), max_concurrency=2, requests_per_minute=3)], clock=lambda: now[0])
    alice = ring.authenticate(ALICE)
    ring.admit(alice)
    ring.admit(alice)
    with pytest.raises(RateLimited, match="2 generations in flight"):
        ring.admit(alice)
    ring.release(alice)
    now[0] += 10
    ring.admit(alice)  # the third request of the minute
    ring.release(alice)
    with pytest.raises(RateLimited, match="last minute") as info:
        ring.admit(alice)
    assert info.value.retry_after_s == 50 and info.value.status == 429
    now[0] += 50.5
    ring.admit(alice)  # the first request left the window
    with pytest.raises(Unauthorized):
        ring.authenticate("sk-mallory-000000000000")
    with pytest.raises(Unauthorized, match="Bearer"):
        ring.authenticate(None)


@pytest.fixture
def client() -> Iterator[TestClient]:
    ring = KeyRing([KeyPolicy("alice", digest(ALICE), max_concurrency=1), KeyPolicy("bob", digest(BOB))])
    with TestClient(create_app(FakeEngine(step_delay_s=0.05), api_keys=ring)) as c:
        yield c


def test_the_api_needs_a_key_and_health_does_not(client: TestClient) -> None:
    for path in ("/v1/models", "/v1/generations", "/v1/swarm", "/metrics"):
        answer = client.get(path)
        assert answer.status_code == 401, path
        assert answer.headers["www-authenticate"] == "Bearer"
        assert answer.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/health").status_code == 200 and client.get("/v1/health").status_code == 200
    assert client.get("/").status_code == 200  # the dashboard's page asks for the key itself
    wrong = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {ALICE}x"})
    assert wrong.status_code == 401 and "not valid" in wrong.json()["error"]["message"]
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {ALICE}"}).status_code == 200
    assert client.get("/v1/models", headers={"Cookie": f"{COOKIE}={BOB}"}).status_code == 200  # the dashboard's way
    encoded = urllib.parse.quote(ALICE, safe="")
    assert client.get("/v1/models", headers={"Cookie": f"{COOKIE}={encoded}"}).status_code == 200


def test_a_key_past_its_concurrency_gets_429_and_others_are_served(client: TestClient) -> None:
    alice = {"Authorization": f"Bearer {ALICE}"}
    started = threading.Event()
    results: list[int] = []

    def long_stream() -> None:
        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=alice) as r:
            for _ in r.iter_lines():
                started.set()
            results.append(r.status_code)

    worker = threading.Thread(target=long_stream)
    worker.start()
    assert started.wait(10)
    second = client.post("/v1/chat/completions", json=CHAT, headers=alice)
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert second.json()["error"]["type"] == "rate_limit_error"
    assert client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {BOB}"}).status_code == 200
    worker.join(10)
    assert results == [200]
    assert client.post("/v1/chat/completions", json=CHAT, headers=alice).status_code == 200  # the slot came back


class _PlanRecorder(FakeEngine):
    """The fake engine, recording what every route was asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[bool] = []

    def plan(
        self, *, prompt_tokens: int = 0, max_tokens: int = 0, trusted_only: bool = False, prompt: Sequence[int] = (),
        namespace: bytes = b"",
    ) -> RoutePlan:  # fmt: skip
        self.asked.append(trusted_only)
        return super().plan(prompt_tokens=prompt_tokens, max_tokens=max_tokens)


def test_a_key_with_the_trusted_only_policy_gets_routes_over_trusted_nodes_only(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": ALICE, "name": "alice", "trusted_only": True}, {"key": BOB}]}))
    ring = load_keys(path)
    assert ring.authenticate(ALICE).trusted_only and not ring.authenticate(BOB).trusted_only
    engine = _PlanRecorder()
    with TestClient(create_app(engine, api_keys=ring)) as c:
        for key in (ALICE, BOB):
            answer = c.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 200, answer.text
    assert engine.asked == [True, True, False, False]  # every choice of alice's request, none of bob's


class _NamespaceRecorder(FakeEngine):
    """The fake engine, recording the prefix namespace every route was planned in."""

    def __init__(self) -> None:
        super().__init__()
        self.namespaces: list[bytes] = []

    def plan(
        self, *, prompt_tokens: int = 0, max_tokens: int = 0, trusted_only: bool = False, prompt: Sequence[int] = (),
        namespace: bytes = b"",
    ) -> RoutePlan:  # fmt: skip
        self.namespaces.append(namespace)
        return super().plan(prompt_tokens=prompt_tokens, max_tokens=max_tokens)


def test_each_key_plans_its_prompts_in_a_prefix_namespace_of_its_own() -> None:
    """Issue 28: the prefix cache must not tell one key whether another sent the same prompt."""
    ring = KeyRing([KeyPolicy("alice", digest(ALICE)), KeyPolicy("bob", digest(BOB))])
    engine = _NamespaceRecorder()
    with TestClient(create_app(engine, api_keys=ring)) as c:
        for key in (ALICE, BOB, ALICE):
            assert (
                c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}).status_code == 200
            )
    alice, bob, again = engine.namespaces
    assert alice == again == bytes.fromhex(digest(ALICE)) and bob == bytes.fromhex(digest(BOB)) and alice != bob
    keyless = _NamespaceRecorder()
    with TestClient(create_app(keyless)) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert keyless.namespaces == [b""]
