"""The billing formula, in one place: the gateway estimates with it, the tracker records with it.

A *layer-token* is one token pushed through one transformer block on some node. Decode
layer-tokens weigh more than prefill layer-tokens because a decode step is bound by reading all
weights for a single token, while prefill amortizes that read over a whole chunk (measured on the
reference machine: llama.cpp prefill ~211 tok/s vs decode ~101 tok/s for the same model, so a
decode token costs about twice a prefill token).

    billing_units = (prefill_layer_tokens * PREFILL_WEIGHT
                     + decode_layer_tokens * DECODE_WEIGHT) / LAYER_TOKENS_PER_UNIT

See docs/billing.md.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DECODE_WEIGHT",
    "FORMULA",
    "LAYER_TOKENS_PER_UNIT",
    "MAX_DECODE_S",
    "PREFILL_WEIGHT",
    "BillingEstimate",
    "bill",
    "estimate",
]

PREFILL_WEIGHT = 1.0
DECODE_WEIGHT = 2.0
LAYER_TOKENS_PER_UNIT = 1000.0
# The most decode seconds one billing report may carry (``decode_s``, tracker.plausibility): ~116
# days, longer than any session decodes; bounded so the speed check's arithmetic stays finite.
MAX_DECODE_S = 1e7
FORMULA = (
    f"(prefill_layer_tokens*{PREFILL_WEIGHT:g} + decode_layer_tokens*{DECODE_WEIGHT:g}) / {LAYER_TOKENS_PER_UNIT:g}"
)


@dataclass(frozen=True, slots=True)
class BillingEstimate:
    prefill_layer_tokens: int
    decode_layer_tokens: int
    units: float

    def as_json(self) -> dict[str, float | int | str]:
        return {
            "prefill_layer_tokens": self.prefill_layer_tokens,
            "decode_layer_tokens": self.decode_layer_tokens,
            "units": self.units,
            "formula": FORMULA,
        }


def bill(*, prefill_tokens: int, decode_tokens: int, layers: int) -> BillingEstimate:
    """Billing units for positions computed through ``layers`` blocks (one node, or a route's hops summed)."""
    if min(prefill_tokens, decode_tokens, layers) < 0:
        raise ValueError("token and layer counts are never negative")
    prefill = prefill_tokens * layers
    decode = decode_tokens * layers
    units = (prefill * PREFILL_WEIGHT + decode * DECODE_WEIGHT) / LAYER_TOKENS_PER_UNIT
    return BillingEstimate(prefill, decode, round(units, 6))


def estimate(*, prompt_tokens: int, completion_tokens: int, layers: int) -> BillingEstimate:
    """The gateway's running estimate for a generation: the same formula the tracker records with."""
    return bill(prefill_tokens=prompt_tokens, decode_tokens=completion_tokens, layers=layers)
