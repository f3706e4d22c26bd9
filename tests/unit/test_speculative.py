"""Prompt-lookup drafting (gateway.speculative): what it finds, and how many drafts it sends."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from meshnet.gateway.speculative import ModelDraft, PromptLookup, WalkCosts


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


def test_walk_costs_interpolate_between_measured_sizes_and_stay_flat_beyond():
    costs = WalkCosts()
    assert costs.estimate(3) is None
    costs.observe(1, 0.010)
    costs.observe(9, 0.050)
    assert costs.estimate(5) == pytest.approx(0.030)
    assert costs.estimate(12) == pytest.approx(0.050)
    costs.observe(1, 0.030)  # a moving average, not the last sample
    assert 0.010 < costs.estimate(1) < 0.030


def test_drafts_are_sent_only_where_the_route_s_walk_makes_them_pay():
    text = list(range(20)) + list(range(10))
    # nothing measured yet: every candidate goes out (that measures a draft)
    fresh = PromptLookup(8)
    fresh.extend(text)
    assert len(fresh.propose(100)) == 8
    # a network-bound walk (drafts nearly free): send them all
    wan = WalkCosts()
    wan.observe(1, 0.060)
    wan.observe(9, 0.066)
    drafter = PromptLookup(8, wan)
    drafter.extend(text)
    assert len(drafter.propose(100)) == 8  # the text's first match: verified in full
    for _ in range(3):
        drafter.record(8, 0)
    assert 2 <= len(drafter.propose(100)) < 8  # drafts as likely rejected as kept: a shorter chunk is faster
    for _ in range(3):
        drafter.record(8, 8)
    assert len(drafter.propose(100)) == 8
    # a compute-bound walk where a 2-position chunk costs 2.4 steps: with drafts rarely kept, none
    cpu = WalkCosts()
    for size, seconds in ((1, 0.010), (2, 0.024), (3, 0.032), (9, 0.060)):
        cpu.observe(size, seconds)
    drafter = PromptLookup(8, cpu)
    drafter.extend(text)
    assert len(drafter.propose(100)) == 8  # the text's first match
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


@pytest.mark.parametrize("kwargs", [{"k": 0}, {"k": 4, "min_ngram": 0}, {"k": 4, "max_ngram": 1, "min_ngram": 2}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="prompt lookup needs"):
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
    drafter = ModelDraft(source, k=4)
    assert drafter.propose(10) == []  # no text yet: nothing to continue
    drafter.extend([5, 6, 7])
    assert drafter.propose(10) == [8, 9, 10, 11]  # the first draft is verified in full: it measures q
    assert drafter.propose(2) == [8, 9]  # never more than the route's limit
    assert source.calls == [(3, 4), (3, 2)]
    drafter.record(4, 4)
    drafter.extend([8, 9, 10, 11, 12])
    assert drafter.propose(10)[:1] == [13]
    assert (drafter.drafted, drafter.accepted) == (4, 4)
