"""What a browser may do with the gateway (issue 28): the key cookie is the server's (HttpOnly,
SameSite=Strict, /v1/ only) and opens the dashboard's endpoints from its own origin only; a request
from another origin, or naming a Host that is not the gateway's (DNS rebinding), is refused; a key's
concurrency counts generations (``n``), not requests."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from meshnet.backends.fake import FakeEngine
from meshnet.gateway import create_app
from meshnet.gateway.auth import COOKIE, KEY_PATH, KeyPolicy, KeyRing, digest
from meshnet.gateway.origin import HostPolicy, host_name

pytestmark = pytest.mark.timeout(30)

KEY = "sk-origin-test-0123456789"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HOST = "127.0.0.1:8000"


@pytest.fixture
def keyed() -> Iterator[TestClient]:
    ring = KeyRing([KeyPolicy("alice", digest(KEY), max_concurrency=4)])
    app = create_app(FakeEngine(step_delay_s=0.05), api_keys=ring, allowed_hosts=HostPolicy.of(["gw.example"]))
    with TestClient(app, base_url=f"http://{HOST}") as c:
        yield c


def test_host_names() -> None:
    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:80", "LocalHost", "::1", "gw.example:443")] == [
        "127.0.0.1", "::1", "localhost", "::1", "gw.example"]  # fmt: skip
    policy = HostPolicy.of(["gw.example"])
    for ok in ("127.0.0.1:8000", "[::1]:8000", "10.0.0.5", "localhost:8000", "app.localhost", "GW.example:8443"):
        assert policy.allows(ok), ok
    for bad in ("evil.example:8000", "127.0.0.1.nip.io:8000", "gw.example.evil", "localhost.evil.com"):
        assert not policy.allows(bad), bad


def test_sign_in_sets_an_http_only_strict_cookie_for_the_api_only(keyed: TestClient) -> None:
    assert keyed.get(KEY_PATH).json() == {"keys": True}
    wrong = keyed.post(KEY_PATH, json={"key": KEY + "x"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    assert keyed.post(KEY_PATH, json=["no"]).status_code == 400
    answer = keyed.post(KEY_PATH, json={"key": KEY})
    assert answer.status_code == 204
    cookie = answer.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert "Path=/v1/" in cookie
    assert keyed.get("/v1/models").status_code == 200  # the client's jar sends it now
    out = keyed.delete(KEY_PATH)
    assert out.status_code == 204 and "Max-Age=0" in out.headers["set-cookie"]


def test_the_cookie_opens_the_dashboards_endpoints_from_its_own_origin_only(keyed: TestClient) -> None:
    cookie = {"Cookie": f"{COOKIE}={KEY}"}
    assert keyed.get("/v1/models", headers=cookie).status_code == 200
    assert keyed.get("/v1/models", headers={**cookie, "Sec-Fetch-Site": "same-origin"}).status_code == 200
    # a page on another port of the same host is "same-site": its requests carry the cookie
    for site in ("same-site", "cross-site"):
        assert keyed.get("/v1/models", headers={**cookie, "Sec-Fetch-Site": site}).status_code == 401, site
    assert keyed.get("/metrics", headers=cookie).status_code == 401  # not a dashboard endpoint
    assert keyed.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert keyed.post(KEY_PATH, json={"key": KEY}, headers={"Sec-Fetch-Site": "same-site"}).status_code == 401


def test_a_request_from_another_origin_or_for_another_host_is_refused(keyed: TestClient) -> None:
    bearer = {"Authorization": f"Bearer {KEY}"}
    own = keyed.post("/v1/chat/completions", json=CHAT, headers={**bearer, "Origin": f"http://{HOST}"})
    assert own.status_code == 200
    for origin in ("http://127.0.0.1:9999", "http://evil.example", "null", "http://127.0.0.1:8000.evil"):
        refused = keyed.post("/v1/chat/completions", json=CHAT, headers={**bearer, "Origin": origin})
        assert refused.status_code == 403, origin
        assert refused.json()["error"]["param"] == "Origin"
    assert keyed.post(KEY_PATH, json={"key": KEY}, headers={"Origin": "http://127.0.0.1:9999"}).status_code == 403
    rebound = keyed.get("/v1/models", headers={**bearer, "Host": "evil.example:8000"})
    assert rebound.status_code == 403 and rebound.json()["error"]["param"] == "Host"
    assert keyed.get("/", headers={"Host": "evil.example:8000"}).status_code == 403  # the page too
    assert keyed.get("/v1/models", headers={**bearer, "Host": "gw.example"}).status_code == 200  # --allowed-host
    assert keyed.get("/health", headers={"Host": "localhost:8000"}).status_code == 200


def test_a_keyless_loopback_gateway_refuses_a_rebound_host() -> None:
    app = create_app(FakeEngine(), allowed_hosts=HostPolicy())
    with TestClient(app, base_url="http://attacker.example:8000") as c:
        assert c.get("/v1/models").status_code == 403
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 403
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        assert c.get("/v1/models").status_code == 200


def test_a_keys_concurrency_counts_generations_not_requests() -> None:
    ring = KeyRing([KeyPolicy("alice", digest(KEY), max_concurrency=3)])
    bearer = {"Authorization": f"Bearer {KEY}"}
    with TestClient(create_app(FakeEngine(step_delay_s=0.05), api_keys=ring)) as c:
        too_many = c.post("/v1/chat/completions", json={**CHAT, "n": 4}, headers=bearer)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        started = threading.Event()

        def two_choices() -> None:
            body = {**CHAT, "n": 2, "stream": True, "max_tokens": 40}
            with c.stream("POST", "/v1/chat/completions", json=body, headers=bearer) as r:
                for _ in r.iter_lines():
                    started.set()

        worker = threading.Thread(target=two_choices)
        worker.start()
        assert started.wait(10)
        assert ring.in_flight("alice") == 2
        second = c.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers=bearer)  # 2 + 2 > 3
        assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded"
        worker.join(20)
        assert ring.in_flight("alice") == 0
        assert c.post("/v1/chat/completions", json={**CHAT, "n": 3}, headers=bearer).status_code == 200
        assert ring.in_flight("alice") == 0
