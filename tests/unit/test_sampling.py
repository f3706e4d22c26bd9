"""Sampler and SamplingParams: greedy, seeded, top-k, top-p, logprobs, validation."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from meshnet.sampling import SORTED_HEAD, Draw, Sampler, SamplingParams, _drawn_index, check_draw


def _logits(seed: int = 0, vocab: int = 64) -> np.ndarray:
    # Distinct values (no ties), spread enough that several tokens carry real mass.
    return np.random.default_rng(seed).normal(0.0, 2.0, vocab).astype(np.float32)


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + math.log(np.exp(x - m).sum()))


def test_default_params_are_valid_and_not_greedy():
    p = SamplingParams()
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.seed is None
    assert not p.greedy


def test_greedy_is_argmax():
    logits = _logits(1)
    sampler = Sampler(SamplingParams(temperature=0.0))
    for _ in range(5):
        token, _ = sampler.sample(logits)
        assert token == int(np.argmax(logits))


def test_greedy_ignores_seed_and_filters():
    logits = _logits(2)
    expected = int(np.argmax(logits))
    for seed in (None, 0, 123):
        params = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=seed)
        assert params.greedy
        assert Sampler(params).sample(logits)[0] == expected


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-6])
def test_a_vanishing_temperature_is_greedy_never_nan(temperature: float):
    """Dividing logits by a subnormal temperature overflows to inf and the probabilities to NaN: such
    a request once failed the tail and took its route down. Below the floor it is the argmax."""
    logits = _logits(3)
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy
    assert Sampler(params).sample(logits)[0] == int(np.argmax(logits))
    just_above = Sampler(SamplingParams(temperature=2e-5, seed=1))
    assert just_above.sample(logits)[0] == int(np.argmax(logits))  # finite: sampled, and the argmax


def test_seeded_sampling_is_reproducible():
    logits = _logits(3)
    params = SamplingParams(temperature=1.5, seed=42)
    first = Sampler(params)
    second = Sampler(params)
    seq_a = [first.sample(logits)[0] for _ in range(50)]
    seq_b = [second.sample(logits)[0] for _ in range(50)]
    assert seq_a == seq_b
    # A high temperature over a spread distribution really samples (not a disguised argmax).
    assert len(set(seq_a)) > 1


def test_different_seeds_diverge():
    logits = _logits(4)
    s0 = Sampler(SamplingParams(temperature=2.0, seed=0))
    s1 = Sampler(SamplingParams(temperature=2.0, seed=1))
    assert [s0.sample(logits)[0] for _ in range(40)] != [s1.sample(logits)[0] for _ in range(40)]


def test_top_k_one_equals_greedy():
    for seed in range(5):
        logits = _logits(10 + seed)
        sampler = Sampler(SamplingParams(temperature=2.0, top_k=1, seed=seed))
        for _ in range(10):
            assert sampler.sample(logits)[0] == int(np.argmax(logits))


def test_top_k_restricts_to_the_k_best():
    logits = _logits(20)
    k = 3
    best = set(np.argsort(-logits)[:k].tolist())
    sampler = Sampler(SamplingParams(temperature=2.0, top_k=k, seed=7))
    seen = {sampler.sample(logits)[0] for _ in range(200)}
    assert seen <= best
    assert len(seen) > 1


def test_top_k_at_or_above_vocab_is_no_filter():
    logits = np.zeros(4, dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=4, seed=0))
    seen = {sampler.sample(logits)[0] for _ in range(200)}
    assert seen == {0, 1, 2, 3}


def test_tiny_top_p_keeps_only_the_best_token():
    for seed in range(5):
        logits = _logits(30 + seed)
        sampler = Sampler(SamplingParams(temperature=2.0, top_p=1e-9, seed=seed))
        for _ in range(10):
            assert sampler.sample(logits)[0] == int(np.argmax(logits))


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # Probabilities 0.5, 0.3, 0.2 at temperature 1: top_p=0.7 keeps the first two tokens.
    probs = np.array([0.2, 0.5, 0.3], dtype=np.float64)
    logits = np.log(probs).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=1))
    seen = {sampler.sample(logits)[0] for _ in range(300)}
    assert seen == {1, 2}


def test_logprob_equals_float64_log_softmax():
    logits = _logits(40, vocab=50_000)
    reference = _log_softmax64(logits)
    sampler = Sampler(SamplingParams(temperature=0.7, seed=5))
    for _ in range(20):
        token, logprob = sampler.sample(logits)
        assert isinstance(token, int)
        assert isinstance(logprob, float)
        assert logprob == pytest.approx(reference[token], abs=1e-4)
        assert logprob <= 0.0


def test_logprob_is_before_temperature():
    logits = _logits(41)
    token = int(np.argmax(logits))
    expected = _log_softmax64(logits)[token]
    for temperature in (0.0, 0.3, 1.0, 2.0):
        got_token, logprob = Sampler(SamplingParams(temperature=temperature, top_k=1, seed=0)).sample(logits)
        assert got_token == token
        assert logprob == pytest.approx(expected, abs=1e-5)


def test_logprob_of_a_near_certain_token_is_near_zero():
    logits = np.full(258, -30.0, dtype=np.float32)
    logits[65] = 30.0
    token, logprob = Sampler(SamplingParams(temperature=0.0)).sample(logits)
    assert token == 65
    assert logprob == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": 2.01},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": -0.5},
        {"top_p": 1.0001},
        {"top_k": -1},
    ],
)
def test_invalid_params_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": 0.0}, {"temperature": 2.0}, {"top_p": 1.0}, {"top_p": 1e-6}, {"top_k": 0}, {"top_k": 1}],
)
def test_boundary_params_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_params_are_frozen():
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_a_seeded_draw_depends_on_the_seed_and_position_only():
    """A new sampler (a repaired route's new tail) draws what the old one would have at that position."""
    logits = np.log(np.full(50, 1 / 50, dtype=np.float32))
    params = SamplingParams(temperature=1.0, seed=7)
    old = Sampler(params)
    drawn = [old.sample(logits, position=p)[0] for p in range(100, 140)]
    new = Sampler(params)
    assert [new.sample(logits, position=p)[0] for p in range(120, 140)] == drawn[20:]
    assert len(set(drawn)) > 10  # still random across positions
    other = Sampler(SamplingParams(temperature=1.0, seed=8))
    assert [other.sample(logits, position=p)[0] for p in range(100, 140)] != drawn


def test_logit_bias_bans_and_forces_tokens_but_logprob_stays_the_models():
    logits = _logits(3)
    best = int(np.argmax(logits))
    worst = int(np.argmin(logits))
    banned = Sampler(SamplingParams(temperature=0.0, logit_bias=((best, -100.0),)))
    token, logprob = banned.sample(logits)
    assert token == int(np.argsort(logits)[-2])  # the runner-up
    assert logprob == pytest.approx(_log_softmax64(logits)[token], abs=1e-5)
    forced = Sampler(SamplingParams(temperature=1.0, seed=5, logit_bias=[[worst, 100]]))  # JSON gives lists
    assert all(forced.sample(logits, position=p)[0] == worst for p in range(20))
    assert forced.params.logit_bias == ((worst, 100.0),)


@pytest.mark.parametrize("bias", [((1, 101.0),), ((-1, 1.0),), (("x", 1.0),), ((1,),)])
def test_bad_logit_bias_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_is_an_error():
    with pytest.raises(ValueError, match="outside the vocabulary of 64"):
        Sampler(SamplingParams(logit_bias=((64, 1.0),))).sample(_logits())


# -- speculative verification ---------------------------------------------------------------


def test_greedy_verify_keeps_the_drafts_the_argmax_agrees_with_then_its_own_token():
    rows = np.stack([_logits(s) for s in range(5)])
    best = [int(np.argmax(r)) for r in rows]
    sampler = Sampler(SamplingParams(temperature=0.0))
    # all four drafts right: four kept, plus the token after them
    assert sampler.verify(rows, best[:4], position=10)[0] == best
    # the third draft wrong: two kept, then the model's own third token (not the draft)
    tokens, logprobs = sampler.verify(rows, [best[0], best[1], (best[2] + 1) % 64, best[3]], position=10)
    assert tokens == best[:3]
    assert logprobs == pytest.approx([_log_softmax64(rows[i])[t] for i, t in enumerate(tokens)], abs=1e-5)
    # nothing right: exactly the plain step's token
    assert sampler.verify(rows, [(b + 1) % 64 for b in best[:4]], position=10)[0] == best[:1]


def test_greedy_verify_sees_logit_bias_as_sample_does():
    rows = np.stack([_logits(s) for s in range(3)])
    banned = int(np.argmax(rows[0]))
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias=((banned, -100.0),)))
    tokens, _ = sampler.verify(rows, [banned, 1], position=0)
    assert tokens[0] == sampler.sample(rows[0])[0] != banned


def test_sampled_verify_keeps_the_target_distribution():
    """Speculative sampling's rule with a deterministic drafter: each kept token is distributed
    as plain sampling would draw it, whatever the draft (a likely one, or an unlikely one)."""
    logits = _logits(3, vocab=8)
    params = SamplingParams(temperature=0.8, top_k=6)
    sampler = Sampler(params)
    candidates, probs = _laid_out(sampler, logits)
    target = np.zeros(8)
    target[candidates] = probs
    rows = np.stack([logits, logits])
    trials = 20_000
    for draft in (int(candidates[0]), int(candidates[-1]), int(np.argmin(logits))):  # likely, unlikely, filtered out
        counts = np.zeros(8)
        for seed in range(trials):
            token = Sampler(SamplingParams(temperature=0.8, top_k=6, seed=seed)).verify(rows, [draft], position=5)[0][0]
            counts[token] += 1
        assert np.abs(counts / trials - target).max() < 0.015, (draft, counts / trials, target)


def test_seeded_verify_is_reproducible_and_rows_must_match_the_drafts():
    rows = np.stack([_logits(s) for s in range(4)])
    params = SamplingParams(temperature=1.0, seed=7)
    first = Sampler(params).verify(rows, [1, 2, 3], position=20)
    assert Sampler(params).verify(rows, [1, 2, 3], position=20) == first
    with pytest.raises(ValueError, match="needs 3 rows"):
        Sampler(params).verify(rows, [1, 2], position=20)


@pytest.mark.parametrize("seed", range(40))
def test_a_seeded_text_is_the_same_however_its_drafts_are_cut_into_rounds(seed: int):
    """Each row draws exactly what plain sampling draws at its position, so a seeded text does not
    depend on which positions were drafted (the gateway cuts rounds by measured costs)."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(0.0, 1.5, (12, 10)).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed, frequency_penalty=0.3)
    plain = Sampler(params)
    want = []
    for i, row in enumerate(rows):
        token = plain.sample(row, position=30 + i)[0]
        want.append(token)
        plain.advance(token)
    # drafts right and wrong at random, in rounds of random sizes, with the step's own token first
    got: list[int] = []
    sampler = Sampler(params)
    while len(got) < len(rows):
        size = int(rng.integers(1, len(rows) - len(got) + 1))
        drafts = [w if rng.random() < 0.7 else int(rng.integers(0, 10)) for w in want[len(got) + 1 : len(got) + size]]
        at = len(got)
        tokens, _ = sampler.verify(rows[at : at + len(drafts) + 1], drafts, position=30 + at)
        got += tokens
        for token in tokens:
            sampler.advance(token)
    assert got[: len(rows)] == want


def test_alternatives_are_the_most_likely_tokens_under_the_model():
    logits = _logits(4)
    sampler = Sampler(SamplingParams(temperature=0.7, top_logprobs=3, logit_bias=((0, -100.0),)))
    top = sampler.alternatives(logits)
    want = np.argsort(-logits)[:3]
    assert [t for t, _ in top] == [int(t) for t in want]  # the model's, not the biased ones
    assert [lp for _, lp in top] == pytest.approx([_log_softmax64(logits)[t] for t in want], abs=1e-5)
    assert Sampler(SamplingParams()).alternatives(logits) == ()
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=21)


def test_penalties_lower_the_logits_of_generated_tokens_once_and_per_occurrence():
    logits = np.zeros(8, dtype=np.float32)
    logits[3] = 1.0
    sampler = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.4))
    assert sampler.sample(logits)[0] == 3
    sampler.generated.update([3, 3])  # 1 - 0.5 - 2 * 0.4 = -0.3 < 0: token 3 loses the argmax
    token, logprob = sampler.sample(logits)
    assert token == 0
    assert logprob == pytest.approx(_log_softmax64(logits)[0], abs=1e-6)  # the model's logprob, unpenalized
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)


def test_a_penalized_verify_picks_what_step_by_step_sampling_picks():
    rng = np.random.default_rng(9)
    rows = rng.normal(0.0, 1.0, (6, 16)).astype(np.float32)
    rows[:, 5] += 3.0  # token 5 leads every row until its penalties pile up
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5)
    stepper = Sampler(params)
    stepper.generated.update([5])
    steps = []
    for row in rows:
        token = stepper.sample(row)[0]
        steps.append(token)
        stepper.generated[token] += 1
    verifier = Sampler(params)
    verifier.generated.update([5])
    tokens, _ = verifier.verify(rows, steps[:5], position=0)  # the drafts are exactly what steps chose
    assert tokens == steps and len(set(steps)) > 1


# -- committed draws (Draw, check_draw): the gateway re-derives the tail's token ----------------------------


def _random_case(rng: np.random.Generator) -> tuple[np.ndarray, SamplingParams, int]:
    vocab = int(rng.integers(2, 3000))
    logits = (rng.standard_normal(vocab) * rng.uniform(0.1, 8)).astype(np.float32)
    params = SamplingParams(
        temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])),
        top_p=float(rng.choice([1.0, 0.9, 0.5])),
        top_k=int(rng.choice([0, 5, 40])),
        seed=int(rng.integers(0, 2**62)),
        logit_bias=((0, float(rng.uniform(-5, 5))),),
        presence_penalty=float(rng.choice([0.0, 0.5])),
    )
    return logits, params, int(rng.integers(0, 10**6))


def _over_the_wire(draw: Draw) -> Draw:
    return Draw.from_json(json.loads(json.dumps(draw.to_json())))


def test_a_committed_draw_is_the_draw_sample_makes_and_the_gateway_re_derives_it_exactly():
    rng = np.random.default_rng(7)
    past = 0
    for _ in range(2000):
        logits, params, position = _random_case(rng)
        sampler = Sampler(params)
        sampler.set_history([1, 2, 2])
        token, logprob, draw = sampler.sample_committed(logits, position)
        again = Sampler(params)
        again.set_history([1, 2, 2])
        assert again.sample(logits, position) == (token, logprob)  # the same choice as before commitments
        draw = _over_the_wire(draw)
        assert check_draw(params, draw, token, position) is None
        past += token not in draw.ids
    assert past < 200  # flat random distributions: a few draws fall past the 20 committed candidates


def test_a_greedy_choice_is_known_before_its_commitment_is_worked_out(monkeypatch: pytest.MonkeyPatch):
    """``choose_committed``: a greedy token without a grammar is an argmax; its draw (the most likely
    others) is worked out only when asked, with the bits ``sample_committed`` gives (a route's tail sends
    the next step on in between). A seeded draw's token needs its distribution: it comes whole."""
    import meshnet.sampling as sampling

    made: list[int] = []
    greedy_draw = sampling._greedy_draw

    def counted(*args: object, **kwargs: object) -> Draw:
        made.append(1)
        return greedy_draw(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling, "_greedy_draw", counted)
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(4096) * 3).astype(np.float32)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, presence_penalty=1.5,
                                                                   logit_bias=((7, 30.0),))):  # fmt: skip
        sampler = Sampler(params)
        sampler.set_history([3, 3, 9])
        made.clear()
        committed = sampler.choose_committed(logits, 5)
        assert made == []
        logprob, draw = committed.finish()
        assert made == [1]
        again = Sampler(params)
        again.set_history([3, 3, 9])
        assert (committed.token, logprob, draw) == again.sample_committed(logits, 5)
        assert again.sample(logits, 5) == (committed.token, logprob)
        assert check_draw(params, draw, committed.token, 5) is None
    seeded = SamplingParams(temperature=0.8, seed=3)
    committed = Sampler(seeded).choose_committed(logits, 5)
    assert (committed.token, *committed.finish()) == Sampler(seeded).sample_committed(logits, 5)


def test_another_token_than_the_draw_gives_is_caught_unless_the_draw_fell_past_the_committed_candidates():
    rng = np.random.default_rng(8)
    caught = within = 0
    for _ in range(2000):
        logits, params, position = _random_case(rng)
        token, _, draw = Sampler(params).sample_committed(logits, position)
        flipped = (token + 1) % logits.shape[0]
        why = check_draw(params, _over_the_wire(draw), flipped, position)
        within += token in draw.ids
        caught += why is not None
        if token in draw.ids:  # the seed picks one committed candidate: anything else is caught
            assert why is not None
    assert caught >= within


def test_a_greedy_draw_commits_its_token_first_and_any_other_token_is_caught():
    logits = np.array([0.1, 3.0, 3.0, -1.0, 2.5], dtype=np.float32)
    params = SamplingParams(temperature=0.0, seed=5)
    token, _, draw = Sampler(params).sample_committed(logits, 9)
    assert token == 1 and draw.ids[:3] == (1, 2, 4) and draw.size == 5  # ties: the lower id, as argmax
    assert abs(sum(draw.probs) - 1.0) < 1e-9
    assert check_draw(params, draw, 1, 9) is None
    assert "greedy" in (check_draw(params, draw, 2, 9) or "")


def test_a_draw_of_another_seed_or_position_does_not_pass():
    rng = np.random.default_rng(9)
    mismatches = 0
    for _ in range(200):
        logits = (rng.standard_normal(50) * 0.5).astype(np.float32)  # flat: draws spread over candidates
        params = SamplingParams(temperature=1.0, seed=int(rng.integers(0, 2**62)))
        token, _, draw = Sampler(params).sample_committed(logits, 3)
        moved = dataclasses.replace(params, seed=params.seed + 1)
        mismatches += check_draw(moved, draw, token, 3) is not None or check_draw(params, draw, token, 4) is not None
    assert mismatches > 150


def test_a_draw_without_commitment_or_with_a_grammar_stream_the_request_lacks_is_refused():
    params = SamplingParams(temperature=1.0, seed=1)
    assert "no distribution" in (check_draw(params, None, 3, 0) or "")
    draw = Draw((3, 4), (0.6, 0.4), 1.0, 2, stream=3)
    assert "grammar" in (check_draw(params, draw, 3, 0) or "")


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"ids": [], "probs": [], "total": 1.0, "size": 0, "stream": 0},
        {"ids": [1, 1], "probs": [0.5, 0.5], "total": 1.0, "size": 2, "stream": 0},
        {"ids": [1], "probs": [1.5], "total": 1.0, "size": 1, "stream": 0},
        {"ids": [1], "probs": [1], "total": 1.0, "size": 1, "stream": 0},
        {"ids": [1], "probs": [1.0], "total": 1.0, "size": 1, "stream": 2},
        {"ids": [1], "probs": [1.0], "total": 1.0, "size": 0, "stream": 0},
        {"ids": list(range(21)), "probs": [0.01] * 21, "total": 1.0, "size": 30, "stream": 0},
        {"ids": [True], "probs": [1.0], "total": 1.0, "size": 1, "stream": 0},
    ],
)
def test_a_malformed_draw_is_refused(raw: object):
    with pytest.raises(ValueError):
        Draw.from_json(raw)


class _EvenOnly:
    """A grammar that allows even token ids only (the sampler's view of a compiled grammar)."""

    accepted_at = 0.0

    def allows(self, token: int) -> bool:
        return token % 2 == 0

    def mask(self, logits: np.ndarray) -> np.ndarray:
        masked = logits.copy()
        masked[1::2] = -np.inf
        return masked

    def best(self, logits: np.ndarray) -> int:
        return int(np.argmax(self.mask(logits)))

    def accept(self, token: int) -> None: ...

    def sync(self, history: object) -> None: ...

    def cancel(self) -> None: ...


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draw_the_grammar_constrained_is_committed_on_its_own_stream_and_re_derived(temperature: float):
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(200):
        logits = rng.standard_normal(64).astype(np.float32)
        params = SamplingParams(temperature=temperature, seed=int(rng.integers(0, 2**62)), grammar="root ::= x")
        sampler = Sampler(params, _EvenOnly())
        token, _, draw = sampler.sample_committed(logits, 5)
        assert token % 2 == 0 and Sampler(params, _EvenOnly()).sample(logits, 5)[0] == token
        if draw.stream == 3:
            checked += 1
            assert check_draw(params, _over_the_wire(draw), token, 5) is None
            assert check_draw(dataclasses.replace(params, grammar=""), draw, token, 5) is not None
    assert checked > 50  # about half the unconstrained choices are odd


def _laid_out(sampler: Sampler, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The candidate tokens and their probabilities in draw order: the sampler's head, then the rest
    in id order (``Sampler._spread``, laid out whole)."""
    spread = sampler._spread(logits)
    if spread.rest_probs is None:
        return spread.head_ids, spread.head_probs.copy()
    rest = np.ones(spread.rest_probs.shape[0], dtype=bool)
    rest[spread.head_ids if spread.ids is None else np.searchsorted(spread.ids, spread.head_ids)] = False
    ids = np.flatnonzero(rest) if spread.ids is None else spread.ids[rest]
    return np.concatenate((spread.head_ids, ids)), np.concatenate((spread.head_probs, spread.rest_probs[rest]))


def _sorted_reference(logits: np.ndarray, params: SamplingParams) -> dict[int, float]:
    """The distribution by a full sort of the vocabulary (what the sampler computed before it
    sorted only its head): token id -> probability."""
    candidates, values = np.arange(logits.shape[0]), logits.astype(np.float64)
    if 0 < params.top_k < values.shape[0]:
        keep = np.argpartition(values, -params.top_k)[-params.top_k :]
        candidates, values = candidates[keep], values[keep]
    order = np.lexsort((candidates, -values))
    candidates, values = candidates[order], values[order] / params.temperature
    probs = np.exp(values - values[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        candidates, probs = candidates[:cut], probs[:cut] / probs[:cut].sum()
    return dict(zip(candidates.tolist(), probs.tolist(), strict=True))


@pytest.mark.parametrize("peaked", [True, False], ids=["peaked", "flat"])
def test_the_distribution_sorts_its_head_and_is_the_full_sorts_distribution(peaked: bool):
    rng = np.random.default_rng(12)
    for _ in range(40):
        vocab = int(rng.integers(300, 5000))
        logits = (rng.standard_normal(vocab) * 2).astype(np.float32)
        if peaked:  # a language model's: a few tokens far above the rest
            logits[rng.choice(vocab, 8, replace=False)] += 12
        params = SamplingParams(temperature=float(rng.choice([0.5, 1.0, 1.7])), top_p=float(rng.choice([1.0, 0.9])),
                                top_k=int(rng.choice([0, 40, 400])), seed=1)  # fmt: skip
        candidates, probs = _laid_out(Sampler(params), logits)
        head = min(SORTED_HEAD, candidates.shape[0])
        assert np.all(np.diff(probs[:head]) <= 0)  # the head is sorted, most likely first
        if head < candidates.shape[0]:
            assert probs[head:].max() <= probs[head - 1]  # nothing after it is more likely
            # the rest in id order; or, where top-p needed more than the head, everything sorted
            assert np.all(np.diff(candidates[head:]) > 0) or np.all(np.diff(probs) <= 0)
        reference = _sorted_reference(logits, params)
        assert set(candidates.tolist()) == set(reference)
        assert np.allclose(probs, [reference[t] for t in candidates.tolist()], rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=400),
     SamplingParams(temperature=0.6, top_p=0.7), SamplingParams(temperature=2.0, top_p=0.999)],
    ids=["plain", "top-k", "top-p", "wide-top-p"],
)  # fmt: skip
def test_a_draw_in_place_picks_what_the_laid_out_distribution_picks(params: SamplingParams):
    """The draw works where the probabilities lie (the head sorted, the rest in id order with the
    head's entries zeroed): for any uniform, including each boundary of the running sum, it picks
    the token ``_drawn_index`` picks over the distribution laid out in draw order, with its total."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(3000) * 2).astype(np.float32)
    logits[rng.choice(3000, 6, replace=False)] += 9
    logits[100:140] = logits[7]  # ties across the head's edge: every tied token joins the head
    sampler = Sampler(params)
    candidates, probs = _laid_out(sampler, logits)
    running = np.cumsum(probs)
    total = float(running[-1])
    edges = (running / total)[:: max(1, len(running) // 200)]
    for uniform in [*rng.random(300), *edges, *np.nextafter(edges, 0), 0.0]:
        if uniform >= 1.0:
            continue
        token, drawn_total = sampler._spread(logits).draw(float(uniform))
        assert drawn_total == total
        assert token == candidates[_drawn_index(running, total, float(uniform))]
