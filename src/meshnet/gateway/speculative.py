"""Drafting for speculative decoding through a route: prompt lookup (n-gram) at the gateway.

Over real links a route's time per token is mostly the walk through its hops. The gateway
guesses the next few tokens, sends them with the step as one *verify chunk*, and the tail keeps
the longest prefix the model agrees with plus one token of its own (``Sampler.verify``): one walk
through the route yields up to ``k + 1`` tokens. Every hop drops the rejected positions before
the answer passes it, so its KV is what plain decoding would have left (docs/protocol.md).

Two drafters (``--speculative ngram|draft``):

- prompt lookup (``PromptLookup``): find the longest recent n-gram (``max_ngram`` down to
  ``min_ngram`` tokens) that ends the text so far and occurred before, and propose what followed
  its latest occurrence. It costs nothing per step (an index updated with each token) and pays off
  where the output repeats its input — rewriting, quoting, editing code, extracting fields — which
  is where a model spends most tokens in agent and coding use;
- a draft model (``ModelDraft`` over ``backends.llama_draft.DraftModel``): a small GGUF of the same
  vocabulary, run at the gateway, continues the text greedily. It costs a small model's steps per
  draft and pays off wherever the small model agrees with the large one, repeated text or not.

How many to draft is decided by what a walk costs, what a draft costs and what gets accepted,
because a verify chunk is not free: every drafted position is computed on every hop (on a CPU, 2
positions in one call cost more than two steps), and a draft model's tokens are computed at the
gateway before the chunk goes (``DraftCost``: a Qwen2.5-Coder 0.5B drafting for its 1.5B took
36 ms a token on one core here, the 1.5B 50: drafting 8 tokens before every round made a route 2-3x
slower than none). ``WalkCosts`` keeps, per route, what a walk costs by the number of
positions it carries — the hops' compute of that many positions plus what the links add — and
the drafter keeps the generation's acceptance rate ``q`` (a draft is kept with probability ``q``,
independently: a chunk of ``d`` drafts yields ``(1 - q^(d+1)) / (1 - q)`` tokens on average).
Each step takes the draft length — none included — with the most tokens per second, and a draft
model computes only the drafts so chosen (none where none pay: the route then decodes as without
speculation, the tail relaying its steps).

Every estimate is the median of the latest measurements, and a size never measured is assumed to
cost what the measured sizes suggest (linear between the nearest ones, on the line through the two
largest beyond them). A route that has not yet carried a plain step is sent one; one that has
carried no chunk gets a short probe (``PROBE_DRAFTS``), as does one where drafting has not paid for
a while (after 16 declined drafts, then 32, ... up to 512). So drafting is tried, measured and
kept only where it pays: on a WAN nearly always, on loopback only for text that repeats. Never a
whole chunk on trust: on a CPU a first 12-draft chunk costs a dozen steps, which a short
generation never wins back (measured: speculation at 0.80 of none on a real 1.5B model when every
generation verified its first match in full).

Pipelined speculation (the route engine's ``_chain``): more rounds go out before the verdict on the
one in flight, each continuing the drafts as if all were kept (``Drafter.continuation``), while
``WalkCosts.chain_pays`` says one more pays: the chance that everything before it is kept, by the
same acceptance estimate, against what it saves (a walk less one hop's share of the compute)
and what it wastes when void (that share).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

__all__ = [
    "PROBE_DRAFTS",
    "SPECULATIVE_MODES",
    "DraftCost",
    "DraftSource",
    "Drafter",
    "ModelDraft",
    "PromptLookup",
    "WalkCosts",
]

_log = logging.getLogger(__name__)

SPECULATIVE_MODES = ("off", "ngram", "draft")
# An estimate is the median of the latest measurements: times on a busy machine come with rare long
# outliers (another process's burst), and one of them must not decide for a whole route.
_WINDOW = 5
# The acceptance estimate: kept drafts and rejections, fading by this factor per generated token
# (text changes character: a run of rejections 50 tokens ago says little now), on top of an
# optimistic prior of 2 kept drafts to 0.5 rejection (q = 0.8 with no evidence). A prior of half that
# weight of evidence learns both ways in half the drafts: 4 to 1 took five rejected chunks to stop
# prompt lookup drafting on code text it never got right (a real 1.5B over 3 x 20 ms: 0 of 11 kept,
# 0.89 of off), where 2 to 0.5 stopped before a measured round (0 of 0); and copy-heavy text ramps up
# to long chunks sooner (3 x 20 ms: 12.0 against 13.3 ms a token).
_FADE = 0.97
_PRIOR_KEPT, _PRIOR_REJECTED = 2.0, 0.5
# The drafts of a route's first verify chunk: enough to measure what a chunk costs beyond a step.
PROBE_DRAFTS = 2
# A draft model drafting round after round reads at most this many new tokens per call (the last draft
# and the route's own token after a chunk kept whole); a call that reads more is not timed as drafts.
_STEADY_BEHIND = 2
# While drafting does not pay on a route, a probe re-measures it after this many declined drafts,
# then twice as many, up to the most (a chunk measured in a bad moment is not trusted forever).
_REPROBE_FIRST, _REPROBE_MOST = 16, 512


class WalkCosts:
    """What one walk through a route costs by the positions it carries (thread-safe: the generations
    of one route share it): the hops' own compute of that many positions, measured from every round
    (the answer's ``compute_ms``, summed over the hops), plus what the links and the hops' handling
    add to a walk (a round's walk time less its compute), measured from rounds that went alone (a
    pipelined round's walk includes its wait behind the one before it)."""

    def __init__(self) -> None:
        self._compute: dict[int, deque[float]] = {}
        self._network: deque[float] = deque(maxlen=_WINDOW)
        self._declined, self._reprobe = 0, _REPROBE_FIRST
        self._probe_due = False  # a re-probe was decided and no chunk has been measured since
        self._lock = threading.Lock()

    def observe(self, positions: int, compute: float, walk: float | None = None) -> None:
        """A round of ``positions`` cost the hops ``compute`` seconds in all; ``walk``: it went alone
        and took that long, from the send to the answer."""
        with self._lock:
            self._compute.setdefault(positions, deque(maxlen=_WINDOW)).append(compute)
            self._probe_due = self._probe_due and positions == 1
            if walk is not None:
                self._network.append(max(walk - compute, 0.0))

    def estimate(self, positions: int) -> float | None:
        """A walk of ``positions`` alone: what the links add plus the hops' compute (``compute``)."""
        return _walk(*self._medians(), positions)

    def compute(self, positions: int) -> float | None:
        """The hops' compute of ``positions``: the median of the latest such rounds, else as the
        measured sizes suggest (``_interpolate``)."""
        return _interpolate(self._medians()[1], positions)

    def _medians(self) -> tuple[float | None, dict[int, float]]:
        """What the links add (``None``: nothing measured) and the compute by size, each the median
        of its latest measurements: taken once per decision, which weighs many sizes."""
        with self._lock:
            network = statistics.median(self._network) if self._network else None
            return network, {n: statistics.median(v) for n, v in self._compute.items()}

    def chain_pays(self, positions: int, kept: float, hops: int, *, draft_s: float = 0.0) -> bool:
        """Whether to send a round of ``positions`` through ``hops`` hops before the verdict on the
        rounds in flight, when all of those (and its own guess) are kept with probability ``kept``;
        ``draft_s``: what each of its tokens costs the gateway to make (a draft model's).

        Rounds in flight move through the hops one behind the other, each hop on its own, so a
        round sent early arrives one hop's compute after the one before it instead of a whole walk
        later: it saves a walk less one hop's share of the compute when it is of use, and costs
        that share when it is void (the next round waits behind it at each hop; the tail does not
        compute it at all). Making its tokens delays it by that long, and the gateway by as much
        (it takes no answer meanwhile): less saved, more wasted. Nothing measured yet: no (a
        synchronous round measures first)."""
        network, known = self._medians()
        walk, compute = _walk(network, known, positions), _interpolate(known, positions)
        if walk is None or compute is None or hops < 1:
            return False
        share, make = compute / hops, positions * draft_s
        return kept * max(walk - share - make, 0.0) > (1.0 - kept) * (share + make)

    def best_drafts(self, available: int, q: float, *, explore: bool = False, draft_s: float = 0.0) -> int:
        """How many of ``available`` drafts to send, each kept with probability ``q`` and costing
        ``draft_s`` seconds to make before the chunk goes (a draft model's; prompt lookup's cost
        nothing): the most expected tokens per second, 0 (a plain step) included. A route with no
        plain step measured gets one; one with no chunk measured, a probe of ``PROBE_DRAFTS``.
        ``explore``: a decision for a step about to go, which also re-probes a route where drafting
        has not paid for a while (the probe stays due until a chunk is measured)."""
        network, known = self._medians()
        if network is None or 1 not in known:
            return 0
        if max(known) == 1:
            return min(available, PROBE_DRAFTS)
        best, best_rate = 0, 1.0 / (network + known[1])
        for d in range(1, available + 1):
            seconds = _walk(network, known, d + 1)
            assert seconds is not None
            seconds += d * draft_s
            tokens = float(d + 1) if q >= 1.0 else (1.0 - q ** (d + 1)) / (1.0 - q)
            if seconds > 0 and tokens / seconds > best_rate:
                best, best_rate = d, tokens / seconds
        if explore and available:
            with self._lock:
                if best:
                    self._declined, self._reprobe, self._probe_due = 0, _REPROBE_FIRST, False
                elif self._probe_due:
                    return min(available, PROBE_DRAFTS)
                else:
                    self._declined += 1
                    if self._declined >= self._reprobe:
                        self._declined, self._reprobe = 0, min(2 * self._reprobe, _REPROBE_MOST)
                        self._probe_due = True
                        return min(available, PROBE_DRAFTS)
        return best


class DraftCost:
    """What a draft model's drafts cost the gateway, per draft token (thread-safe: every generation of
    a gateway drafts with its one model): the median of the latest draft calls' seconds ÷ the drafts
    they made, which includes evaluating the tokens the route kept since the call before — as when
    drafting round after round (``ModelDraft`` times no call that first reads more of the text: a
    probe after a while without drafts would make drafting look dearer than it is, and then it would
    not draft again to find out)."""

    def __init__(self) -> None:
        self._per_draft: deque[float] = deque(maxlen=_WINDOW)
        self._lock = threading.Lock()

    def observe(self, seconds: float, drafts: int) -> None:
        if drafts > 0:
            with self._lock:
                self._per_draft.append(seconds / drafts)

    @property
    def per_draft(self) -> float:
        """Seconds a draft token costs (0 before any draft was made: the first probe measures it)."""
        with self._lock:
            return statistics.median(self._per_draft) if self._per_draft else 0.0


class Drafter:
    """What every drafter shares: the text so far, the acceptance estimate, and the choice of how
    many of its candidates to send (``propose``). Not thread-safe: one per generation."""

    def __init__(self, k: int, costs: WalkCosts | None = None, *, minimum: int = 0) -> None:
        if k < 1 or not 0 <= minimum <= k:
            raise ValueError("a drafter needs k >= 1 and 0 <= minimum <= k")
        self.k = k
        self.minimum = minimum  # drafts sent whenever there are that many, paying or not (--draft-min)
        self.costs = costs if costs is not None else WalkCosts()
        self._tokens: list[int] = []
        self.drafted = 0  # drafts proposed, and accepted by the route, over the generation
        self.accepted = 0
        self._kept = 0.0  # kept drafts and rejections, fading with every token (_FADE)
        self._rejected = 0.0

    def extend(self, tokens: Sequence[int]) -> None:
        """The text grew by ``tokens`` (the prompt first, then every token the route returns)."""
        for token in tokens:
            self._kept *= _FADE
            self._rejected *= _FADE
            self._tokens.append(int(token))

    @property
    def seen(self) -> int:
        """How many tokens of the text it was told (``extend``)."""
        return len(self._tokens)

    def forget(self, length: int) -> None:
        """The text is its first ``length`` tokens again (what it was told after them did not stand)."""
        del self._tokens[length:]

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft is kept: recent kept drafts against recent rejections."""
        kept, rejected = self._kept + _PRIOR_KEPT, self._rejected + _PRIOR_REJECTED
        return kept / (kept + rejected)

    def candidates(self, limit: int) -> list[int]:
        """Up to ``min(limit, k)`` tokens that may come next."""
        return self.continuation(self._tokens, min(limit, self.k))

    def continuation(self, text: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that may follow ``text``: the text so far, then the drafts of the
        rounds in flight (pipelined speculation), taken as kept."""
        raise NotImplementedError

    def propose(self, limit: int) -> list[int]:
        """The drafts worth sending now: the candidates, cut to the length that the route's walk
        costs and the acceptance so far make the fastest (possibly none)."""
        found = self.candidates(limit)
        return found[: self.paying(len(found), explore=True)] if found else found

    def would_draft(self, limit: int, *, explore: bool = False) -> bool:
        """Whether the next step would carry drafts (``propose``), without making them; ``explore``:
        a decision for a step about to go (``WalkCosts.best_drafts``)."""
        found = self.candidates(limit)
        return bool(found) and self.paying(len(found), explore=explore) > 0

    def chained(self, text: Sequence[int], limit: int) -> list[int]:
        """A pipelined round after ``text`` (the text so far and the rounds in flight): its guess and
        the drafts after it that pay, at most ``limit`` tokens in all."""
        chunk = self.continuation(text, limit)
        return chunk[: 1 + self.paying(len(chunk) - 1)] if chunk else chunk

    @property
    def draft_s(self) -> float:
        """What a draft costs to make before its chunk goes (prompt lookup's: nothing)."""
        return 0.0

    def paying(self, available: int, *, explore: bool = False) -> int:
        """How many of ``available`` drafts to send: as many as pay on the route (``WalkCosts.best_drafts``),
        and at least ``minimum``."""
        paying = self.costs.best_drafts(available, self.acceptance, explore=explore, draft_s=self.draft_s)
        return max(paying, min(available, self.minimum))

    def record(self, drafted: int, accepted: int) -> None:
        """The route kept ``accepted`` of ``drafted`` drafts."""
        self.drafted += drafted
        self.accepted += accepted
        self._kept += accepted
        self._rejected += accepted < drafted  # at most one rejection per chunk: it ends the chunk


class PromptLookup(Drafter):
    """Prompt-lookup drafting for one generation."""

    def __init__(
        self, k: int, costs: WalkCosts | None = None, *, minimum: int = 0, max_ngram: int = 4, min_ngram: int = 3
    ) -> None:
        if k < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs k >= 1 and 1 <= min_ngram <= max_ngram")
        super().__init__(k, costs, minimum=minimum)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # n-gram -> where its latest occurrence's continuation starts (an index into _tokens)
        self._after: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        seq = self._tokens
        for token in tokens:
            end = len(seq)
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self._after[tuple(seq[end - n : end])] = end  # that n-gram is followed by ``token``
            super().extend([token])

    def continuation(self, text: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest occurrence in the text so far of the longest
        n-gram ending ``text`` (which starts with the text so far); none when nothing repeats."""
        if limit < 1:
            return []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(text) <= n:
                continue
            start = self._after.get(tuple(text[-n:]))
            if start is not None:
                return list(text[start : start + limit])
        return []


class DraftSource(Protocol):
    def draft(self, tokens: Sequence[int], k: int) -> list[int]: ...


class ModelDraft(Drafter):
    """Draft-model drafting for one generation: the model's greedy continuation of the text so far.
    Its drafts cost the gateway the model's compute (``spent``, shared by a gateway's generations), so
    it decides how many pay before it makes them, and makes only those.

    Before it can draft, the model must have read the text: the prompt, and whatever the route wrote
    while no draft paid (a Qwen2.5-Coder 0.5B reads about 60 tokens a second on one core here). That
    catch-up runs on a thread of its own while the route decodes plain steps, once drafts would go
    and the model is more than a chunk's worth (``k + 1`` tokens) behind: a generation's first token
    never waits for it, and a re-probe of a route where drafting did not pay costs a chunk, not a
    second of reading. With a ``minimum`` (drafts whether or not they pay: ``--draft-min``) the step
    waits for the model to read instead: on a loaded CPU a read ahead can fall behind the route for
    a whole generation (the route writes tokens faster than a model on one core reads them)."""

    def __init__(
        self,
        model: DraftSource,
        k: int,
        costs: WalkCosts | None = None,
        *,
        minimum: int = 0,
        spent: DraftCost | None = None,
    ) -> None:
        super().__init__(k, costs, minimum=minimum)
        self.model = model
        self.spent = spent if spent is not None else DraftCost()
        self._held = 0  # how much of the text the model has read, as far as this generation knows
        self._catching_up: threading.Thread | None = None

    @property
    def draft_s(self) -> float:
        return self.spent.per_draft

    def forget(self, length: int) -> None:
        super().forget(length)
        self._held = min(self._held, length)

    def propose(self, limit: int) -> list[int]:
        n = self.paying(min(limit, self.k), explore=True) if self._tokens else 0
        return self.continuation(self._tokens, n)

    def would_draft(self, limit: int, *, explore: bool = False) -> bool:
        return bool(self._tokens) and self.paying(min(limit, self.k), explore=explore) > 0

    def chained(self, text: Sequence[int], limit: int) -> list[int]:
        return self.continuation(text, 1 + self.paying(limit - 1)) if limit >= 1 and self._caught_up() else []

    def paying(self, available: int, *, explore: bool = False) -> int:
        """As for any drafter, but none while the model is still reading the text (``_caught_up``)."""
        n = super().paying(available, explore=explore)
        return n if n == 0 or self._caught_up() else 0

    def continuation(self, text: Sequence[int], limit: int) -> list[int]:
        if limit < 1 or not text:
            return []
        behind = len(text) - self._held
        began = time.perf_counter()
        drafts = self.model.draft(text, limit)
        if behind <= _STEADY_BEHIND:  # a call that also read more of the text says little of what a draft costs
            self.spent.observe(time.perf_counter() - began, len(drafts))
        self._held = max(self._held, len(text) + len(drafts) - 1)  # it read the drafts but the last
        return drafts

    def _caught_up(self) -> bool:
        """Whether the model has read (nearly) all of the text; if not, it starts reading it on a thread."""
        if self._catching_up is not None:
            if self._catching_up.is_alive():
                return False
            self._catching_up = None
        if self.minimum or len(self._tokens) - self._held <= self.k + 1:  # read with the next draft
            return True
        text = list(self._tokens)
        self._catching_up = threading.Thread(target=self._read, args=(text,), name="meshnet-draft-read", daemon=True)
        self._catching_up.start()
        return False

    def _read(self, text: list[int]) -> None:
        try:
            self.model.draft(text, 1)  # reads the text (and drafts one token, dropped)
        except Exception as exc:  # the next draft reads it again, and fails where the caller sees it
            _log.warning("the draft model could not read the text ahead of drafting: %s", exc)
            return
        self._held = max(self._held, len(text))


def _walk(network: float | None, known: dict[int, float], positions: int) -> float | None:
    """A walk of ``positions`` alone, from the medians (``WalkCosts._medians``)."""
    compute = _interpolate(known, positions)
    return None if compute is None or network is None else network + compute


def _interpolate(known: dict[int, float], positions: int) -> float | None:
    """The measured value, else linear between the nearest measured sizes; past the largest, on the
    line through the two largest (never falling: noise can make a larger size look cheaper); below
    the smallest, the smallest's value."""
    if positions in known:
        return known[positions]
    below = sorted(n for n in known if n < positions)
    above = [n for n in known if n > positions]
    if below and above:
        a, b = below[-1], min(above)
        return known[a] + (known[b] - known[a]) * (positions - a) / (b - a)
    if above:
        return known[min(above)]
    if len(below) >= 2:
        a, b = below[-2], below[-1]
        return known[b] + max(known[b] - known[a], 0.0) * (positions - b) / (b - a)
    return known[below[-1]] if below else None
