"""Drafting for speculative decoding through a route: prompt lookup (n-gram) at the gateway.

A route's time per token is mostly the walk through its hops, not the compute. The gateway
guesses the next few tokens, sends them with the step as one *verify chunk*, and the tail keeps
the longest prefix the model agrees with plus one token of its own (``Sampler.verify``): one walk
through the route yields up to ``k + 1`` tokens. Every hop drops the rejected positions before
the answer passes it, so its KV is what plain decoding would have left (docs/protocol.md).

The drafter here is prompt lookup: find the longest recent n-gram (``max_ngram`` down to
``min_ngram`` tokens) that ends the text so far and occurred before, and propose what followed its
latest occurrence. It costs nothing per step (an index updated with each token) and pays off
where the output repeats its input — rewriting, quoting, editing code, extracting fields — which
is where a model spends most tokens in agent and coding use.

How many to draft adapts to what the route accepts: after a verify that kept ``a`` drafts the
next proposes up to ``2 * (a + 1)`` (at least ``min_draft``, at most the configured ``k``), so
text that stops repeating costs a short verify chunk, not a long one.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SPECULATIVE_MODES", "PromptLookup"]

SPECULATIVE_MODES = ("off", "ngram")


class PromptLookup:
    """Prompt-lookup drafting for one generation. Not thread-safe: one per generation."""

    def __init__(self, k: int, *, max_ngram: int = 4, min_ngram: int = 2, min_draft: int = 2) -> None:
        if k < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs k >= 1 and 1 <= min_ngram <= max_ngram")
        self.k = k
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.min_draft = min(min_draft, k)
        self._budget = k
        self._tokens: list[int] = []
        # n-gram -> where its latest occurrence's continuation starts (an index into _tokens)
        self._after: dict[tuple[int, ...], int] = {}
        self.drafted = 0  # drafts proposed, and accepted by the route, over the generation
        self.accepted = 0

    def extend(self, tokens: Sequence[int]) -> None:
        """The text grew by ``tokens`` (the prompt first, then every token the route returns)."""
        seq = self._tokens
        for token in tokens:
            end = len(seq)
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self._after[tuple(seq[end - n : end])] = end  # that n-gram is followed by ``token``
            seq.append(int(token))

    def propose(self, limit: int) -> list[int]:
        """Up to ``min(limit, budget)`` drafted tokens to follow the text so far (none when nothing repeats)."""
        want = min(limit, self._budget)
        seq = self._tokens
        if want < 1:
            return []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(seq) <= n:
                continue
            start = self._after.get(tuple(seq[-n:]))
            if start is not None:
                return seq[start : start + want]
        return []

    def record(self, drafted: int, accepted: int) -> None:
        """The route kept ``accepted`` of ``drafted`` drafts: size the next draft by it."""
        self.drafted += drafted
        self.accepted += accepted
        self._budget = max(self.min_draft, min(self.k, 2 * (accepted + 1)))
