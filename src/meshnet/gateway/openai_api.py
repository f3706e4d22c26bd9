"""OpenAI request schemas, their validation, and the response/chunk shapes.

Pydantic errors become ``InvalidRequest`` here, naming the field at fault; nothing above this
module sees a ``ValidationError``.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from meshnet.backends.grammar import JSON_OBJECT_GRAMMAR, json_schema_grammar
from meshnet.errors import InvalidRequest
from meshnet.gateway.tools import FunctionSpec, ToolPlan, parse_choice, parse_functions
from meshnet.gateway.validation import load_json
from meshnet.sampling import SamplingParams

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "parse_body",
]

MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 8  # n: each choice is a generation of its own (its own route and prefill)
MAX_SEED = 2**63 - 1  # OpenAI's seed is an int64; samplers past the gateway take nothing wider
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key: a token id of any vocabulary fits in 10 digits


class _Strict(BaseModel):
    # Unknown fields are ignored, as OpenAI and llama-server do: clients send many optional ones.
    model_config = ConfigDict(extra="ignore", frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationParams(_Strict):
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=2**31 - 1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # OpenAI's: token id (a string) -> bias in [-100, 100], added to that token's logit
    logit_bias: dict[str, float] | None = None
    # Structured output: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}
    response_format: dict[str, object] | None = None
    # llama-server's extension: a GBNF grammar the output must follow
    grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        return value

    def check_supported(self) -> None:
        for key, value in (self.logit_bias or {}).items():
            digits = key.strip()
            # str.isdigit() is true of "²" and "٣" too, which int() refuses: ASCII digits only
            if not (digits.isascii() and digits.isdigit() and len(digits) <= MAX_TOKEN_ID_DIGITS):
                raise InvalidRequest(f"logit_bias keys are token ids (digit strings), got {key[:24]!r}",
                                     param="logit_bias")  # fmt: skip
            if not -100.0 <= value <= 100.0:
                raise InvalidRequest(f"logit_bias values lie within [-100, 100], got {value} for token {key}",
                                     param="logit_bias")  # fmt: skip
        self._response_schema()  # a malformed response_format is a 400 before any work
        if self.grammar is not None and self._response_schema() is not None:
            raise InvalidRequest("set response_format or grammar, not both", param="grammar")

    def _response_schema(self) -> dict[str, object] | None:
        """The JSON schema of ``response_format``: ``{}`` for any JSON object, None for text."""
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return {}
        if kind != "json_schema":
            raise InvalidRequest(
                f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                param="response_format",
            )
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                param="response_format",
            )
        return schema

    def output_grammar(self) -> tuple[str, str]:
        """The grammar the output must follow and the parameter it came from (``("", "")`` for free text)."""
        if self.grammar is not None:
            return self.grammar, "grammar"
        schema = self._response_schema()
        if schema is None:
            return "", ""
        if (self.response_format or {}).get("type") == "json_object":
            return JSON_OBJECT_GRAMMAR, "response_format"
        return json_schema_grammar(schema, param="response_format"), "response_format"  # {}: any JSON value

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def sampling(self) -> SamplingParams:
        bias = tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            logit_bias=bias,
            top_logprobs=self.alternatives,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )

    @property
    def wants_logprobs(self) -> bool:
        """Whether the response carries ``logprobs``."""
        return False

    @property
    def alternatives(self) -> int:
        """How many most likely tokens to report beside each decoded one."""
        return 0

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text


class AssistantToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's result answers this call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, object]:
        """The message as chat templates read it (HF's convention: a call's arguments as an object)."""
        out: dict[str, object] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(call: AssistantToolCall) -> object:
    try:  # checked as the body is: no giant integers, no surrogates escaped inside the text
        return load_json(call.function.arguments.encode("utf-8"))
    except InvalidRequest as exc:
        raise InvalidRequest(
            f"tool call {call.id}: function.arguments must be JSON text, got {call.function.arguments[:80]!r} "
            f"({exc.message})",
            param="messages",
        ) from None


class ChatCompletionRequest(_GenerationParams):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated function calling: refused with the way to the current one
    functions: list[dict[str, object]] | None = None
    function_call: str | dict[str, object] | None = None
    # Output this text model cannot produce: refused rather than silently answered with plain text
    modalities: list[str] | None = None
    audio: dict[str, object] | None = None
    web_search_options: dict[str, object] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise InvalidRequest("messages must hold at least one message", param="messages")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise InvalidRequest(f"this model writes text only; modalities {self.modalities} cannot be served",
                                 param="modalities")  # fmt: skip
        if self.audio is not None:
            raise InvalidRequest("audio output is not served: this model writes text only", param="audio")
        if self.web_search_options is not None:
            raise InvalidRequest("web search is not served: the model answers from its weights only",
                                 param="web_search_options")  # fmt: skip
        for name, instead in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, name) not in (None, [], "none"):
                raise InvalidRequest(f"{name} is OpenAI's deprecated form; send {instead} instead", param=name)
        for i, message in enumerate(self.messages):
            if message.role == "tool" and not message.tool_call_id:
                raise InvalidRequest(f"messages[{i}]: a tool message needs the tool_call_id it answers",
                                     param="messages")  # fmt: skip
            if message.tool_calls:
                if message.role != "assistant":
                    raise InvalidRequest(f"messages[{i}]: only assistant messages carry tool_calls", param="messages")
                for call in message.tool_calls:
                    _arguments(call)
        functions = self.functions_offered()
        choice = parse_choice(self.tool_choice, functions)
        if choice != "none" and (self.grammar is not None or self._response_schema() is not None):
            raise InvalidRequest("tools that may be called cannot be combined with response_format or grammar; "
                                 'set tool_choice "none" or leave the tools out', param="response_format")  # fmt: skip

    def functions_offered(self) -> tuple[FunctionSpec, ...]:
        return parse_functions(self.tools or [])

    def tool_plan(self, *, native: bool) -> ToolPlan | None:
        """How the tools are offered (None: no tools, or ``tool_choice: "none"``); ``native``: the chat
        template renders tools itself."""
        functions = self.functions_offered()
        choice = parse_choice(self.tool_choice, functions)
        if choice == "none":
            return None
        return ToolPlan(functions, choice, "native" if native else "generic", parallel=self.parallel_tool_calls)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def alternatives(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_GenerationParams):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's: alternatives per token, at most 5
    suffix: str | None = None
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for legacy completions

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise InvalidRequest("prompt must not be empty", param="prompt")
            if isinstance(self.prompt[0], str) and len(self.prompt) != 1:
                raise InvalidRequest("a batch of prompts is not supported; send one prompt", param="prompt")

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def alternatives(self) -> int:
        return self.logprobs or 0


RequestT = TypeVar("RequestT", bound=_GenerationParams)


def parse_body(raw: bytes, schema: type[RequestT]) -> RequestT:
    """JSON bytes → a validated request, or ``InvalidRequest`` naming what to fix."""
    data = load_json(raw)  # depth, integer sizes and surrogates checked (gateway.validation)
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        request = schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"invalid value for '{param}': {first['msg']}", param=param) from None
    request.check_supported()
    return request
