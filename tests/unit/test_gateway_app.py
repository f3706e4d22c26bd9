"""The gateway's HTTP surface over the FakeEngine, through Starlette's TestClient (lifespan on)."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from meshnet.backends.fake import FakeEngine
from meshnet.errors import RouteInconsistent
from meshnet.gateway import create_app
from meshnet.protocol.headers import GENERATION_ID

pytestmark = pytest.mark.timeout(20)

REPLY = "Hello from the fake engine."
MODEL = "fake-model"
MESSAGES = [{"role": "user", "content": "Say hello."}]

# One generation's events, in the only order the contract allows.
EVENT_ORDER = re.compile(
    r"route\.accepted model\.selected prefill\.started (prefill\.progress )+prefill\.completed "
    r"billing\.estimate decode\.started (decode\.progress )+route\.health billing\.estimate "
    r"generation\.completed"
)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(reply=REPLY, n_ctx=256)


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine)) as c:
        yield c


def _chat(client: TestClient, headers: dict[str, str] | None = None, **fields: Any):
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, **fields}
    return client.post("/v1/chat/completions", json=body, headers=headers or {})


def _completion(client: TestClient, headers: dict[str, str] | None = None, **fields: Any):
    body = {"model": MODEL, "prompt": "Once upon", "temperature": 0, "max_tokens": 64, **fields}
    body = {k: v for k, v in body.items() if v is not None}  # None: leave the field out
    return client.post("/v1/completions", json=body, headers=headers or {})


def _sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def _stream(client: TestClient, path: str, body: dict[str, Any], headers: dict[str, str] | None = None):
    """POST with stream=True; return (response, parsed chunks) after checking the SSE framing."""
    with client.stream("POST", path, json={**body, "stream": True}, headers=headers or {}) as resp:
        text = resp.read().decode()
    assert resp.status_code == 200, text
    assert resp.headers["content-type"].startswith("text/event-stream")
    data = _sse_data(text)
    assert data[-1] == "[DONE]"
    assert data.count("[DONE]") == 1
    chunks = [json.loads(d) for d in data[:-1]]
    for chunk in chunks:
        assert isinstance(chunk["meshnet"], dict)
        # each choice's own generation: the proposed id, then ID.1, ID.2, ... (n > 1)
        assert chunk["meshnet"]["generation_id"].removesuffix(".1") == resp.headers[GENERATION_ID]
    return resp, chunks


def _chat_stream_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def _events(client: TestClient, gid: str, headers: dict[str, str] | None = None) -> list[tuple[int, dict]]:
    resp = client.get(f"/v1/generations/{gid}/events", headers=headers or {})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    out: list[tuple[int, dict]] = []
    for block in resp.text.split("\n\n"):
        lines = [line for line in block.splitlines() if line and not line.startswith(":")]
        if not lines:
            continue
        assert lines[0].startswith("id: ") and lines[1].startswith("data: "), block
        out.append((int(lines[0][4:]), json.loads(lines[1][6:])))
    return out


def _error(resp, status: int, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def _assert_good_request_succeeds(client: TestClient) -> None:
    resp = _chat(client)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == REPLY


# -- models, health, metrics -----------------------------------------------------------------------
def test_models_shape(client: TestClient, engine: FakeEngine):
    resp = client.get("/v1/models")
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list"
    assert len(body["data"]) == 1
    model = body["data"][0]
    assert model["id"] == MODEL
    assert model["object"] == "model"
    assert model["owned_by"] == "meshnet"
    assert isinstance(model["created"], int)
    assert model["meshnet"] == {
        "architecture": "fake",
        "quantization": "F32",
        "layers": 4,
        "context_cap": engine.n_ctx,
        "trained_context": 1024,
    }


def test_health(client: TestClient):
    for path in ("/health", "/v1/health"):
        body = client.get(path).json()
        assert body["status"] == "ok"
        assert body["model"] == MODEL
        assert body["layers"] == "0:4"
        assert body["active_generations"] == 0


def test_metrics_count_generations_and_tokens(client: TestClient):
    resp = _chat(client)
    usage = resp.json()["usage"]
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'meshnet_generations_total{outcome="completed"} 1.0' in text
    assert f"meshnet_completion_tokens_total {float(usage['completion_tokens'])}" in text
    assert f"meshnet_prompt_tokens_total {float(usage['prompt_tokens'])}" in text
    assert "meshnet_http_requests_total" in text


# -- chat and completions --------------------------------------------------------------------------
def test_chat_non_streaming(client: TestClient):
    resp = _chat(client)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    gid = resp.headers[GENERATION_ID]
    assert body["id"] == f"chatcmpl-{gid}"
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY}
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] == len(REPLY.encode())
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["meshnet"]["generation_id"] == gid
    assert body["meshnet"]["phase"] == "completed"


def test_chat_streaming(client: TestClient):
    resp, chunks = _stream(client, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": 0})
    gid = resp.headers[GENERATION_ID]
    first = chunks[0]
    assert first["object"] == "chat.completion.chunk"
    assert first["id"] == f"chatcmpl-{gid}"
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["choices"][0]["finish_reason"] is None
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert _chat_stream_text(chunks) == REPLY
    assert all("usage" not in c for c in chunks)


def test_completion_non_streaming(client: TestClient):
    resp = _completion(client)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"] == f"cmpl-{resp.headers[GENERATION_ID]}"
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == REPLY
    assert body["choices"][0]["finish_reason"] == "stop"
    # BOS + the prompt's bytes.
    assert body["usage"]["prompt_tokens"] == 1 + len(b"Once upon")


def test_completion_default_max_tokens_is_16(client: TestClient):
    body = _completion(client, max_tokens=None).json()
    assert body["choices"][0]["text"] == REPLY[:16]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 16


def test_completion_streaming(client: TestClient):
    _, chunks = _stream(
        client, "/v1/completions", {"model": MODEL, "prompt": "Once upon", "temperature": 0, "max_tokens": 64}
    )
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completion_with_token_prompt(client: TestClient):
    resp = _completion(client, prompt=[256, 72, 105])
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == 3
    _error(_completion(client, prompt=[72, 9999]), 400)
    _assert_good_request_succeeds(client)


def test_streaming_and_non_streaming_greedy_text_are_equal(client: TestClient):
    plain = _chat(client, seed=1).json()["choices"][0]["message"]["content"]
    _, chunks = _stream(
        client, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": 0, "seed": 1}
    )
    assert _chat_stream_text(chunks) == plain == REPLY
    text_plain = _completion(client).json()["choices"][0]["text"]
    _, chunks = _stream(
        client, "/v1/completions", {"model": MODEL, "prompt": "Once upon", "temperature": 0, "max_tokens": 64}
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == text_plain


def test_max_tokens_gives_length(client: TestClient):
    body = _chat(client, max_tokens=5).json()
    assert body["choices"][0]["message"]["content"] == REPLY[:5]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


def test_stop_strings_through_the_api(client: TestClient):
    body = _chat(client, stop=["fake", "zzz"]).json()
    assert body["choices"][0]["message"]["content"] == "Hello from the "
    assert body["choices"][0]["finish_reason"] == "stop"
    _, chunks = _stream(
        client,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "temperature": 0, "stop": "from"},
    )
    assert _chat_stream_text(chunks) == "Hello "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    body = _completion(client, stop="engine").json()
    assert body["choices"][0]["text"] == "Hello from the fake "


def test_include_usage_adds_a_final_usage_chunk(client: TestClient):
    _, chunks = _stream(
        client,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "temperature": 0, "stream_options": {"include_usage": True}},
    )
    last = chunks[-1]
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["completion_tokens"] == len(REPLY.encode())
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks[:-1])


def test_utf8_reply_through_the_api():
    reply = "héllo ✓"
    with TestClient(create_app(FakeEngine(reply=reply))) as client:
        assert _chat(client).json()["choices"][0]["message"]["content"] == reply
        _, chunks = _stream(client, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
        assert _chat_stream_text(chunks) == reply


# -- generation ids --------------------------------------------------------------------------------
def test_generation_id_header_is_returned(client: TestClient):
    a = _chat(client).headers[GENERATION_ID]
    b = _chat(client).headers[GENERATION_ID]
    assert a.startswith("gen-") and b.startswith("gen-")
    assert a != b


def test_proposed_generation_id_is_honoured(client: TestClient):
    resp = _chat(client, headers={GENERATION_ID: "client-req.1"})
    assert resp.status_code == 200
    assert resp.headers[GENERATION_ID] == "client-req.1"
    assert resp.json()["id"] == "chatcmpl-client-req.1"
    resp, chunks = _stream(
        client,
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 4},
        headers={GENERATION_ID: "client-req.2"},
    )
    assert resp.headers[GENERATION_ID] == "client-req.2"
    assert all(c["id"] == "cmpl-client-req.2" for c in chunks)


def test_invalid_proposed_id_is_400(client: TestClient, engine: FakeEngine):
    _error(_chat(client, headers={GENERATION_ID: "bad id!"}), 400, param=GENERATION_ID)
    _error(_chat(client, headers={GENERATION_ID: "x" * 200}), 400, param=GENERATION_ID)
    assert engine.prefill_calls == 0
    _assert_good_request_succeeds(client)


def test_reused_id_is_409(client: TestClient, engine: FakeEngine):
    assert _chat(client, headers={GENERATION_ID: "once"}).status_code == 200
    calls = engine.prefill_calls
    err = _error(_chat(client, headers={GENERATION_ID: "once"}), 409)
    assert err["type"] == "conflict_error"
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "stream": True},
        headers={GENERATION_ID: "once"},
    ) as resp:
        resp.read()
    assert resp.status_code == 409
    assert engine.prefill_calls == calls
    _assert_good_request_succeeds(client)


# -- telemetry endpoints ---------------------------------------------------------------------------
def _check_events(events: list[tuple[int, dict]], gid: str) -> None:
    assert [seq for seq, _ in events] == list(range(1, len(events) + 1))
    types = " ".join(e["type"] for _, e in events)
    assert EVENT_ORDER.fullmatch(types), types
    times = [e["t"] for _, e in events]
    assert times == sorted(times)
    assert all(e["generation_id"] == gid for _, e in events)


def test_events_stream_is_ordered_and_complete(client: TestClient):
    for stream in (False, True):
        gid = f"gen-events-{stream}"
        if stream:
            _stream(client, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}, {GENERATION_ID: gid})
        else:
            assert _chat(client, headers={GENERATION_ID: gid}).status_code == 200
        events = _events(client, gid)
        _check_events(events, gid)
        by_type = {e["type"]: e for _, e in events}
        assert by_type["route.accepted"]["nodes"][0]["layers"] == "0:4"
        assert by_type["model.selected"]["model"] == MODEL
        done = by_type["generation.completed"]
        assert done["finish_reason"] == "stop"
        assert done["completion_tokens"] == len(REPLY.encode())
        progress = [e for _, e in events if e["type"] == "prefill.progress"]
        assert progress[-1]["done"] == progress[-1]["total"] == done["prompt_tokens"]
        billing = [e for _, e in events if e["type"] == "billing.estimate"]
        assert billing[0]["decode_layer_tokens"] == 0
        assert billing[-1]["decode_layer_tokens"] == 4 * done["completion_tokens"]
        assert billing[-1]["prefill_layer_tokens"] == 4 * done["prompt_tokens"]


def test_polling_agrees_with_the_events(client: TestClient):
    resp = _chat(client, headers={GENERATION_ID: "gen-poll"})
    events = _events(client, "gen-poll")
    snap = client.get("/v1/generations/gen-poll").json()
    done = events[-1][1]
    assert done["type"] == "generation.completed"
    assert snap["generation_id"] == "gen-poll"
    assert snap["phase"] == "completed"
    assert snap["finished"] is True
    assert snap["finish_reason"] == "stop"
    assert snap["completion_tokens"] == done["completion_tokens"] == resp.json()["usage"]["completion_tokens"]
    assert snap["prompt_tokens"] == done["prompt_tokens"]
    assert snap["prefill_done"] == snap["prompt_tokens"]
    assert snap["last_event"] == "generation.completed"
    assert snap["events"] == len(events)
    billing = [e for _, e in events if e["type"] == "billing.estimate"][-1]
    assert snap["billing_units"] == billing["units"]
    # A finished generation is no longer active.
    assert client.get("/v1/generations").json() == {"object": "list", "data": []}


def test_last_event_id_skips_history(client: TestClient):
    _chat(client, headers={GENERATION_ID: "gen-resume"})
    full = _events(client, "gen-resume")
    resumed = _events(client, "gen-resume", headers={"Last-Event-ID": "3"})
    assert resumed == full[3:]
    assert resumed[0][0] == 4
    assert _events(client, "gen-resume", headers={"Last-Event-ID": str(len(full))}) == []
    _error(client.get("/v1/generations/gen-resume/events", headers={"Last-Event-ID": "x"}), 400)


def test_events_of_unknown_generation_are_404(client: TestClient):
    _error(client.get("/v1/generations/gen-unknown/events"), 404)
    _error(client.get("/v1/generations/gen-unknown/events?wait=0.05"), 404)
    _error(client.get("/v1/generations/gen-unknown"), 404)
    _error(client.get("/v1/generations/x/events?wait=abc"), 400, param="wait")
    _error(client.get("/v1/generations/x/events?wait=31"), 400, param="wait")


def test_events_subscriber_can_wait_for_a_proposed_id(engine: FakeEngine):
    gid = "gen-announced"
    result: dict[str, Any] = {}
    app = create_app(engine)
    hub = app.state.gateway.hub
    with TestClient(app) as client:

        def subscribe() -> None:
            result["events"] = client.get(f"/v1/generations/{gid}/events?wait=10")

        thread = threading.Thread(target=subscribe)
        thread.start()
        try:
            # Send the generation only once the subscriber is really waiting for its id.
            deadline = time.monotonic() + 10
            while gid not in hub._arrivals and thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.002)
            assert gid in hub._arrivals
            resp = _chat(client, headers={GENERATION_ID: gid})
        finally:
            thread.join(timeout=15)
        assert not thread.is_alive()
        assert resp.status_code == 200
        events = result["events"]
        assert events.status_code == 200
        types = [json.loads(line[6:])["type"] for line in events.text.splitlines() if line.startswith("data: ")]
        full = [e["type"] for _, e in _events(client, gid)]
        assert full[-1] == "generation.completed"
        assert types[:2] == ["route.accepted", "model.selected"]
        assert types == full


def test_a_route_repair_is_a_retry_event_and_the_text_is_unchanged(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="meshnet.gateway")
    with TestClient(create_app(FakeEngine(reply=REPLY))) as plain:
        expected = _completion(plain, max_tokens=12).json()["choices"][0]["text"]
    with TestClient(create_app(FakeEngine(reply=REPLY, repair_at=5))) as client:
        resp = _completion(client, max_tokens=12)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected
        gid = resp.headers["x-meshnet-generation-id"]
        events = [e for _, e in _events(client, gid)]
        retry = next(e for e in events if e["type"] == "route.retry")
        assert retry["kind"] == "repair" and retry["failed_node"] == "local" and retry["attempt"] == 1
        assert retry["reason"] == "node local failed: simulated" and retry["replayed_positions"] > 0
        assert [n["node"] for n in retry["nodes"]] == ["spare"]
        types = [e["type"] for e in events]
        assert types.index("decode.started") < types.index("route.retry") < types.index("generation.completed")
        snapshot = client.get(f"/v1/generations/{gid}").json()
        assert snapshot["retries"] == 1 and snapshot["route"][0]["node"] == "spare"
        assert snapshot["session_id"] == retry["session_id"]
        metrics = client.get("/metrics").text
        assert 'meshnet_route_retries_total{kind="repair"} 1.0' in metrics
        assert 'meshnet_route_recovery_seconds_count{kind="repair"} 1.0' in metrics
        replayed = float(retry["replayed_positions"])
        assert f'meshnet_route_replayed_positions_total{{kind="repair"}} {replayed}' in metrics
    # The operator's log: one line per recovery, naming what failed, what replaced it and what it cost.
    [line] = [r.getMessage() for r in caplog.records if r.name == "meshnet.gateway"]
    assert line.startswith(f"route repair (attempt 1): generation {gid} session {retry['session_id']}: node local")
    assert "node local failed: simulated" in line and "route now spare[" in line
    assert f"{retry['replayed_positions']} positions replayed in" in line


class _InconsistentRoute(FakeEngine):
    """A route whose hops disagree after two tokens (what ``verify_hops`` raises in the route engine)."""

    def generate(self, prompt, sampler, cancel, plan=None):  # type: ignore[no-untyped-def]
        steps = super().generate(prompt, sampler, cancel, plan)
        for step in steps:
            yield step
            if getattr(step, "token", None) is not None and step.token == ord(REPLY[1]):
                raise RouteInconsistent("node mid (layers 10:20) holds 40 positions; the route should hold 41")


def test_an_inconsistent_route_stops_the_generation_with_the_reason(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.ERROR, logger="meshnet.gateway")
    with TestClient(create_app(_InconsistentRoute(reply=REPLY))) as client:
        resp = _completion(client, max_tokens=12)
        err = _error(resp, 502, code="route_inconsistent")
        assert "holds 40 positions" in err["message"]
        assert "meshnet_route_inconsistencies_total 1.0" in client.get("/metrics").text
    assert any("its route is inconsistent" in r.getMessage() for r in caplog.records)


# -- errors ----------------------------------------------------------------------------------------
def test_over_context_prompt_is_rejected_before_compute():
    engine = FakeEngine(reply=REPLY, n_ctx=64)
    with TestClient(create_app(engine)) as client:
        long = [{"role": "user", "content": "x" * 200}]
        err = _error(_chat(client, messages=long), 400, code="context_length_exceeded", param="messages")
        assert err["type"] == "invalid_request_error"
        assert "64" in err["message"]
        err = _error(_completion(client, prompt="y" * 100), 400, code="context_length_exceeded")
        with client.stream(
            "POST", "/v1/chat/completions", json={"model": MODEL, "messages": long, "stream": True}
        ) as resp:
            resp.read()
        assert resp.status_code == 400
        assert engine.prefill_calls == 0
        assert client.get("/v1/generations").json()["data"] == []
        resp = _chat(client, max_tokens=8)
        assert resp.status_code == 200, resp.text
        assert engine.prefill_calls == 1


def test_prompt_plus_max_tokens_over_cap_names_max_tokens():
    engine = FakeEngine(reply=REPLY, n_ctx=64)
    with TestClient(create_app(engine)) as client:
        err = _error(_completion(client, prompt="abc", max_tokens=61), 400, param="max_tokens")
        assert err["code"] == "context_length_exceeded"
        assert "at most 60" in err["message"]
        assert _error(_chat(client, max_completion_tokens=1000), 400, param="max_tokens")
        assert engine.prefill_calls == 0
        # Exactly at the cap is allowed.
        assert _completion(client, prompt="abc", max_tokens=60).status_code == 200


def test_unknown_model_is_404(client: TestClient, engine: FakeEngine):
    err = _error(_chat(client, model="gpt-9"), 404, code="model_not_found", param="model")
    assert err["type"] == "invalid_request_error"  # OpenAI's shape for an unknown model
    _error(_completion(client, model="gpt-9"), 404, code="model_not_found")
    assert engine.prefill_calls == 0
    _assert_good_request_succeeds(client)


def test_unknown_path_is_an_openai_shaped_404(client: TestClient):
    err = _error(client.get("/v1/nope"), 404)
    assert err["type"] == "not_found_error"
    assert "/v1/nope" in err["message"]
    _error(client.post("/v1/engines/x/completions", json={}), 404)
    _assert_good_request_succeeds(client)


def test_wrong_method_is_an_openai_shaped_405(client: TestClient):
    _error(client.get("/v1/chat/completions"), 405)
    _assert_good_request_succeeds(client)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[]", None),
        (json.dumps({"model": MODEL, "messages": MESSAGES, "temperature": 3}).encode(), "temperature"),
        (json.dumps({"model": MODEL, "messages": MESSAGES, "top_p": 0}).encode(), "top_p"),
        (json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"model": MODEL, "messages": MESSAGES, "n": 9}).encode(), "n"),
        (json.dumps({"model": MODEL, "messages": MESSAGES, "stop": list("abcde")}).encode(), "stop"),
        (json.dumps({"model": MODEL, "messages": []}).encode(), "messages"),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "x", "content": "y"}]}).encode(),
            "messages.0.role",
        ),
    ],
)
def test_bad_chat_requests_are_400_and_harmless(client: TestClient, engine: FakeEngine, body, param):
    resp = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    err = _error(resp, 400, param=param)
    assert err["type"] == "invalid_request_error"
    assert engine.prefill_calls == 0
    _assert_good_request_succeeds(client)


def test_full_queue_is_503_with_retry_after_and_failed_telemetry():
    engine = FakeEngine(reply=REPLY)
    with TestClient(create_app(engine, max_queue=0)) as client:
        resp = _chat(client, headers={GENERATION_ID: "gen-full"})
        err = _error(resp, 503)
        assert err["type"] == "overloaded_error"
        assert resp.headers["retry-after"] == "2"
        assert engine.prefill_calls == 0
        snap = client.get("/v1/generations/gen-full").json()
        assert snap["phase"] == "failed"
        assert snap["finished"] is True
        types = [e["type"] for _, e in _events(client, "gen-full")]
        assert types == ["route.accepted", "model.selected", "route.health", "generation.failed"]
        assert 'meshnet_generations_total{outcome="failed"} 1.0' in client.get("/metrics").text


def test_immediate_eos_gives_an_empty_reply_with_valid_events():
    with TestClient(create_app(FakeEngine(reply=""))) as client:
        resp = _chat(client, headers={GENERATION_ID: "gen-empty"})
        body = resp.json()
        assert body["choices"][0]["message"]["content"] == ""
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == 0
        events = _events(client, "gen-empty")
        _check_events(events, "gen-empty")
        assert "meshnet_generations_active 0.0" in client.get("/metrics").text


def test_chat_logprobs_streaming_and_not_in_openai_shape(client: TestClient):
    body = _chat(client, logprobs=True, top_logprobs=2).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == REPLY  # one entry per decoded token, EOS not included
    first = content[0]
    assert first["token"] == "H" and first["bytes"] == [72] and first["logprob"] == pytest.approx(0.0, abs=1e-6)
    assert [a["token"] for a in first["top_logprobs"]][:1] == ["H"] and len(first["top_logprobs"]) == 2
    assert first["top_logprobs"][1]["logprob"] < -50  # the fake model is sure of its choice
    _, chunks = _stream(
        client,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    )
    streamed = [
        e
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content
    assert _chat(client).json()["choices"][0]["logprobs"] is None  # not asked: null, as OpenAI


def test_completion_logprobs_in_the_legacy_shape(client: TestClient):
    logprobs = _completion(client, logprobs=1, max_tokens=5).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == list(REPLY[:5])
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4]
    assert all(lp == pytest.approx(0.0, abs=1e-6) for lp in logprobs["token_logprobs"])
    assert [list(top) for top in logprobs["top_logprobs"]] == [[c] for c in REPLY[:5]]
    _error(_completion(client, logprobs=6), 400, param="logprobs")


def test_n_choices_streaming_and_not(client: TestClient):
    resp = _chat(client, n=3, headers={GENERATION_ID: "gen-three"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"] == "chatcmpl-gen-three"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == REPLY and c["finish_reason"] == "stop" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 3 * len(REPLY.encode())  # every choice counts
    assert [m["generation_id"] for m in body["meshnet_choices"]] == ["gen-three", "gen-three.1", "gen-three.2"]
    assert client.get("/v1/generations/gen-three.2").json()["phase"] == "completed"  # each has its telemetry
    options = {"include_usage": True}
    request = {"model": MODEL, "prompt": "Once upon", "n": 2, "max_tokens": 64, "temperature": 0}
    _, chunks = _stream(client, "/v1/completions", {**request, "stream_options": options})
    texts = {0: "", 1: ""}
    for chunk in chunks:
        assert chunk["id"] == chunks[0]["id"]
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {0: REPLY, 1: REPLY}
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * len(REPLY.encode())
    _error(_chat(client, n=9), 400, param="n")


def test_seeded_choices_differ_and_repeat(client: TestClient, engine: FakeEngine):
    def seeds() -> list[dict[str, Any]]:
        return _chat(client, n=2, seed=5, temperature=1.0).json()["choices"]

    assert seeds() == seeds()  # choice i draws from seed + i: reproducible


def test_a_body_past_the_limit_is_a_413_declared_or_streamed(engine: FakeEngine):
    """The gateway refuses a huge request before reading it, and while a chunked one streams in."""
    with TestClient(create_app(engine, max_body_bytes=4096)) as small:
        text = "x" * 8000
        body = json.dumps({"model": engine.info.model_id, "prompt": text, "max_tokens": 1}).encode()
        declared = small.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert declared.status_code == 413 and "limit of 4096 bytes" in declared.json()["error"]["message"]
        chunked = small.post("/v1/completions", content=iter([body[:3000], body[3000:]]))
        assert chunked.status_code == 413 and "streamed past it" in chunked.json()["error"]["message"]
        fits = small.post("/v1/completions", json={"model": engine.info.model_id, "prompt": "hi", "max_tokens": 1})
        assert fits.status_code == 200, fits.text
