"""Tool plans: how tools are offered (native or generic), constrained and parsed back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.backends.llama_vocab import LlamaVocab
from meshnet.errors import InvalidRequest
from meshnet.gateway.chat_template import CHATML_TEMPLATE, ChatTemplate
from meshnet.gateway.tools import ToolPlan, parse_choice, parse_functions

HERMES = Path(__file__).resolve().parents[1] / "data" / "hermes_tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {"type": "function", "function": {"name": "add"}}  # no parameters: any object
FUNCTIONS = parse_functions([WEATHER, ADD])


def test_functions_and_choices_are_validated() -> None:
    assert [f.name for f in FUNCTIONS] == ["get_weather", "add"]
    assert FUNCTIONS[1].parameters == {"type": "object"}
    assert parse_choice(None, FUNCTIONS) == "auto" and parse_choice(None, ()) == "none"
    assert parse_choice({"type": "function", "function": {"name": "add"}}, FUNCTIONS) == "function:add"
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"type": "tool"}):
        with pytest.raises(InvalidRequest) as info:
            parse_choice(bad, FUNCTIONS)
        assert info.value.param == "tool_choice"
    with pytest.raises(InvalidRequest, match="description"):
        parse_functions([{"type": "function", "function": {"name": "f", "description": 3}}])


def test_templates_that_render_tools_are_native() -> None:
    assert ChatTemplate(HERMES.read_text(), bos_token="", eos_token="").supports_tools
    assert not ChatTemplate(CHATML_TEMPLATE, bos_token="", eos_token="").supports_tools


def test_the_native_template_renders_tools_calls_and_results_as_transformers_would() -> None:
    template = ChatTemplate(HERMES.read_text(), bos_token="", eos_token="")
    plan = ToolPlan(FUNCTIONS, "auto", "native")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "<clear>"}'},
    ]  # fmt: skip
    text = template.render(plan.messages(messages), tools=plan.template_tools())
    assert json.dumps(WEATHER["function"]["parameters"]) in text  # plain JSON, no HTML-safe escapes
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"sky": "<clear>"}\n</tool_response>' in text
    assert plan.grammar() == ""  # native + auto: free text, calls parsed out


def test_the_generic_style_describes_the_tools_and_writes_history_in_its_format() -> None:
    plan = ToolPlan(FUNCTIONS, "required", "generic")
    messages = plan.messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ]
    )  # fmt: skip
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call these functions")
    assert '"response"' not in messages[0]["content"]  # a call is required
    assert json.loads(messages[1]["content"]) == {"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}
    assert json.loads(messages[2]["content"]) == {"tool_response": {"tool_call_id": "c1", "content": "2"}}
    assert "tool_calls" not in messages[1] and "tool_call_id" not in messages[2]


def test_replies_parse_into_content_and_calls() -> None:
    generic = ToolPlan(FUNCTIONS, "auto", "generic")
    reply = generic.parse('{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}')
    assert reply.content is None and [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    assert reply.calls[0].id.startswith("call_")
    r = generic.parse('{"response": "It is sunny."}')
    assert r.content == "It is sunny." and not r.calls
    assert generic.parse('{"tool_calls": [{"na').content == '{"tool_calls": [{"na'  # cut short: shown as written
    native = ToolPlan(FUNCTIONS, "auto", "native")
    both = native.parse(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert both.content == "Let me look." and both.calls[0].name == "get_weather"
    assert native.parse("no calls here").content == "no calls here"
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert native.parse(broken).content == broken and not native.parse(broken).calls


@pytest.mark.parametrize("style", ["native", "generic"])
@pytest.mark.parametrize("choice", ["auto", "required", "function:add"])
def test_every_plan_grammar_compiles_and_a_named_function_is_called_once(style: str, choice: str) -> None:
    plan = ToolPlan(FUNCTIONS, choice, style)  # type: ignore[arg-type]
    grammar = plan.grammar()
    if style == "native" and choice == "auto":
        assert grammar == ""
        return
    vocab = LlamaVocab(bundled_gguf())
    try:
        compiled = vocab.grammar(grammar)
        call = '{"name": "add", "arguments": {}}'
        text = f"<tool_call>\n{call}\n</tool_call>" if style == "native" else f'{{"tool_calls": [{call}, {call}]}}'
        allowed = True
        for token in vocab.tokenize(text, add_special=False):
            if not compiled.allows(token):
                allowed = False
                break
            compiled.accept(token)
        # two calls fit unless a function is named: that one is called exactly once
        assert allowed == (style == "native" or choice != "function:add")
        assert "get_weather" in grammar or choice == "function:add"
        assert "get_weather" not in grammar or choice != "function:add"
    finally:
        vocab.close()
