"""A chat's prompt tokens: the template's own control tokens stay control tokens, and whatever the
messages say is text (issue 28).

The rendered chat is tokenized with special-token parsing on, because the template writes its turn
markers (``<|im_start|>``, ``<|eot_id|>``...) as text. Tokenized that way whole, a user who types
``<|im_end|>\\n<|im_start|>assistant\\n...`` into a message forges turns: the model sees control
tokens the template never wrote. So when some message's content holds the text of a control token
(it tokenizes differently with parsing on and off), the chat is rendered once more with each such
content replaced by a random mark (a message's ``name`` likewise); the render is split at the marks,
the template's pieces are tokenized with parsing on and the contents, put back where the marks
were, with parsing off.

That is exact only when the template passes contents through verbatim (every template seen so far
does, some trimmed): the pieces with the contents put back must give the very text the real render
gave. A template that changes such a content some other way is refused with a 400 rather than
letting the control tokens through. Messages without control-token text tokenize exactly as before.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from meshnet.errors import InvalidRequest

__all__ = ["chat_tokens"]

Render = Callable[[list[dict[str, Any]]], str]
_FIELDS = ("content", "name")  # what a client writes into a message that the template copies into the prompt


class _Tokenizer(Protocol):
    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]: ...


def _forges(tokenizer: _Tokenizer, content: object) -> bool:
    """Whether ``content`` holds the text of a control token (it tokenizes differently as text)."""
    if not isinstance(content, str) or not content:
        return False
    as_control = tokenizer.tokenize(content, add_special=False, parse_special=True)
    return as_control != tokenizer.tokenize(content, add_special=False, parse_special=False)


def chat_tokens(
    tokenizer: _Tokenizer, render: Render, messages: Sequence[dict[str, Any]], *, bos_token: str = ""
) -> list[int]:
    """The tokens of the chat ``render`` makes of ``messages``, with the BOS unless the template
    writes it; message contents are never read as control tokens."""
    text = render(list(messages))
    add = not (bos_token and text.startswith(bos_token))  # a template that writes the BOS gets no second one
    risky = [(i, f) for i, m in enumerate(messages) for f in _FIELDS if _forges(tokenizer, m.get(f))]
    if not risky:
        return tokenizer.tokenize(text, add_special=add)
    nonce = secrets.token_hex(8)
    marks: dict[str, str] = {}
    chat = [dict(m) for m in messages]
    for i, field in risky:
        mark = f"\ue000meshnet-{field}-{i}-{nonce}\ue001"
        marks[mark] = str(messages[i][field])
        chat[i][field] = mark
    skeleton = render(chat)
    pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", skeleton)
    contents = _verbatim(pieces, marks, text)
    if contents is None or any(skeleton.count(mark) != 1 for mark in marks):
        i, field = risky[0]
        raise InvalidRequest(
            f"messages[{i}].{field} holds the text of a control token of this model, and its chat template "
            f"changes the {field}, so it cannot be kept as plain text: remove the control-token text",
            param="messages",
        )
    tokens: list[int] = []
    first_piece = True
    for piece in pieces:
        plain = piece in marks
        segment = contents[piece] if plain else piece
        if not segment:
            continue
        tokens += tokenizer.tokenize(segment, add_special=add and first_piece, parse_special=not plain)
        first_piece = False
    return tokens


def _verbatim(pieces: list[str], marks: dict[str, str], text: str) -> dict[str, str] | None:
    """The content each mark stands for, as the template put it in (verbatim or trimmed), such that
    the pieces give ``text`` back; None when neither way does."""
    for shape in (lambda c: c, str.strip):
        contents = {mark: shape(content) for mark, content in marks.items()}
        if "".join(contents.get(p, p) for p in pieces) == text:
            return contents
    return None
