"""Prompt-lookup drafting (gateway.speculative): what it finds, and how many drafts it sends."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from meshnet.gateway.speculative import PROBE_DRAFTS, DraftCost, ModelDraft, PromptLookup, WalkCosts


def test_a_repeated_ngram_offers_what_followed_it_last_time():
    drafter = PromptLookup(4)
    drafter.extend([5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7])
    assert drafter.candidates(8) == [8, 9, 10, 11]  # k caps it
    assert drafter.candidates(2) == [8, 9]  # so does the caller's limit (context, the hops' limit)
    drafter.extend([99])
    assert drafter.candidates(8) == []  # "6 7 99" never occurred before


def test_the_longest_and_latest_match_wins():
    drafter = PromptLookup(3, max_ngram=3, min_ngram=2)
    drafter.extend([1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3])
    assert drafter.candidates(3) == [4, 9, 2]  # "1 2 3" (3 tokens) beats the later "2 3" -> 7
    drafter.extend([5, 2, 3])
    assert drafter.candidates(3) == [5, 2, 3]  # "2 3": its latest occurrence (after "1 2 3") is followed by 5


def test_too_short_or_unrepeated_text_drafts_nothing():
    drafter = PromptLookup(8)
    assert drafter.propose(8) == []
    drafter.extend([1, 2, 3, 4])
    assert drafter.propose(8) == []
    assert drafter.candidates(0) == []


def test_walk_costs_interpolate_between_measured_sizes_and_extend_the_line_beyond():
    costs = WalkCosts()
    assert costs.estimate(3) is None
    costs.observe(1, 0.010)  # compute only: a pipelined round says nothing of the links
    assert costs.compute(5) == pytest.approx(0.010) and costs.estimate(1) is None  # one size known: flat
    costs.observe(9, 0.050)
    assert costs.compute(5) == pytest.approx(0.030)
    assert costs.compute(13) == pytest.approx(0.070)  # on the line through 1 and 9
    costs.observe(1, 0.030)  # the median of the latest samples, not the last one
    assert costs.compute(1) == pytest.approx(0.020)
    for _ in range(3):
        costs.observe(9, 0.052)
    costs.observe(9, 0.900)  # one round in a bad moment moves nothing
    assert costs.compute(9) == pytest.approx(0.052)
    noisy = WalkCosts()
    noisy.observe(1, 0.020)
    noisy.observe(3, 0.018)  # a larger size measured cheaper: never extrapolated below it
    assert noisy.compute(13) == pytest.approx(0.018)
    assert noisy.compute(0) == pytest.approx(0.020)


def test_a_walk_is_its_compute_plus_what_the_links_add_measured_from_rounds_that_went_alone():
    costs = WalkCosts()
    costs.observe(1, 0.004, 0.064)  # 60 ms of links and handling
    costs.observe(5, 0.012)  # pipelined: compute only
    assert costs.estimate(5) == pytest.approx(0.072)
    costs.observe(1, 0.004, 0.054)
    costs.observe(1, 0.004, 0.050)
    assert costs.estimate(1) == pytest.approx(0.004 + 0.050)  # the links' median


def _walks(costs: WalkCosts, *sizes: tuple[int, float]) -> WalkCosts:
    """Rounds that went alone on a route whose links add nothing: each walk is its compute."""
    for positions, seconds in sizes:
        costs.observe(positions, seconds, seconds)
    return costs


def test_a_route_measures_a_plain_step_then_a_short_probe_before_trusting_a_long_chunk():
    costs = WalkCosts()
    assert costs.best_drafts(12, 0.99) == 0  # nothing measured: a plain step first
    costs.observe(1, 0.002, 0.020)
    assert costs.best_drafts(12, 0.99) == PROBE_DRAFTS == 2  # never a chunk: a short one
    assert costs.best_drafts(1, 0.99) == 1
    costs.observe(3, 0.003, 0.021)  # a chunk costs a walk (network-bound): the long one pays
    assert costs.best_drafts(12, 0.99) == 12
    cpu = _walks(WalkCosts(), (1, 0.020), (3, 0.060))  # compute-bound: each position costs a step
    assert cpu.best_drafts(12, 0.8) == 0


def test_a_route_where_drafting_does_not_pay_is_re_probed_ever_more_rarely():
    costs = _walks(WalkCosts(), (1, 0.020), (3, 0.200))  # the chunk measured in a bad moment
    probes = []
    for i in range(1, 16 + 32 + 64 + 1):
        if costs.best_drafts(12, 0.9, explore=True):
            probes.append(i)
            _walks(costs, (3, 0.200))  # the probe went, and its chunk was as costly again
    assert probes == [16, 16 + 32, 16 + 32 + 64]
    assert costs.best_drafts(12, 0.9) == 0  # a chained round's cut never probes
    _walks(costs, (3, 0.021), (3, 0.021), (3, 0.021))  # the probes found chunks cheap again: drafting pays
    assert costs.best_drafts(12, 0.9, explore=True) == 12


def test_a_re_probe_stays_due_until_a_chunk_is_measured():
    """The decision that a re-probe rides on may be one whose step then goes without drafts (the
    tail relays it): the next step about to go probes instead, until a chunk is measured."""
    costs = _walks(WalkCosts(), (1, 0.020), (3, 0.200))
    decisions = [costs.best_drafts(12, 0.9, explore=True) for _ in range(16 + 3)]
    assert decisions[:15] == [0] * 15 and decisions[15:] == [PROBE_DRAFTS] * 4
    _walks(costs, (1, 0.020))  # a plain step is no probe
    assert costs.best_drafts(12, 0.9, explore=True) == PROBE_DRAFTS
    _walks(costs, (3, 0.200))
    assert costs.best_drafts(12, 0.9, explore=True) == 0


def test_drafts_are_sent_only_where_the_route_s_walk_makes_them_pay():
    text = list(range(20)) + list(range(10))
    # nothing measured yet: a plain step (that measures one)
    fresh = PromptLookup(8)
    fresh.extend(text)
    assert fresh.propose(100) == []
    # a network-bound walk (drafts nearly free): send them all
    wan = WalkCosts()
    wan.observe(1, 0.002, 0.060)
    wan.observe(9, 0.008)
    drafter = PromptLookup(8, wan)
    drafter.extend(text)
    assert len(drafter.propose(100)) == 8  # the text's first match, at the prior acceptance (0.8)
    for _ in range(3):
        drafter.record(8, 0)
    assert 2 <= len(drafter.propose(100)) < 8  # drafts as likely rejected as kept: a shorter chunk is faster
    for _ in range(3):
        drafter.record(8, 8)
    assert len(drafter.propose(100)) == 8
    # a compute-bound walk where a 2-position chunk costs 2.4 steps: with drafts rarely kept, none
    cpu = _walks(WalkCosts(), (1, 0.010), (2, 0.024), (3, 0.032), (9, 0.060))
    drafter = PromptLookup(8, cpu)
    drafter.extend(text)
    assert drafter.propose(100) == []  # even the text's first match: at 0.8, 3 tokens cost 3.2 steps
    for _ in range(5):
        drafter.record(4, 0)
    assert drafter.acceptance < 0.5 and drafter.propose(100) == []
    drafter.extend([0] * 100 + text)  # 100 tokens later the rejections have faded to the prior
    assert drafter.acceptance > 0.75
    # ... and with drafts nearly always kept, the long chunk (9 tokens for 6 steps' time)
    for _ in range(20):
        drafter.record(8, 8)
    assert drafter.acceptance > 0.9 and len(drafter.propose(100)) == 8
    assert (drafter.drafted, drafter.accepted) == (180, 160)


def test_draft_min_sends_that_many_drafts_whenever_there_are_that_many_paying_or_not():
    text = list(range(20)) + list(range(10))
    cpu = _walks(WalkCosts(), (1, 0.010), (3, 0.040))  # no draft pays here
    drafter = PromptLookup(8, cpu, minimum=3)
    drafter.extend(text)
    assert drafter.propose(100) == [10, 11, 12]
    assert drafter.propose(2) == [10, 11]  # never more than the route's limit
    assert PromptLookup(8, cpu).propose(100) == []  # without it: none
    wan = WalkCosts()
    wan.observe(1, 0.002, 0.060)
    wan.observe(9, 0.008)
    drafter = PromptLookup(8, wan, minimum=3)
    drafter.extend(text)
    assert len(drafter.propose(100)) == 8  # where more pay, more go


@pytest.mark.parametrize(
    "kwargs",
    [{"k": 0}, {"k": 4, "min_ngram": 0}, {"k": 4, "max_ngram": 1, "min_ngram": 2}, {"k": 4, "minimum": 5},
     {"k": 4, "minimum": -1}],
)  # fmt: skip
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="needs"):
        PromptLookup(**kwargs)


class _Source:
    """A draft source that writes the sequence 1, 2, 3, ... after whatever it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        self.calls.append((len(tokens), k))
        return [tokens[-1] + i for i in range(1, k + 1)]


def test_a_model_draft_asks_its_model_for_the_continuation_of_the_whole_text() -> None:
    source = _Source()
    costs = WalkCosts()
    costs.observe(1, 0.001, 0.050)
    costs.observe(3, 0.002, 0.051)
    drafter = ModelDraft(source, k=4, costs=costs)
    assert drafter.propose(10) == []  # no text yet: nothing to continue
    drafter.extend([5, 6, 7])
    assert drafter.propose(10) == [8, 9, 10, 11]
    assert drafter.propose(2) == [8, 9]  # never more than the route's limit
    assert source.calls == [(3, 4), (3, 2)]
    drafter.record(4, 4)
    drafter.extend([8, 9, 10, 11, 12])
    assert drafter.propose(10)[:1] == [13]
    assert (drafter.drafted, drafter.accepted) == (4, 4)


def test_a_draft_model_makes_only_the_drafts_that_pay_at_what_they_cost() -> None:
    """A draft model's tokens cost the gateway its compute before the chunk goes: where they cost
    about what the route's own step does (a 0.5B drafting for a 1.5B on one core: 36 against 50 ms),
    no draft pays and the model is not even asked; where the walk is mostly links, drafts pay."""
    text = [5, 6, 7]
    # a compute-bound route on a CPU: a step 50 ms, a 3-position chunk 115 ms, 9 positions 400
    cpu = _walks(WalkCosts(), (1, 0.050), (3, 0.115), (9, 0.400))
    spent = DraftCost()
    spent.observe(0.036 * 4, 4)  # what the probe's drafts cost
    assert spent.per_draft == pytest.approx(0.036)
    source = _Source()
    drafter = ModelDraft(source, k=8, costs=cpu, spent=spent)
    drafter.extend(text)
    assert not drafter.would_draft(100) and drafter.propose(100) == [] and drafter.chained(text, 9) == [8]
    assert source.calls == [(3, 1)]  # only the chained round's guess was made: never the drafts that do not pay
    # the same drafts free (prompt lookup's cost): at the prior acceptance, a verify chunk pays
    free = ModelDraft(_Source(), k=8, costs=cpu, spent=DraftCost())
    free.extend(text)
    assert free.would_draft(100) and len(free.propose(100)) >= 1
    # over a WAN (60 ms of links per walk), the same model's drafts pay
    wan = WalkCosts()
    wan.observe(1, 0.050, 0.110)
    wan.observe(3, 0.115)
    wan.observe(9, 0.400)
    source = _Source()
    drafter = ModelDraft(source, k=8, costs=wan, spent=spent)
    drafter.extend(text)
    assert drafter.would_draft(100) and source.calls == []
    drafts = drafter.propose(100)  # (at 36 ms a draft and a 0.8 chance each, one pays best here)
    assert len(drafts) >= 1 and source.calls == [(3, len(drafts))]


def test_draft_cost_is_measured_per_draft_from_the_model_s_calls() -> None:
    class Slow:
        def draft(self, tokens: Sequence[int], k: int) -> list[int]:
            time.sleep(0.01 * k)
            return [1] * k

    drafter = ModelDraft(Slow(), k=4)
    assert drafter.draft_s == 0.0  # nothing measured: the first probe measures it
    drafter.extend([1, 2])
    drafter.continuation([1, 2], 4)
    assert 0.009 <= drafter.draft_s < 0.05


def test_a_draft_model_reads_a_long_text_on_a_thread_while_the_route_decodes_plain_steps() -> None:
    """A prompt (or the tokens written while no draft paid) far ahead of what the model has read: the
    step does not wait for the model to read it; the model reads on a thread, and drafts follow."""
    release = threading.Event()

    class Reader(_Source):
        def draft(self, tokens: Sequence[int], k: int) -> list[int]:
            if k == 1 and len(tokens) == 50:
                assert release.wait(10)  # the read: as long as the test says
            return super().draft(tokens, k)

    wan = WalkCosts()
    wan.observe(1, 0.002, 0.060)
    wan.observe(3, 0.004)
    source = Reader()
    drafter = ModelDraft(source, k=4, costs=wan)
    drafter.extend(list(range(50)))
    began = time.monotonic()
    assert drafter.propose(10) == [] and not drafter.would_draft(10)  # still reading: a plain step
    assert time.monotonic() - began < 1
    release.set()
    deadline = time.monotonic() + 10
    while not drafter.would_draft(10):
        assert time.monotonic() < deadline, "the model never finished reading"
        time.sleep(0.01)
    assert drafter.propose(10) == [50, 51, 52, 53]
    assert source.calls == [(50, 1), (50, 4)]  # one read, then the drafts
    drafter.forget(20)  # a repair: the text is shorter again, and the model behind it no more
    assert drafter.propose(10) == [20, 21, 22, 23]


def test_with_a_minimum_the_draft_model_reads_the_text_before_the_step() -> None:
    """``--draft-min``: drafts whether or not they pay, so the step waits for the model to read the
    text (a read ahead on a thread fell behind a route on a loaded CPU for a whole generation)."""
    source = _Source()
    drafter = ModelDraft(source, k=4, minimum=2)
    drafter.extend(list(range(50)))
    assert drafter.would_draft(10)
    assert drafter.propose(10)[:2] == [50, 51]
    assert source.calls[0][0] == 50 and len(source.calls) == 1  # read and drafted in one call, no thread
    assert [t.name for t in threading.enumerate() if t.name == "meshnet-draft-read"] == []


def test_a_draft_call_that_reads_more_of_the_text_is_not_timed_as_drafts() -> None:
    """What a draft costs is measured from calls that draft as round after round does: a call that
    first reads a dozen new tokens (a probe after a while without drafts) would make drafts look
    several times dearer, and the route would then never draft again to find out."""

    class Reading:
        def draft(self, tokens: Sequence[int], k: int) -> list[int]:
            time.sleep(0.005 * k)
            return [1] * k

    spent = DraftCost()
    drafter = ModelDraft(Reading(), k=12, spent=spent)
    drafter.extend(list(range(10)))
    drafter.continuation(list(range(10)), 2)  # reads 10 tokens first: not timed
    assert spent.per_draft == 0.0
    drafter.extend([1, 1, 7])  # the two drafts kept, the route's own token: 2 tokens new to the model
    drafter.continuation(drafter._tokens, 2)
    assert 0.004 <= spent.per_draft < 0.05
