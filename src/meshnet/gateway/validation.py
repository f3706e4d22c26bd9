"""A public API request body, read as JSON that every later layer can take without crashing.

``json.loads`` accepts more than the rest of the gateway can handle, and each of these was a 500
before this module (issue 28): an integer of 5,000 digits (Python refuses to convert it), a lone
UTF-16 surrogate such as ``"\\ud800"`` (it cannot be encoded for the tokenizer, a log line or a
hop header), JSON nested hundreds deep (recursive code further in runs out of stack), and the
non-standard ``NaN`` / ``Infinity``. ``load_json`` refuses each with ``InvalidRequest`` (a 400 in
OpenAI's error shape) naming the path of the value at fault, before pydantic ever sees the body.

The walk over the parsed value is iterative (an explicit stack), so the depth check itself cannot
overflow; it visits every value once.
"""

from __future__ import annotations

import json
from typing import Any

from meshnet.errors import InvalidRequest

__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "load_json"]

# Deeper than any OpenAI request needs (a JSON schema in response_format or a tool's parameters
# nests a few levels per property), shallow enough for every recursive reader behind it.
MAX_DEPTH = 64
# An int64 (seeds, token ids) has 19 digits; a longer literal is never a meaningful field value.
MAX_INT_DIGITS = 20


class _Refused(Exception):
    """Raised from inside ``json.loads``'s hooks; becomes ``InvalidRequest`` with a message."""


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_constant(text: str) -> float:
    raise _Refused(f"{text}, which is not JSON (numbers are finite)")


def load_json(raw: bytes) -> Any:
    """``raw`` (UTF-8 JSON) parsed, or ``InvalidRequest`` saying what is wrong and where."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"the request body is not valid JSON: not UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    try:
        data = json.loads(text, parse_int=_parse_int, parse_constant=_parse_constant)
    except _Refused as exc:
        raise InvalidRequest(f"the request body holds {exc}") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    _check_values(data)
    return data


def _check_values(data: Any) -> None:
    """Depth and strings of every value under ``data``, iteratively."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise InvalidRequest(
                f"the request body nests deeper than {MAX_DEPTH} levels (at {_where(path[:8])}...)",
                param=path[0] if path else None,
            )
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, str(i))) for i, item in enumerate(value))


def _check_text(text: str, path: tuple[str, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"'{_where(path)}' holds a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x}), which is no character; "
            "send valid Unicode text",
            param=path[0] if path else None,
        ) from None


def _where(path: tuple[str, ...]) -> str:
    return ".".join(path) or "the body"
