"""Structured output and tool calling through the official ``openai`` client, on ``meshnet serve`` and
on the route of ``meshnet up`` (the grammar is applied at the tail): greedy output is token-identical,
every schema-constrained document validates, tool calls round-trip."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.procs import Proc, meshnet_process

pytestmark = pytest.mark.real

HERMES = Path(__file__).resolve().parents[1] / "data" / "hermes_tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


_CLIENTS: dict[str, openai.OpenAI] = {}


def client(url: str) -> openai.OpenAI:
    """One client per server, closed when the module ends (an unclosed one leaks its sockets)."""
    if url not in _CLIENTS:
        _CLIENTS[url] = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)
    return _CLIENTS[url]


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    for api in _CLIENTS.values():
        api.close()
    _CLIENTS.clear()


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema of 1-4 fields: bounded strings, integers, numbers, booleans, enums, arrays and
    (once) a nested object. Bounds keep a 135M model's documents short enough to finish."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth == 0 else [])
    properties: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            field: dict[str, Any] = {"type": "string", "maxLength": rng.randint(3, 16)}
        elif kind == "enum":
            field = {"enum": rng.sample(["red", "green", "blue", "north", "south", "yes", "no"], rng.randint(2, 4))}
        elif kind == "array":
            item = rng.choice([{"type": "integer"}, {"type": "string", "maxLength": 8}, {"type": "boolean"}])
            field = {"type": "array", "items": item, "maxItems": rng.randint(1, 4)}
        elif kind == "object":
            field = random_schema(rng, depth + 1)
        else:
            field = {"type": kind}
        properties[f"{kind}_{i}"] = field
    required = [k for k in properties if rng.random() < 0.8] or list(properties)[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def structured(url: str, model: str, schema: dict[str, Any], prompt: str, **extra: Any) -> tuple[str, str]:
    out = client(url).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "doc", "schema": schema, "strict": True}},
        **extra,
    )
    return out.choices[0].message.content or "", out.choices[0].finish_reason


def test_twenty_random_schemas_validate_and_the_route_writes_serves_documents(
    swarm: Proc, server: Proc, model_id: str
) -> None:
    rng = random.Random(20261201)
    subjects = ["a city", "a planet", "a recipe", "a car", "a bird", "a song", "a book", "a river"]
    for i in range(20):
        schema = random_schema(rng)
        prompt = f"Describe {subjects[i % len(subjects)]} as JSON."
        text, reason = structured(swarm.url, model_id, schema, prompt)
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
        assert (text, reason) == structured(server.url, model_id, schema, prompt), schema


def test_json_object_streamed_and_sampled_with_a_seed(swarm: Proc, server: Proc, model_id: str) -> None:
    """Any JSON object; the stream carries the same text; a seeded sampled run is the same on both."""
    texts = []
    for url in (swarm.url, server.url):
        kwargs: dict[str, Any] = {
            "model": model_id,
            "messages": [{"role": "user", "content": "Give a JSON object with a name and an age."}],
            "max_tokens": 120,
            "response_format": {"type": "json_object"},
            "temperature": 0.9,
            "seed": 42,
        }
        whole = client(url).chat.completions.create(**kwargs)
        streamed = "".join(
            c.choices[0].delta.content or "" for c in client(url).chat.completions.create(**kwargs, stream=True)
            if c.choices
        )  # fmt: skip
        assert streamed == whole.choices[0].message.content
        if whole.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(streamed), dict)
        texts.append(streamed)
    assert texts[0] == texts[1]
    assert texts[0].startswith("{")


def test_a_grammar_survives_speculation_and_completions_take_it_too(swarm: Proc, server: Proc, model_id: str) -> None:
    """llama-server's ``grammar`` on legacy completions; the route verifies drafted chunks under it."""
    grammar = 'root ::= ("yes" | "no") ", because " [a-z ]{1,60} "."'
    texts = []
    for url in (swarm.url, server.url):
        out = client(url).completions.create(
            model=model_id, prompt="Is the sky blue? Answer:", max_tokens=60, temperature=0,
            extra_body={"grammar": grammar},
        )  # fmt: skip
        texts.append(out.choices[0].text)
    assert texts[0] == texts[1]
    assert texts[0].split(",")[0] in ("yes", "no") and texts[0].endswith(".")


def test_bad_structured_requests_are_400s_naming_the_parameter(swarm: Proc, model_id: str) -> None:
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
            "response_format",
        ),
        ({"grammar": "root ::= missing"}, "grammar"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ]
    for fields, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client(swarm.url).chat.completions.create(model=model_id, messages=ASK, max_tokens=8, extra_body=fields)
        assert info.value.body["param"] == param, fields  # type: ignore[index]


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_tool_calls_in_the_generic_style_round_trip_on_the_route(swarm: Proc, server: Proc, model_id: str) -> None:
    """SmolLM2's template knows no tools: the generic JSON style, grammar-constrained."""
    api = client(swarm.url)
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        out = api.chat.completions.create(
            model=model_id, messages=ASK, temperature=0, max_tokens=80, tools=[WEATHER, ADD], tool_choice=choice
        )
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls", choice
        assert message.content is None and message.tool_calls[0].id.startswith("call_")
        name, arguments = _calls(message)[0]
        tool = WEATHER if name == "get_weather" else ADD
        jsonschema.validate(arguments, tool["function"]["parameters"])  # type: ignore[index]
    named = api.chat.completions.create(
        model=model_id, messages=ASK, temperature=0, max_tokens=80, tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
    )  # fmt: skip
    assert [n for n, _ in _calls(named.choices[0].message)] == ["add"]  # named: exactly one call of it
    # the call goes back with its result, and the model answers in words
    call = named.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "cloudy"})},
    ]
    answers = []
    for url in (swarm.url, server.url):
        out = client(url).chat.completions.create(
            model=model_id, messages=history, temperature=0, max_tokens=40, tools=[WEATHER, ADD], tool_choice="none"
        )
        assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
        answers.append(out.choices[0].message.content)
    assert answers[0] == answers[1]


def test_streamed_tool_calls_match_the_whole_response(swarm: Proc, model_id: str) -> None:
    api = client(swarm.url)
    kwargs: dict[str, Any] = {
        "model": model_id, "messages": ASK, "temperature": 0, "max_tokens": 80, "tools": [WEATHER, ADD],
        "tool_choice": "required",
    }  # fmt: skip
    whole = _calls(api.chat.completions.create(**kwargs).choices[0].message)
    calls: dict[int, dict[str, str]] = {}
    reasons, chunks = [], 0
    for chunk in api.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        chunks += 1
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == whole
    assert chunks > len(whole) + 2  # progress went out while the reply was being read (one chunk per token)


@pytest.fixture(scope="module")
def hermes_server() -> Iterator[Proc]:
    args = ["serve", "--port", "0", "--threads", "2", "--ctx", "2048", "--chat-template-file", str(HERMES)]
    with meshnet_process(args) as proc:
        yield proc


def test_tool_calls_in_a_templates_native_style(hermes_server: Proc, model_id: str) -> None:
    """A template that renders ``tools`` (Hermes/Qwen style) gets <tool_call> replies, parsed into calls;
    a required call is grammar-constrained to a valid call of the function."""
    api = client(hermes_server.url)
    out = api.chat.completions.create(
        model=model_id, messages=ASK, temperature=0, max_tokens=60, tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "tool_calls"
    ((name, arguments),) = _calls(out.choices[0].message)
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]
    call = out.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18}'},
    ]
    answer = api.chat.completions.create(model=model_id, messages=history, temperature=0, max_tokens=40,
                                         tools=[WEATHER, ADD], tool_choice="none")  # fmt: skip
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
