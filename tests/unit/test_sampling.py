"""Sampler and SamplingParams: greedy, seeded, top-k, top-p, logprobs, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshnet.sampling import Sampler, SamplingParams


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
    candidates, probs = sampler._distribution(logits)
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
