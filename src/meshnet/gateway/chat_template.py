"""Chat templates from the GGUF (``tokenizer.chat_template``), rendered in a Jinja sandbox."""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshnet.errors import InvalidRequest

__all__ = ["CHATML_TEMPLATE", "ChatTemplate"]

log = logging.getLogger(__name__)

# The fallback llama-server uses too, for GGUFs that carry no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise InvalidRequest(f"the chat template rejected the messages: {message}", param="messages")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """transformers' ``tojson``, which chat templates are written for: plain JSON (Jinja's own escapes
    ``<``, ``>``, ``&`` and ``'`` as HTML-safe unicode escapes, which models never saw in training)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str, eos_token: str) -> None:
        if not source:
            log.warning("the GGUF has no tokenizer.chat_template; falling back to ChatML")
            source = CHATML_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequest(f"the chat template does not parse: {exc} (line {exc.lineno})") from None
        # A template that reads ``tools`` renders them itself (meshnet.gateway.tools: the native style).
        self.supports_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        extra = {"tools": list(tools)} if tools is not None else {}
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. a template adding None to a string
            raise InvalidRequest(f"the chat template failed on these messages: {exc}", param="messages") from None
