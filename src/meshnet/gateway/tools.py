"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` on models that know tools and on models that don't.

Two styles, chosen by the model's own chat template:

- **native** — the template renders ``tools`` itself (it names the variable) and the model writes
  Hermes-style calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen 2.5/3,
  Hermes, SmolLM3 and most recent instruct models). The calls are parsed out of the text; text
  around them is the message's content.
- **generic** — the template knows nothing of tools (SmolLM2's, say): a system message lists the
  tools with their JSON schemas and asks for one JSON object, ``{"tool_calls": [{"name": ...,
  "arguments": {...}}]}`` or ``{"response": "..."}``, and the whole reply is constrained to exactly
  that by a grammar (llama.cpp's "generic" tool format does the same).

When a call is required (``tool_choice: "required"`` or a named function) decoding is always
grammar-constrained: the reply is a call to one of the allowed functions whose ``arguments`` are
valid under that function's ``parameters`` schema. ``tool_choice: "none"`` renders no tools at all.
Earlier turns go back through the template: assistant ``tool_calls`` and ``role: tool`` results.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from meshnet.backends.grammar import json_schema_grammar
from meshnet.errors import InvalidRequest

__all__ = ["FunctionSpec", "ParsedReply", "ToolCall", "ToolPlan", "new_call_id"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}

Style = Literal["native", "generic"]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema for the arguments object

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI shape, which chat templates that render tools expect."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    def call_schema(self) -> dict[str, Any]:
        """A call of this function: its name and arguments valid under its schema."""
        return {
            "type": "object",
            "properties": {"name": {"const": self.name}, "arguments": self.parameters},
            "required": ["name", "arguments"],
        }


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_json(self, index: int | None = None) -> dict[str, Any]:
        at = {} if index is None else {"index": index}
        return {**at, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    calls: tuple[ToolCall, ...]


def parse_functions(tools: Sequence[object]) -> tuple[FunctionSpec, ...]:
    """OpenAI's ``tools`` list → validated function specs (a 400 naming ``tools`` otherwise)."""
    specs: list[FunctionSpec] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest(f"{where}.function.name must be 1-64 of a-z, A-Z, 0-9, _ and -, got {name!r}",
                                 param="tools")  # fmt: skip
        parameters = function.get("parameters", _ANY_OBJECT)
        if not isinstance(parameters, dict):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object", param="tools")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise InvalidRequest(f"{where}.function.description must be a string", param="tools")
        if any(s.name == name for s in specs):
            raise InvalidRequest(f"{where}: two tools are named {name!r}", param="tools")
        specs.append(FunctionSpec(name, description, parameters or _ANY_OBJECT))
    return tuple(specs)


def parse_choice(choice: object, functions: Sequence[FunctionSpec]) -> str:
    """``tool_choice`` → "none" | "auto" | "required" | "function:NAME"."""
    if choice is None:
        return "auto" if functions else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not functions:
            raise InvalidRequest(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(f.name == name for f in functions):
            known = ", ".join(f.name for f in functions) or "none"
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not among the tools ({known})",
                                 param="tool_choice")  # fmt: skip
        return f"function:{name}"
    raise InvalidRequest(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are offered to the model, constrained and read back."""

    functions: tuple[FunctionSpec, ...]
    choice: str  # "auto" | "required" | "function:NAME" (a request with "none" has no plan)
    style: Style
    parallel: bool = True

    @property
    def allowed(self) -> tuple[FunctionSpec, ...]:
        if self.choice.startswith("function:"):
            name = self.choice.removeprefix("function:")
            return tuple(f for f in self.functions if f.name == name)
        return self.functions

    @property
    def must_call(self) -> bool:
        return self.choice != "auto"

    @property
    def several(self) -> bool:
        """Whether one reply may hold several calls (a named function is called once, as OpenAI does)."""
        return self.parallel and not self.choice.startswith("function:")

    # -- the prompt --------------------------------------------------------------------------
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What a native template gets as ``tools`` (the generic style puts them in a system message)."""
        return [f.as_tool() for f in self.allowed] if self.style == "native" else None

    def messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the template renders it: for the generic style, the tools are described
        in the system message and earlier calls and results are written in the reply format."""
        if self.style == "native":
            return list(messages)
        out = [_generic_turn(m) for m in messages]
        described = self._instructions()
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
        return out

    def _instructions(self) -> str:
        tools = json.dumps([f.as_tool()["function"] for f in self.allowed], ensure_ascii=False)
        call = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}'
        text = f"You can call these functions: {tools}\nTo call one, reply with only the JSON object {call}."
        if not self.must_call:
            text += ' To answer without a call, reply with only {"response": "<your answer>"}.'
        return text

    # -- constrained decoding ----------------------------------------------------------------
    def grammar(self) -> str:
        """The grammar the reply is sampled under ("" when the reply is free text: native + auto)."""
        calls = {"anyOf": [f.call_schema() for f in self.allowed]}
        if self.style == "native":
            if not self.must_call:
                return ""
            one = f'"{_OPEN}\\n" DOCUMENT "\\n{_CLOSE}"'
            root = f'{one} ("\\n" {one})*' if self.several else one
            return json_schema_grammar(calls, param="tools", root=root)
        array: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
        if not self.several:
            array["maxItems"] = 1
        with_calls = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"]}
        if self.must_call:
            return json_schema_grammar(with_calls, param="tools")
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}
        return json_schema_grammar({"anyOf": [with_calls, answer]}, param="tools")

    # -- the reply ---------------------------------------------------------------------------
    def parse(self, text: str) -> ParsedReply:
        """The reply's content and calls. Text that does not parse as a call stays content: the
        client sees what the model wrote rather than nothing."""
        return _parse_generic(text) if self.style == "generic" else _parse_native(text)


def _generic_turn(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls:
        written = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
        return {"role": "assistant", "content": json.dumps({"tool_calls": written}, ensure_ascii=False)}
    if message["role"] == "tool":
        result = {"tool_call_id": message.get("tool_call_id", ""), "content": message.get("content", "")}
        return {"role": "tool", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
    return {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}


def _call(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(new_call_id(), obj["name"], text)


def _parse_generic(text: str) -> ParsedReply:
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        return ParsedReply(text, ())
    if isinstance(reply, dict) and isinstance(reply.get("tool_calls"), list):
        calls = [_call(c) for c in reply["tool_calls"]]
        if calls and all(c is not None for c in calls):
            return ParsedReply(None, tuple(c for c in calls if c is not None))
    if isinstance(reply, dict) and isinstance(reply.get("response"), str):
        return ParsedReply(reply["response"], ())
    return ParsedReply(text, ())


def _parse_native(text: str) -> ParsedReply:
    if _OPEN not in text:
        return ParsedReply(text, ())
    calls: list[ToolCall] = []
    for body in _HERMES.findall(text):
        try:
            call = _call(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return ParsedReply(text, ())  # a malformed call: show the text as written
        calls.append(call)
    content = _HERMES.sub("", text).strip()
    return ParsedReply(content or None, tuple(calls))
