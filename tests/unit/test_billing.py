"""The billing formula: one place, exact values, no negative inputs."""

from __future__ import annotations

import pytest

from meshnet.tracker.billing import (
    DECODE_WEIGHT,
    FORMULA,
    LAYER_TOKENS_PER_UNIT,
    PREFILL_WEIGHT,
    BillingEstimate,
    estimate,
)


def test_weights_and_formula_text():
    assert PREFILL_WEIGHT == 1.0
    assert DECODE_WEIGHT == 2.0
    assert LAYER_TOKENS_PER_UNIT == 1000.0
    assert FORMULA == "(prefill_layer_tokens*1 + decode_layer_tokens*2) / 1000"


@pytest.mark.parametrize(
    ("prompt", "completion", "layers", "prefill", "decode", "units"),
    [
        (10, 5, 4, 40, 20, 0.08),
        (0, 0, 24, 0, 0, 0.0),
        (100, 0, 30, 3000, 0, 3.0),
        (0, 100, 30, 0, 3000, 6.0),
        (7, 3, 0, 0, 0, 0.0),
        (1, 1, 1, 1, 1, 0.003),
        (1234, 567, 32, 39488, 18144, 75.776),
    ],
)
def test_estimate_values(prompt, completion, layers, prefill, decode, units):
    est = estimate(prompt_tokens=prompt, completion_tokens=completion, layers=layers)
    assert est == BillingEstimate(prefill, decode, units)
    expected = (prefill * PREFILL_WEIGHT + decode * DECODE_WEIGHT) / LAYER_TOKENS_PER_UNIT
    assert est.units == pytest.approx(expected, abs=1e-6)


def test_estimate_rounds_units_to_six_decimals():
    est = estimate(prompt_tokens=1, completion_tokens=0, layers=1)
    assert est.units == 0.001
    est = estimate(prompt_tokens=1, completion_tokens=1, layers=7)  # 21 / 1000
    assert est.units == 0.021


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt_tokens": -1, "completion_tokens": 0, "layers": 1},
        {"prompt_tokens": 0, "completion_tokens": -1, "layers": 1},
        {"prompt_tokens": 0, "completion_tokens": 0, "layers": -1},
    ],
)
def test_negative_inputs_are_rejected(kwargs):
    with pytest.raises(ValueError, match="never negative"):
        estimate(**kwargs)


def test_as_json_carries_the_formula():
    body = estimate(prompt_tokens=2, completion_tokens=3, layers=4).as_json()
    assert body == {
        "prefill_layer_tokens": 8,
        "decode_layer_tokens": 12,
        "units": 0.032,
        "formula": FORMULA,
    }


def test_keyword_only():
    with pytest.raises(TypeError):
        estimate(1, 2, 3)  # type: ignore[misc]
