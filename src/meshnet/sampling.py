"""Token sampling over a logits vector: one pure implementation for every backend.

The single-node server and the tail node of a route sample with this same code, so a seeded
request gives the same tokens whichever way it is served. A seeded draw depends only on the seed
and the position of the token it picks (not on how many draws came before), so a route repair
that moves sampling to a new tail — a new ``Sampler`` — continues with exactly the tokens the old
tail would have drawn. ``logit_bias`` (OpenAI's: added to the logits of the named token ids, -100
bans a token, 100 all but forces it) is part of the parameters every tail receives, so it
survives a repair too.

Speculative decoding (``Sampler.verify``): the tail gets the logits of a drafted chunk and keeps
the longest prefix of the drafts the model agrees with, plus one token of its own. Every row draws
its token exactly as ``sample`` would at that position (the same seed, position and stream), and a
draft is kept when it is that token. For a deterministic drafter (the draft distribution puts all
mass on the drafted token) this *is* speculative sampling's rule: draft ``d`` is kept with
probability ``p(d)``, and on a rejection the token is distributed as ``p`` with ``d`` removed. It
also makes a seeded request's text the text without drafts, however the drafts were cut into
rounds (the gateway sizes them by measured costs, which differ from run to run): speculation
changes neither what the user samples from nor, seeded, what they get.

A draw can be checked by someone without the logits (``Draw``, ``check_draw``): ``sample_committed``
also returns the distribution the draw used — its first ``COMMITTED`` candidates, most likely first,
with their final probabilities (after bias, penalties, temperature, top-k and top-p), the total the
draw normalized their running sum by, and how many candidates there were. With the seed and the
position, the token follows from those numbers alone, exactly (float64 values written as JSON
read back as the same bits; numpy's ``Generator.choice`` is a ``searchsorted`` of one uniform in
the normalized running sum): a route's gateway re-derives the tail's draw (docs/security.md).

A grammar (``SamplingParams.grammar``, GBNF text; ``meshnet.backends.grammar``) restricts every choice to
the tokens it allows; the sampler asks it about the token it would pick and masks only when that one
is refused. Its state follows the generated tokens the caller reports (``set_history`` / ``advance``),
like the penalties.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "COMMITTED",
    "GREEDY_BELOW",
    "MAX_GRAMMAR_BYTES",
    "MAX_TOP_LOGPROBS",
    "Alternatives",
    "Committed",
    "Draw",
    "Sampler",
    "SamplingParams",
    "check_draw",
]

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
# A grammar travels in a header to every hop (docs/protocol.md); the nodes accept headers this large.
MAX_GRAMMAR_BYTES = 64 * 1024
# A temperature below this samples greedily: logits divided by ~1e-310 overflow to inf and the
# probabilities to NaN, and far above the overflow such a distribution is the argmax anyway (vLLM's eps).
GREEDY_BELOW = 1e-5

COMMITTED = 20  # the candidates a draw commits to
SORTED_HEAD = 256  # candidates a draw orders by probability; the rest follow in id order (Sampler._spread)
GRAMMAR_STREAM = 3  # the random stream of a draw the grammar constrained (``Sampler._constrained``)

Logits = npt.NDArray[np.float32]
Alternatives = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class Draw:
    """The distribution one token was drawn from, as far as it decides the token: the first
    candidates (most likely first) and their final probabilities, the total their running sum was
    normalized by, how many candidates there were, and the random stream used. A greedy choice
    commits its token first (``probs``: its softmax under the biased logits, for the record)."""

    ids: tuple[int, ...]
    probs: tuple[float, ...]
    total: float
    size: int
    stream: int = 0

    def __post_init__(self) -> None:
        n = len(self.ids)
        if not 1 <= n <= COMMITTED or len(self.probs) != n or self.size < n:
            raise ValueError(f"a draw commits 1 to {COMMITTED} candidates, each with a probability, of its {self.size}")
        if not all(0.0 <= p <= 1.0 for p in self.probs) or not 0.0 < self.total < 2.0:
            raise ValueError("a draw's probabilities lie within [0, 1] and its total near 1")
        if any(t < 0 for t in self.ids) or len(set(self.ids)) != n or self.stream not in (0, GRAMMAR_STREAM):
            raise ValueError("a draw names distinct token ids and stream 0 or 3")

    def to_json(self) -> dict[str, object]:
        return {"ids": list(self.ids), "probs": list(self.probs), "total": self.total, "size": self.size,
                "stream": self.stream}  # fmt: skip

    @classmethod
    def from_json(cls, raw: object) -> Draw:
        """Raises ``ValueError`` on anything but a draw ``to_json`` could have written."""
        if not isinstance(raw, dict):
            raise ValueError("a draw is an object")
        ids, probs, total, size, stream = (raw.get(k) for k in ("ids", "probs", "total", "size", "stream"))
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise ValueError('a draw\'s "ids" are token ids')
        if not (isinstance(probs, list) and all(isinstance(p, float) for p in probs) and isinstance(total, float)):
            raise ValueError('a draw\'s "probs" and "total" are numbers')
        if not (isinstance(size, int) and isinstance(stream, int)) or isinstance(size, bool):
            raise ValueError('a draw\'s "size" and "stream" are integers')
        return cls(tuple(ids), tuple(probs), total, size, stream)


def _drawn_index(running: npt.NDArray[np.float64], total: float, uniform: float) -> int:
    """Where ``uniform`` falls in the running sum of the probabilities (``running``, ``np.cumsum``)
    normalized by ``total``: numpy's ``Generator.choice`` with ``p`` (one uniform, ``searchsorted``
    on the right). The tail draws with it over every candidate, the gateway re-derives with it over
    the committed first ones: the same additions and divisions, so the same bits."""
    return int(np.searchsorted(running / total, uniform, side="right"))


def draw_rng(seed: int, position: int, stream: int = 0) -> np.random.Generator:
    """The generator of a seeded draw: a function of the seed, the position and what it is for."""
    return np.random.default_rng([seed, position] if stream == 0 else [seed, position, stream])


def check_draw(params: SamplingParams, draw: Draw | None, token: int, position: int) -> str | None:
    """Why ``token`` is not what ``draw`` gives at ``position`` under ``params`` (``None``: it is).
    A seeded draw is re-derived exactly; past the committed candidates it must name none of them."""
    if draw is None:
        return "it committed to no distribution"
    if draw.stream == GRAMMAR_STREAM and not params.grammar:
        return "it claims a grammar constrained the draw, and the request has none"
    if params.greedy:
        if draw.ids[0] != token:
            return f"greedy decoding gives its most likely token {draw.ids[0]}, not {token}"
        return None
    if params.seed is None:
        return None  # an unseeded draw cannot be re-derived; a gateway always seeds
    uniform = draw_rng(params.seed, position, draw.stream).random()
    index = _drawn_index(np.cumsum(np.array(draw.probs, dtype=np.float64)), draw.total, uniform)
    if index < len(draw.ids):
        if draw.ids[index] != token:
            return f"the seed draws candidate {index} (token {draw.ids[index]}) from its distribution, not {token}"
        return None
    if token in draw.ids or index >= draw.size:
        return f"the seed draws past its {len(draw.ids)} committed candidates, and token {token} is not there"
    return None


class TokenGrammar(Protocol):
    """What a sampler asks of a compiled grammar (``meshnet.backends.grammar.TokenGrammar`` is the one
    llama.cpp compiles): which tokens it allows after the ones accepted so far."""

    accepted_at: float  # time.monotonic() of the last token accepted

    def allows(self, token: int) -> bool: ...

    def mask(self, logits: Logits) -> Logits: ...

    def best(self, logits: Logits) -> int: ...

    def accept(self, token: int) -> None: ...

    def sync(self, history: Sequence[int]) -> None: ...

    def cancel(self) -> None:
        """Stop the check running on another thread (within one chunk of the vocabulary)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature`` 0 (or below ``GREEDY_BELOW``) means greedy (argmax, deterministic);
    ``top_k == 0`` disables top-k; ``logit_bias``: ``(token id, bias)`` pairs added to the logits before any choice;
    ``top_logprobs``: how many most likely tokens (and their logprobs) to report beside each choice;
    ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, within [-2, 2]): subtracted from the logit
    of every token already generated — once, and once per occurrence — before any choice;
    ``grammar``: GBNF text every generated token must follow ("" for none), compiled by whoever samples."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The position of the first generated token: a route's tail sees every position's token id
    # and counts those from here for the penalties (docs/protocol.md).
    generated_from: int = 0
    grammar: str = ""

    def __post_init__(self) -> None:
        # JSON gives lists: keep an immutable, hashable, validated form
        try:
            bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must be (token id, bias) pairs, got {self.logit_bias!r}") from None
        object.__setattr__(self, "logit_bias", bias)
        for token, value in bias:
            if token < 0 or not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias needs token ids >= 0 and biases within [-100, 100], got {token}: {value}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be within [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            limit = MAX_TOP_LOGPROBS
            raise ValueError(f"top_logprobs must be an integer within [0, {limit}], got {self.top_logprobs!r}")
        if not isinstance(self.generated_from, int) or self.generated_from < 0:
            raise ValueError(f"generated_from must be a position (>= 0), got {self.generated_from!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be within [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.grammar, str):
            raise ValueError(f"grammar must be GBNF text, got {type(self.grammar).__name__}")
        if len(self.grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"grammar is longer than {MAX_GRAMMAR_BYTES} bytes")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether choices depend on the tokens generated so far (their counts: ``Sampler.generated``)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_history(self) -> bool:
        """Whether the sampler must know the tokens generated so far (penalties, grammar state): on a
        route, the token ids then travel to the tail."""
        return self.penalized or bool(self.grammar)


@dataclass(frozen=True, slots=True)
class Committed:
    """A token chosen, and how to get its logprob and ``Draw`` (``Sampler.choose_committed``)."""

    token: int
    finish: Callable[[], tuple[float, Draw]]


class Sampler:
    """Draws tokens for one generation. Not thread-safe: one sampler per generation."""

    def __init__(self, params: SamplingParams, grammar: TokenGrammar | None = None) -> None:
        if bool(params.grammar) != (grammar is not None):
            raise ValueError("a sampler needs its parameters' grammar compiled (and only then a grammar)")
        self.params = params
        self.grammar = grammar
        self._rng = np.random.default_rng(params.seed)
        # How often each generated token occurs, for the penalties: the caller reports the tokens
        # (``set_history`` / ``advance``), since only it knows which were kept.
        self.generated: collections.Counter[int] = collections.Counter()

    def set_history(self, tokens: Sequence[int]) -> None:
        """The tokens generated so far (all of them, in order): the penalties and the grammar follow them."""
        self.generated = collections.Counter(tokens)
        if self.grammar is not None:
            self.grammar.sync(tokens)

    def advance(self, token: int) -> None:
        """One more generated token (the one just sampled, kept)."""
        self.generated[token] += 1
        if self.grammar is not None:
            self.grammar.accept(token)

    def sample(self, logits: Logits, position: int | None = None) -> tuple[int, float]:
        """Return ``(token_id, logprob)`` for the token at ``position``; the logprob is the model's (before
        temperature). A seeded draw at a known position is a function of the seed and the position alone."""
        token = self._pick(self._biased(logits, self.generated), position)
        return token, _logprob(logits, token)

    def sample_committed(self, logits: Logits, position: int | None = None) -> tuple[int, float, Draw]:
        """``sample``, with the distribution the token was drawn from (``Draw``): the same token."""
        committed = self.choose_committed(logits, position)
        return committed.token, *committed.finish()

    def choose_committed(self, logits: Logits, position: int | None = None) -> Committed:
        """``sample_committed`` in two parts: the token now, its logprob and ``Draw`` when asked
        (``Committed.finish``; the same bits). A greedy choice without a grammar is an argmax, and
        its commitment (the most likely others, the log-normalizer) can wait: a route's tail sends
        the next step on with the token before it works them out."""
        biased = self._biased(logits, self.generated)
        if self.params.greedy and self.grammar is None:
            token = int(np.argmax(biased))

            def commitment() -> tuple[float, Draw]:
                log_z = _log_z(logits)
                draw = _greedy_draw(biased, token, 0, log_z if biased is logits else None)
                return float(logits[token]) - log_z, draw

            return Committed(token, commitment)
        log_z = _log_z(logits)
        token, draw = self._draw(biased, position, log_z=log_z if biased is logits else None)
        if self.grammar is not None and not self.grammar.allows(token):
            token, draw = self._constrained(biased, position)
        logprob = float(logits[token]) - log_z
        return Committed(token, lambda: (logprob, draw))

    def alternatives(self, logits: Logits) -> Alternatives:
        """The ``top_logprobs`` most likely tokens under the model (before bias and temperature, like
        the logprob of the choice), most likely first; ``()`` when none were asked for."""
        n = self.params.top_logprobs
        if not n:
            return ()
        n = min(n, logits.shape[0])
        work = _SCRATCH.arrays(logits.shape[0])
        best = _at_least_kth(logits, n, work.marks, work.floats)
        best = best[np.lexsort((best, -logits[best].astype(np.float64)))][:n]  # ties: the lower id first
        log_z = _log_z(logits)
        return tuple((int(t), float(logits[t]) - log_z) for t in best)

    def verify(self, logits: Logits, drafts: Sequence[int], position: int) -> tuple[list[int], list[float]]:
        """Check ``drafts`` (proposed tokens for positions ``position``, ``position + 1``, ...) against
        ``logits`` (row ``i``: the distribution of the token at ``position + i``; one row more than
        drafts). Returns the kept drafts followed by one token the model chose, with their logprobs."""
        if logits.ndim != 2 or logits.shape[0] != len(drafts) + 1:
            want = len(drafts) + 1
            raise ValueError(f"verifying {len(drafts)} drafts needs {want} rows of logits, got {logits.shape}")
        tokens: list[int] = []
        counts = collections.Counter(self.generated)  # each row sees the drafts kept before it
        for i, row in enumerate(logits):
            draft = drafts[i] if i < len(drafts) else None
            token = self._pick(self._biased(row, counts), position + i)
            tokens.append(token)
            counts[token] += 1
            if self.grammar is not None:
                self.grammar.accept(token)  # the next row is checked after it
            if token != draft:
                break
        return tokens, [_logprob(logits[i], t) for i, t in enumerate(tokens)]

    def _pick(self, biased: Logits, position: int | None) -> int:
        """The token at ``position`` from the biased logits: the draw (stream 0), or the grammar's
        choice where it refuses that one."""
        token = self._choose(biased, position)
        if self.grammar is not None and not self.grammar.allows(token):
            token = self._constrained(biased, position)[0]
        return token

    def _rng_for(self, position: int | None, stream: int = 0) -> np.random.Generator:
        """A seeded draw is a function of the seed, the position and what it is for (``stream``)."""
        p = self.params
        if p.seed is None or position is None:
            return self._rng
        return draw_rng(p.seed, position, stream)

    def _biased(self, logits: Logits, counts: collections.Counter[int]) -> Logits:
        """``logits`` with the logit bias added and the penalties for the ``counts`` of generated tokens taken off."""
        p = self.params
        penalize = p.penalized and counts
        if not p.logit_bias and not penalize:
            return logits
        biased = logits.copy()
        for token, value in p.logit_bias:
            if token >= biased.shape[0]:
                raise ValueError(f"logit_bias names token {token}, outside the vocabulary of {biased.shape[0]}")
            biased[token] += np.float32(value)
        if penalize:
            ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
            n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
            keep = ids < biased.shape[0]
            biased[ids[keep]] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * n[keep]
        return biased

    def _choose(self, logits: Logits, position: int | None, stream: int = 0) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        return self._spread(logits).draw(self._rng_for(position, stream).random())[0]

    def _draw(
        self, logits: Logits, position: int | None, stream: int = 0, *, log_z: float | None = None
    ) -> tuple[int, Draw]:
        """``_choose`` and what it drew from: one uniform, searched in the running sum of the
        probabilities normalized by its last value (``_Spread.draw``). ``log_z``: that of ``logits``,
        if the caller has it."""
        if self.params.greedy:
            token = int(np.argmax(logits))
            return token, _greedy_draw(logits, token, stream, log_z)
        spread = self._spread(logits)
        token, total = spread.draw(self._rng_for(position, stream).random())
        n = min(COMMITTED, spread.head_ids.shape[0])
        draw = Draw(tuple(spread.head_ids[:n].tolist()), tuple(spread.head_probs[:n].tolist()), total, spread.size,
                    stream)  # fmt: skip
        return token, draw

    def _constrained(self, logits: Logits, position: int | None) -> tuple[int, Draw]:
        """The choice when the grammar refused the unconstrained one: the most likely allowed token,
        or a fresh draw (its own stream) from the distribution restricted to the allowed tokens."""
        assert self.grammar is not None
        if self.params.greedy:  # committed alone: the others would need the grammar's verdict on every token
            token = self.grammar.best(logits)
            prob = min(1.0, float(np.exp(np.float64(logits[token]) - _log_z(logits))))
            return token, Draw((token,), (prob,), 1.0, int(logits.shape[0]), GRAMMAR_STREAM)
        return self._draw(self.grammar.mask(logits), position, stream=GRAMMAR_STREAM)

    def _spread(self, logits: Logits) -> _Spread:
        """The distribution a sampled draw is from, after temperature, top-k and top-p, in draw order:
        the most likely ``SORTED_HEAD`` candidates first, sorted (ties: the lower id first; every
        candidate tied with the last of them joins it), then the rest in id order. A draw is from
        the same distribution in any fixed order, and sorting a 150K vocabulary at every step took
        17 ms. Top-p keeps the smallest sorted prefix that reaches its mass, sorting a head 8 times
        as large (and so on, up to everything) only when the head holds less.

        Everything is computed where it lies, in id order and in this thread's scratch arrays
        (``_SCRATCH``): the probabilities once, the head taken from them, the rest left in place
        with the head's entries zeroed (a zero adds nothing to a running sum, so the draw's sums
        are those of the compact layout, to the bit). Laying the vocabulary out in draw order, and
        the fresh pages of every new vocabulary-sized array, cost 3.6 ms of a 150K vocabulary's
        sampling at every step; this way, about 1.3 ms."""
        p = self.params
        if 0 < p.top_k < logits.shape[0]:
            ids: npt.NDArray[np.int64] | None = np.sort(np.argpartition(logits, -p.top_k)[-p.top_k :])  # id order
            size = p.top_k
        else:
            ids, size = None, logits.shape[0]
        scratch = _SCRATCH.arrays(size)
        values, probs = scratch.values, scratch.probs
        np.divide(logits if ids is None else logits[ids], p.temperature, out=values, dtype=np.float64)
        at = _sorted_head(values, min(SORTED_HEAD, size), scratch)
        np.subtract(values, values[at[0]], out=probs)
        np.exp(probs, out=probs)
        probs /= probs.sum()
        head_probs = probs[at]
        if p.top_p < 1.0:
            head, running = at.shape[0], np.cumsum(head_probs)
            while running[-1] < p.top_p and head < size:  # past the head: a larger one
                head = min(head * 8, size)
                at = _sorted_head(values, head, scratch)
                head_probs = probs[at]
                running = np.cumsum(head_probs)
            cut = int(np.searchsorted(running, p.top_p)) + 1
            kept = head_probs[:cut]
            return _Spread(_ids_at(ids, at[:cut]), kept / kept.sum(), None, None, cut)
        if at.shape[0] == size:
            return _Spread(_ids_at(ids, at), head_probs, None, None, size)
        probs[at] = 0.0
        return _Spread(_ids_at(ids, at), head_probs, probs, ids, size, scratch.running)


@dataclass(slots=True)
class _Work:
    """One draw's scratch arrays (views of this thread's ``_Scratch``), each as long as the candidates."""

    values: npt.NDArray[np.float64]
    probs: npt.NDArray[np.float64]
    running: npt.NDArray[np.float64]
    sorting: npt.NDArray[np.float64]
    marks: npt.NDArray[np.bool_]
    floats: npt.NDArray[np.float32]


class _Scratch(threading.local):
    """Vocabulary-sized arrays a sampled draw works in, one set per thread (a draw never awaits, so
    one thread's draws never overlap): a fresh array of that size is fresh pages, each a fault."""

    def __init__(self) -> None:
        self.size = 0
        self.whole = _work(0)

    def arrays(self, n: int) -> _Work:
        if n > self.size:
            self.whole = _work(n)
            self.size = n
        w = self.whole
        return _Work(w.values[:n], w.probs[:n], w.running[:n], w.sorting[:n], w.marks[:n], w.floats[:n])


def _work(n: int) -> _Work:
    return _Work(np.empty(n), np.empty(n), np.empty(n), np.empty(n), np.empty(n, dtype=bool),
                 np.empty(n, dtype=np.float32))  # fmt: skip


_SCRATCH = _Scratch()


@dataclass(frozen=True, slots=True)
class _Spread:
    """A sampled draw's candidates: the sorted head (``head_ids``, ``head_probs``) and, unless top-p
    cut within it, every candidate's probability in id order with the head's zeroed (``rest_probs``;
    their ids ``ids``, ascending, ``None`` for the whole vocabulary); ``size``: how many candidates
    in all; ``running``: scratch for the draw's running sum."""

    head_ids: npt.NDArray[np.int64]
    head_probs: npt.NDArray[np.float64]
    rest_probs: npt.NDArray[np.float64] | None
    ids: npt.NDArray[np.int64] | None
    size: int
    running: npt.NDArray[np.float64] | None = None

    def draw(self, uniform: float) -> tuple[int, float]:
        """The token ``uniform`` picks, and the total: ``_drawn_index`` over the running sum of the
        probabilities in draw order, the head's and then the rest's, added one after another."""
        head_run = np.cumsum(self.head_probs)
        if self.rest_probs is None:
            total = float(head_run[-1])
            return int(self.head_ids[_drawn_index(head_run, total, uniform)]), total
        assert self.running is not None
        rest, first = self.rest_probs, float(self.rest_probs[0])
        rest[0] = head_run[-1] + first  # the running sum goes on from the head's (its first addition)
        running = np.cumsum(rest, out=self.running)
        rest[0] = first
        total = float(running[-1])
        head_norm = head_run / total
        if head_norm[-1] > uniform:
            return int(self.head_ids[int(np.searchsorted(head_norm, uniform, side="right"))]), total
        running /= total
        index = int(np.searchsorted(running, uniform, side="right"))  # never a zeroed entry: it adds nothing
        return (index if self.ids is None else int(self.ids[index])), total


def _ids_at(ids: npt.NDArray[np.int64] | None, at: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    return at if ids is None else ids[at]


def _sorted_head(values: npt.NDArray[np.float64], k: int, scratch: _Work) -> npt.NDArray[np.int64]:
    """Where the ``k`` largest ``values`` lie, and every value tied with the least of them, the
    largest first (ties: the lower index first)."""
    n = values.shape[0]
    at = _at_least_kth(values, k, scratch.marks, scratch.sorting) if k < n else np.arange(n)
    return at[np.lexsort((at, -values[at]))]


_SAMPLED = 1024  # values sampled to find the k-th largest's neighbourhood (at least 8k)


def _at_least_kth(
    values: npt.NDArray[np.floating], k: int, marks: npt.NDArray[np.bool_], sorting: npt.NDArray[np.floating]
) -> npt.NDArray[np.int64]:
    """Where every value at least the ``k``-th largest lies (ties with it included), in index order.

    The ``k``-th largest of an evenly strided sample is a bound: ``k`` values are at least it, so the
    ``k`` largest are among the values at least it, about ``k`` x the stride of them, and only those
    are partitioned (a 50K vocabulary, k = 20: ~30 µs against ~250 for partitioning everything). Too
    small a vocabulary for a sample, or a NaN among the values (which partitioning counts as the
    largest), partitions everything (in ``sorting``: no vocabulary-sized allocation)."""
    n = values.shape[0]
    stride = n // max(_SAMPLED, 8 * k)
    if stride >= 2 and not np.isnan(values.max()):
        sample = values[::stride]
        bound = np.partition(sample, sample.shape[0] - k)[sample.shape[0] - k]
        near = np.flatnonzero(np.greater_equal(values, bound, out=marks))
        if near.shape[0] >= k:
            inside = values[near]
            edge = np.partition(inside, near.shape[0] - k)[near.shape[0] - k]
            kept: npt.NDArray[np.int64] = near[inside >= edge]
            return kept
    if sorting.dtype == values.dtype:
        sorting[:] = values
    else:
        sorting = values.copy()
    sorting.partition(n - k)
    return np.flatnonzero(np.greater_equal(values, sorting[n - k], out=marks))


def _greedy_draw(logits: Logits, token: int, stream: int, log_z: float | None = None) -> Draw:
    """A greedy choice's commitment: ``token`` first, then the most likely others (ties: lower id
    first, as ``argmax``), with their probabilities under ``logits`` at temperature 1."""
    size = logits.shape[0]
    n = min(COMMITTED, size)
    work = _SCRATCH.arrays(size)
    best = _at_least_kth(logits, n, work.marks, work.floats)  # ties at the edge too
    best = best[np.lexsort((best, -logits[best].astype(np.float64)))]
    ids = [token, *(int(t) for t in best if int(t) != token)][:n]
    log_z = _log_z(logits) if log_z is None else log_z
    probs = tuple(np.clip(np.exp(logits[ids].astype(np.float64) - log_z), 0.0, 1.0).tolist())
    return Draw(tuple(ids), probs, 1.0, int(size), stream)


def _logprob(logits: Logits, token: int) -> float:
    return float(logits[token]) - _log_z(logits)


def _log_z(logits: Logits) -> float:
    # float32 keeps this ~30 µs for a 50K vocabulary: it runs on every decode step (in this
    # thread's scratch: a fresh vocabulary-sized array is fresh pages, each a fault).
    top = float(np.max(logits))
    floats = _SCRATCH.arrays(logits.shape[0]).floats
    np.subtract(logits, np.float32(top), out=floats)
    np.exp(floats, out=floats)
    return top + float(np.log(np.sum(floats, dtype=np.float64)))
