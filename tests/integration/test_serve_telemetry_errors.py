"""Telemetry over raw SSE, and every bad request, against a real ``meshnet serve``."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from tests.procs import Proc

pytestmark = pytest.mark.real

ORDER = [
    "route.accepted",
    "model.selected",
    "prefill.started",
    "prefill.progress",
    "prefill.completed",
    "billing.estimate",
    "decode.started",
    "decode.progress",
    "route.health",
    "billing.estimate",
    "generation.completed",
]


def read_events(url: str, timeout_s: float = 60.0) -> list[dict]:
    events = []
    with httpx.stream("GET", url, timeout=timeout_s) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def collapse(types: list[str]) -> list[str]:
    """Fold repeats of progress events so the order can be compared with ORDER."""
    out: list[str] = []
    for t in types:
        if out and t == out[-1] and t.endswith(".progress"):
            continue
        out.append(t)
    return out


def test_events_stream_live_in_order_and_polling_agrees(server: Proc, model_id: str) -> None:
    gid = f"test-{time.time_ns()}"
    got: list[dict] = []
    # Subscribe first (the id is proposed by the client), then send the request.
    reader = threading.Thread(
        target=lambda: got.extend(read_events(f"{server.url}/v1/generations/{gid}/events?wait=20"))
    )
    reader.start()
    time.sleep(0.3)
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"X-Meshnet-Generation-Id": gid},
        json={
            "model": model_id,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 20,
            "temperature": 0,
        },
        timeout=120,
    )
    assert response.status_code == 200
    assert response.headers["x-meshnet-generation-id"] == gid
    reader.join(60)
    assert not reader.is_alive()
    types = [e["type"] for e in got]
    assert collapse(types) == ORDER, types
    assert all(e["generation_id"] == gid for e in got)
    ts = [e["t"] for e in got]
    assert ts == sorted(ts) and ts[0] < 0.1
    accepted = got[0]
    assert accepted["session_id"].startswith("ses-") and accepted["route_id"].startswith("rte-")
    assert accepted["nodes"][0]["layers"] == "0:30"
    selected = got[1]
    assert selected["model"] == model_id and selected["quantization"] == "Q4_1"
    progress = [e for e in got if e["type"] == "prefill.progress"]
    assert progress[-1]["done"] == progress[-1]["total"] > 0
    completed = got[-1]
    usage = response.json()["usage"]
    assert completed["completion_tokens"] == usage["completion_tokens"]
    assert completed["prompt_tokens"] == usage["prompt_tokens"]
    billing = [e for e in got if e["type"] == "billing.estimate"][-1]
    assert billing["units"] == pytest.approx((usage["prompt_tokens"] * 30 + usage["completion_tokens"] * 30 * 2) / 1000)
    poll = httpx.get(f"{server.url}/v1/generations/{gid}", timeout=10).json()
    assert poll["phase"] == "completed" and poll["finished"] is True
    assert poll["completion_tokens"] == completed["completion_tokens"]
    assert poll["last_event"] == "generation.completed"
    assert poll["events"] == len(got)
    # A late subscriber gets the whole history, then the stream ends.
    assert [e["type"] for e in read_events(f"{server.url}/v1/generations/{gid}/events")] == types


def test_non_streaming_request_is_observable_while_it_runs(server: Proc, model_id: str) -> None:
    gid = f"poll-{time.time_ns()}"
    done = threading.Event()

    def send() -> None:
        httpx.post(
            f"{server.url}/v1/completions",
            headers={"X-Meshnet-Generation-Id": gid},
            json={"model": model_id, "prompt": "Count: 1, 2, 3,", "max_tokens": 120, "temperature": 0},
            timeout=120,
        )
        done.set()

    threading.Thread(target=send).start()
    seen_phases = set()
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline:
        r = httpx.get(f"{server.url}/v1/generations/{gid}", timeout=10)
        if r.status_code == 200:
            seen_phases.add(r.json()["phase"])
        time.sleep(0.05)
    assert done.wait(60)
    assert "decode" in seen_phases, seen_phases


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    (
        "/v1/chat/completions",
        {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
        404,
        "model",
    ),
    ("/v1/chat/completions", {"model": "MODEL", "messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "temperature": 2.5},
        400,
        "temperature",
    ),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "top_p": 0},
        400,
        "top_p",
    ),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        400,
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "n": 9},
        400,
        "n",
    ),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000},
        400,
        "max_tokens",
    ),
    ("/v1/completions", {"model": "MODEL", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "MODEL"}, 400, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": [999999999]}, 400, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_request_gets_openai_error_and_server_keeps_serving(
    server: Proc, model_id: str, path: str, body: object, status: int, param: str | None
) -> None:
    if isinstance(body, dict):
        content = json.dumps(body).replace("MODEL", model_id).encode()
    else:
        assert isinstance(body, bytes)
        content = body
    r = httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model_id, "prompt": "Hi", "max_tokens": 1, "temperature": 0},
        timeout=60,
    )
    assert ok.status_code == 200


def metric(server: Proc, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_over_cap_prompt_is_rejected_before_any_compute(server: Proc, model_id: str) -> None:
    prefilled = metric(server, "meshnet_prompt_tokens_total")
    started = time.monotonic()
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": model_id, "messages": [{"role": "user", "content": "word " * 3000}]},
        timeout=30,
    )
    elapsed = time.monotonic() - started
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    # The message names both numbers: the prompt's token count and the cap (--ctx 2048).
    match = re.search(r"the prompt is (\d+) tokens but the context cap is (\d+) tokens", error["message"])
    assert match, error["message"]
    assert int(match.group(1)) > 3000 and int(match.group(2)) == 2048
    assert metric(server, "meshnet_prompt_tokens_total") == prefilled
    assert elapsed < 5
    assert "x-meshnet-generation-id" not in r.headers


def test_unknown_generation_and_path_are_openai_shaped_404(server: Proc) -> None:
    for url in ("/v1/generations/nope", "/v1/generations/nope/events", "/v1/nothing-here"):
        r = httpx.get(f"{server.url}{url}", timeout=10)
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"


def test_metrics_are_prometheus_text(server: Proc) -> None:
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    for name in (
        "meshnet_generations_total",
        "meshnet_prefill_seconds_bucket",
        "meshnet_decode_seconds_count",
        "meshnet_completion_tokens_total",
        "meshnet_http_requests_total",
    ):
        assert name in r.text
