"""Prompt-lookup drafting (gateway.speculative): what it proposes, and how its draft length adapts."""

from __future__ import annotations

import pytest

from meshnet.gateway.speculative import PromptLookup


def test_a_repeated_ngram_proposes_what_followed_it_last_time():
    drafter = PromptLookup(4)
    drafter.extend([5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6])
    assert drafter.propose(8) == [7, 8, 9, 10]  # k caps it
    assert drafter.propose(2) == [7, 8]  # so does the caller's limit (context, the hops' limit)
    drafter.extend([7, 99])
    assert drafter.propose(8) == []  # "7 99" never occurred before


def test_the_longest_and_latest_match_wins():
    drafter = PromptLookup(3, max_ngram=3, min_ngram=2)
    drafter.extend([1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3])
    assert drafter.propose(3) == [4, 9, 2]  # "1 2 3" (3 tokens) beats the later "2 3" -> 7
    drafter.extend([5, 2, 3])
    assert drafter.propose(3) == [5, 2, 3]  # "2 3": its latest occurrence (after "1 2 3") is followed by 5


def test_too_short_or_unrepeated_text_drafts_nothing():
    drafter = PromptLookup(8)
    assert drafter.propose(8) == []
    drafter.extend([1, 2, 3, 4])
    assert drafter.propose(8) == []
    assert drafter.propose(0) == []


def test_the_draft_length_follows_what_the_route_accepts():
    drafter = PromptLookup(8)
    drafter.extend(list(range(20)) + list(range(10)))
    assert len(drafter.propose(100)) == 8
    drafter.record(8, 0)  # nothing kept: the next draft is short
    assert len(drafter.propose(100)) == 2
    drafter.record(2, 2)  # all kept: it grows again
    assert len(drafter.propose(100)) == 6
    drafter.record(6, 6)
    assert len(drafter.propose(100)) == 8
    assert (drafter.drafted, drafter.accepted) == (16, 8)


@pytest.mark.parametrize("kwargs", [{"k": 0}, {"k": 4, "min_ngram": 0}, {"k": 4, "max_ngram": 1, "min_ngram": 2}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="prompt lookup needs"):
        PromptLookup(**kwargs)
