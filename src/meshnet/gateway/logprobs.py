"""OpenAI ``logprobs`` in both response shapes, from the tokens a generation decoded.

Every decoded token comes with the model's log-probability of it (before logit bias and
temperature) and, when the request asked for ``top_logprobs``, the most likely tokens at its
position (``meshnet.sampling.Sampler.alternatives``; on a route the tail computes them).

- Chat (``logprobs: true``, ``top_logprobs: N`` up to 20): ``{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`` — ``bytes`` are the token's UTF-8
  bytes (a token may hold part of a character; ``token`` then shows U+FFFD).
- Completions (``logprobs: N`` up to 5): ``{"tokens", "token_logprobs", "top_logprobs": [{token:
  logprob}], "text_offset"}``; ``text_offset`` counts characters into the completion text.

A stream carries, in each chunk, the entries of the tokens whose text that chunk releases; a
token whose text is held back (part of a character, a possible stop sequence) goes out with the
next chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from meshnet.sampling import Alternatives

__all__ = ["LogprobsShape"]

TokenBytes = Callable[[int], bytes]


class LogprobsShape:
    """Builds one generation's ``logprobs`` objects; ``kind`` is ``"chat"`` or ``"text"``."""

    def __init__(self, kind: str, token_bytes: TokenBytes) -> None:
        self.kind = kind
        self._bytes = token_bytes
        self._offset = 0  # characters of completion text before the next token (text shape)

    def _text(self, token: int) -> tuple[str, bytes]:
        raw = self._bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def build(self, tokens: Sequence[tuple[int, float, Alternatives]]) -> dict[str, Any]:
        """The ``logprobs`` object for ``tokens`` (token id, logprob, alternatives), in order."""
        if self.kind == "chat":
            return {"content": [self._chat_entry(*t) for t in tokens]}
        texts = [self._text(token)[0] for token, _, _ in tokens]
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [lp for _, lp, _ in tokens],
            "top_logprobs": [{self._text(t)[0]: lp for t, lp in top} for _, _, top in tokens],
            "text_offset": offsets,
        }

    def _chat_entry(self, token: int, logprob: float, top: Alternatives) -> dict[str, Any]:
        text, raw = self._text(token)
        alternatives = []
        for alt, alt_logprob in top:
            alt_text, alt_raw = self._text(alt)
            alternatives.append({"token": alt_text, "logprob": alt_logprob, "bytes": list(alt_raw)})
        return {"token": text, "logprob": logprob, "bytes": list(raw), "top_logprobs": alternatives}
