"""The official ``openai`` client against a real ``meshnet serve`` on the bundled GGUF."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest

from tests.procs import Proc

pytestmark = pytest.mark.real

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def client(server: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def stream_text(stream: openai.Stream) -> tuple[str, str | None, list[dict]]:  # type: ignore[type-arg]
    text, finish, extras = "", None, []
    for chunk in stream:
        extras.append((chunk.model_extra or {}).get("meshnet"))
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text += (delta.content if delta is not None else choice.text) or ""
            finish = choice.finish_reason or finish
    return text, finish, extras


def test_models_lists_the_bundled_gguf(server: Proc, model_id: str) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [model_id]
    assert "SmolLM2" in model_id


def test_chat_greedy_streaming_equals_non_streaming(server: Proc, model_id: str) -> None:
    c = client(server)
    full = c.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=40)
    text = full.choices[0].message.content
    assert text and "Paris" in text
    assert full.usage is not None and full.usage.completion_tokens > 0
    assert full.choices[0].finish_reason in ("stop", "length")
    streamed, finish, extras = stream_text(
        c.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=40, stream=True)
    )
    assert streamed == text
    assert finish == full.choices[0].finish_reason
    assert all(isinstance(e, dict) and e["generation_id"] for e in extras)
    # Greedy is deterministic across requests too.
    again = c.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=40)
    assert again.choices[0].message.content == text


def test_completions_streaming_equals_non_streaming(server: Proc, model_id: str) -> None:
    c = client(server)
    prompt = "The three primary colors are"
    full = c.completions.create(model=model_id, prompt=prompt, temperature=0, max_tokens=24)
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 24
    streamed, finish, _ = stream_text(
        c.completions.create(model=model_id, prompt=prompt, temperature=0, max_tokens=24, stream=True)
    )
    assert streamed == full.choices[0].text
    assert finish == "length"


def test_seeded_sampling_is_reproducible(server: Proc, model_id: str) -> None:
    c = client(server)
    kwargs = {"model": model_id, "messages": QUESTION, "temperature": 0.9, "top_p": 0.95, "max_tokens": 24}
    a = c.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    b = c.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    assert a == b


def test_stop_sequence_cuts_the_text(server: Proc, model_id: str) -> None:
    c = client(server)
    base = c.completions.create(model=model_id, prompt="1, 2, 3, 4,", temperature=0, max_tokens=20)
    text = base.choices[0].text
    assert " 6" in text, text
    cut = c.completions.create(model=model_id, prompt="1, 2, 3, 4,", temperature=0, max_tokens=20, stop=[" 6"])
    assert cut.choices[0].text == text[: text.index(" 6")]
    assert cut.choices[0].finish_reason == "stop"


def test_max_tokens_gives_length(server: Proc, model_id: str) -> None:
    out = client(server).chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 3


def test_concurrent_requests_queue_and_all_complete(server: Proc, model_id: str) -> None:
    c = client(server)
    solo = c.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=16)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(
                lambda: c.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=16)
            )
            for _ in range(3)
        ]
        results = [f.result(timeout=120) for f in futures]
    assert all(r.choices[0].message.content == solo.choices[0].message.content for r in results)


def test_streaming_client_is_never_silent_during_a_long_prefill(server: Proc, model_id: str) -> None:
    # ~1,600 prompt tokens take seconds to prefill on 2 cores; keep-alive chunks must flow.
    long_prompt = " ".join(f"item{i}" for i in range(400))
    gaps: list[float] = []
    phases: list[str] = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"model": model_id, "prompt": long_prompt, "max_tokens": 4, "temperature": 0, "stream": True},
        timeout=120,
    ) as response:
        assert response.status_code == 200
        last = time.monotonic()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            phases.append(json.loads(line[6:])["meshnet"]["phase"])
    assert "prefill" in phases and "completed" in phases
    assert max(gaps) < 1.5, gaps


def test_client_disconnect_cancels_the_generation(server: Proc, model_id: str) -> None:
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={
            "model": model_id,
            "prompt": "Once upon a time",
            "max_tokens": 1500,
            "temperature": 0,
            "stream": True,
        },
        timeout=60,
    ) as response:
        gid = response.headers["x-meshnet-generation-id"]
        for n, _ in enumerate(response.iter_lines()):
            if n > 12:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        snap = httpx.get(f"{server.url}/v1/generations/{gid}", timeout=10).json()
        if snap["finished"]:
            break
        time.sleep(0.2)
    assert snap["phase"] == "failed" and snap["finish_reason"] == "cancelled", snap
    assert snap["completion_tokens"] < 1500
    # The engine is free again.
    out = client(server).completions.create(model=model_id, prompt="Hello", max_tokens=2, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 2
