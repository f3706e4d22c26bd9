"""Every malformed field of a public API request is a 400 in OpenAI's error shape, never a 500
(issue 28): the named cases, then a sweep of hostile values over every field of both endpoints,
through the real gateway app over the FakeEngine."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from meshnet.backends.fake import FakeEngine
from meshnet.gateway import create_app
from meshnet.gateway.validation import MAX_DEPTH, load_json

pytestmark = pytest.mark.timeout(120)

MODEL = "fake-model"
MSG = [{"role": "user", "content": "hi"}]
CHAT_FIELDS = [
    "model", "messages", "stream", "stream_options", "temperature", "top_p", "top_k", "seed", "max_tokens",
    "max_completion_tokens", "stop", "n", "presence_penalty", "frequency_penalty", "logit_bias", "response_format",
    "grammar", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "functions",
    "function_call", "modalities", "audio", "web_search_options", "user",
]  # fmt: skip
COMPLETION_FIELDS = ["model", "prompt", "echo", "logprobs", "suffix", "max_tokens", "seed", "logit_bias", "n", "stop"]
# Raw JSON fragments: each is a value some field may be sent.
HOSTILE = [
    "null", "true", "-1", "0", "1e999", "-1e999", "1.5", "9" * 5000, "-" + "9" * 5000, "1" + "0" * 400 + ".0",
    "18446744073709551616", "9223372036854775808", '""', '"\\ud800"', '"a\\udfff"', '"²"', '"\\u0000"',
    '"' + "x" * 70000 + '"', "[]", "[1]", '["\\ud800"]', "[" * 900 + "]" * 900, "{}", '{"a": 1}',
    '{"\\ud800": 1}', '{"²": 1}', '{"1": 1e999}', '{"type": "json_schema", "json_schema": {"schema": ' + "[" * 80
    + "]" * 80 + "}}", '{"type": "function", "function": {"name": "\\ud800"}}', '[{"type": "text", "text": 5}]',
    '[{"role": "user", "content": "\\ud800"}]', '[{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]',
    '[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "' + "9" * 5000
    + '"}}]}]', '[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '
    '"[\\"\\\\ud800\\"]"}}]}]',
]  # fmt: skip


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(FakeEngine(reply="ok", n_ctx=4096)), raise_server_exceptions=False) as c:
        yield c


def _post(client: TestClient, path: str, raw: str) -> tuple[int, dict[str, Any]]:
    answer = client.post(
        path, content=raw.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"}
    )
    return answer.status_code, answer.json() if answer.headers.get("content-type", "").startswith(
        "application/json"
    ) else {}


def _assert_4xx(status: int, body: dict[str, Any], what: str) -> None:
    assert status < 500, f"{what}: {status} {body}"
    if status >= 400:
        assert set(body.get("error", {})) >= {"message", "type", "param", "code"}, f"{what}: {body}"


@pytest.mark.parametrize(
    "raw",
    [
        '{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "seed": -1}',
        '{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + "9" * 5000 + "}",
        '{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "x": ' + "[" * 900 + "]" * 900 + "}",
        '{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"²": 1}}',
        '{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud800"}]}',
        '{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    ],
    ids=["seed -1", "5000-digit integer", "900-deep JSON", "logit_bias superscript", "lone surrogate", "NaN"],
)
def test_the_reported_bodies_are_400(client: TestClient, raw: str) -> None:
    status, body = _post(client, "/v1/chat/completions", raw)
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "fields"), [("/v1/chat/completions", CHAT_FIELDS), ("/v1/completions", COMPLETION_FIELDS)]
)
def test_every_hostile_value_in_every_field_is_never_a_500(client: TestClient, path: str, fields: list[str]) -> None:
    base = {"model": MODEL, "max_tokens": 2, **({"messages": MSG} if "chat" in path else {"prompt": "hi"})}
    for field in fields:
        for value in HOSTILE:
            rest = json.dumps({k: v for k, v in base.items() if k != field})
            raw = rest[:-1] + f', "{field}": {value}}}'
            status, body = _post(client, path, raw)
            _assert_4xx(status, body, f"{path} {field}={value[:60]}")


def test_random_mutations_of_a_good_body_are_never_a_500(client: TestClient) -> None:
    """Byte-level mutations of a good request: whatever they parse into, the answer is not a 500."""
    rng = random.Random(28)
    good = json.dumps({"model": MODEL, "messages": MSG, "max_tokens": 2, "logit_bias": {"5": 1}, "stop": ["x"]})
    alphabet = '{}[]",:0123456789-.eE\\u²d8 truefalsn'
    for _ in range(300):
        chars = list(good)
        for _ in range(rng.randint(1, 4)):
            chars[rng.randrange(len(chars))] = rng.choice(alphabet)
        raw = "".join(chars)
        status, body = _post(client, "/v1/chat/completions", raw)
        _assert_4xx(status, body, raw)


def test_load_json_walks_iteratively_and_names_the_path() -> None:
    with pytest.raises(Exception, match=r"deeper than 64 levels \(at a\.0\.0"):
        load_json(('{"a": ' + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "}").encode())
    assert load_json(('{"a": ' + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}").encode())
    with pytest.raises(Exception, match=r"'a\.1' holds a lone UTF-16 surrogate"):
        load_json(b'{"a": ["ok", "\\ud83d"]}')
    assert load_json('{"a": "\\ud83d\\ude00 é"}'.encode()) == {"a": "\U0001f600 é"}  # a pair is a character
