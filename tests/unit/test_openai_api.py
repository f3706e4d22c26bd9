"""parse_body: JSON bytes to a validated request, or InvalidRequest naming the field at fault."""

from __future__ import annotations

import json

import pytest

from meshnet.errors import InvalidRequest, MeshnetError
from meshnet.gateway.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from meshnet.httputil import error_body

MSG = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": MSG, **fields}).encode()


def _completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def _invalid(raw: bytes, schema=ChatCompletionRequest) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_body(raw, schema)
    assert info.value.status == 400
    assert info.value.error_type == "invalid_request_error"
    return info.value


def test_minimal_chat_request_defaults():
    req = parse_body(_chat(), ChatCompletionRequest)
    assert req.model == "m"
    assert req.messages[0].role == "user"
    assert req.messages[0].text() == "hi"
    assert not req.stream
    assert not req.include_usage
    assert req.token_limit is None
    assert req.stop_sequences == ()
    assert req.sampling.temperature == 1.0


def test_chat_request_fields_map_through():
    req = parse_body(
        _chat(
            temperature=0,
            top_p=0.5,
            top_k=4,
            seed=9,
            max_tokens=7,
            stop="END",
            stream=True,
            stream_options={"include_usage": True},
            user="ignored-unknown-field",
        ),
        ChatCompletionRequest,
    )
    assert req.sampling.greedy
    assert (req.sampling.top_p, req.sampling.top_k, req.sampling.seed) == (0.5, 4, 9)
    assert req.token_limit == 7
    assert req.stop_sequences == ("END",)
    assert req.stream and req.include_usage


def test_max_completion_tokens_wins_over_max_tokens():
    req = parse_body(_chat(max_tokens=10, max_completion_tokens=3), ChatCompletionRequest)
    assert req.token_limit == 3


def test_content_parts_are_joined():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    }
    req = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert req.messages[0].text() == "ab"


def test_completion_defaults_to_16_tokens():
    req = parse_body(_completion(), CompletionRequest)
    assert req.token_limit == 16
    assert req.prompt == "hi"


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b"\xff\xfe", b'{"model": "m",}'])
def test_malformed_json(raw):
    err = _invalid(raw)
    assert "not valid JSON" in err.message
    assert err.param is None


@pytest.mark.parametrize("raw", [b"[]", b"[1, 2]", b'"text"', b"42", b"null", b"true"])
def test_non_object_body(raw):
    err = _invalid(raw)
    assert "JSON object" in err.message
    assert err.param is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),  # no tool_call_id
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{"}}]}
                ]
            },
            "messages",
        ),
        ({"logit_bias": {"x": 5}}, "logit_bias"),
        ({"logit_bias": {"42": 101}}, "logit_bias"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"content": "hi"}]}, "messages.0.role"),
        ({"model": ""}, "model"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_chat_field_errors_name_the_param(fields, param):
    err = _invalid(_chat(**fields))
    assert err.param == param
    assert err.message


def test_four_stop_strings_are_allowed():
    req = parse_body(_chat(stop=["a", "b", "c", "d"]), ChatCompletionRequest)
    assert req.stop_sequences == ("a", "b", "c", "d")


def test_missing_messages_and_model():
    assert _invalid(json.dumps({"model": "m"}).encode()).param == "messages"
    assert _invalid(json.dumps({"messages": MSG}).encode()).param == "model"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"echo": True}, "echo"),
        ({"logprobs": 6}, "logprobs"),
        ({"suffix": "x"}, "suffix"),
        ({"logit_bias": {"42": -100.5}}, "logit_bias"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 9}, "n"),
    ],
)
def test_completion_field_errors_name_the_param(fields, param):
    assert _invalid(_completion(**fields), CompletionRequest).param == param


def test_error_body_shape():
    err = InvalidRequest("bad", param="top_p", code="x")
    assert error_body(err) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": "x"}
    }
    assert error_body(MeshnetError("boom"))["error"]["type"] == "server_error"


def test_the_neutral_values_of_unsupported_parameters_are_accepted():
    req = parse_body(
        json.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [],
                "tool_choice": "none",
                "response_format": {"type": "text"},
                "logit_bias": {},
                "top_logprobs": 0,
            }
        ).encode(),
        ChatCompletionRequest,
    )
    req.check_supported()


def test_logit_bias_becomes_sorted_sampling_pairs():
    req = parse_body(_chat(logit_bias={"7": -100, " 3": 2.5}), ChatCompletionRequest)
    req.check_supported()
    assert req.sampling.logit_bias == ((3, 2.5), (7, -100.0))


def test_logprobs_requests_ask_the_sampler_for_alternatives():
    chat = parse_body(_chat(logprobs=True, top_logprobs=3), ChatCompletionRequest)
    assert chat.wants_logprobs and chat.sampling.top_logprobs == 3
    plain = parse_body(_chat(logprobs=True), ChatCompletionRequest)
    assert plain.wants_logprobs and plain.sampling.top_logprobs == 0
    assert not parse_body(_chat(), ChatCompletionRequest).wants_logprobs
    text = parse_body(_completion(logprobs=2), CompletionRequest)
    assert text.wants_logprobs and text.sampling.top_logprobs == 2
    zero = parse_body(_completion(logprobs=0), CompletionRequest)
    assert zero.wants_logprobs and zero.sampling.top_logprobs == 0
