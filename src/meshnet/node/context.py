"""How many positions one session may hold on a node: a pure decision, made once at start-up.

The default is the model's trained context (GGUF ``{arch}.context_length``), capped at the
product's cap (``PRODUCT_CONTEXT_CAP``), and lowered to what the node's KV budget holds for *its
own layers* at its ``--max-sessions``: llama.cpp allocates every session's cells up front, so a
context the memory cannot hold would fail at load or swap the machine. An explicit ``--ctx`` is
taken as asked, but never past the trained context or the product cap (positions past the trained
context give garbage, not an error). The node says what it chose and why (``ContextChoice.reason``).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.config import PRODUCT_CONTEXT_CAP
from meshnet.errors import InvalidRequest

__all__ = [
    "CONTEXT_ALIGN",
    "DEFAULT_MEMORY_SHARE",
    "MIN_CONTEXT",
    "PRODUCT_CONTEXT_CAP",
    "ContextChoice",
    "choose_context",
]

MIN_CONTEXT = 16  # fewer than this is no usable session (the --ctx floor of meshnet serve)
# A context lowered to fit memory is rounded down to a multiple of llama.cpp's KV padding, so the
# cells a session gets are the cells it was promised.
CONTEXT_ALIGN = 256
# Without --kv-budget-mb a node takes this share of the memory available at start-up for its KV:
# the rest is left to its weights' page cache, the prefix cache and the other processes.
DEFAULT_MEMORY_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class ContextChoice:
    per_session: int  # positions one session may hold
    reason: str  # one sentence for the start-up log: what bounded it


def choose_context(
    *,
    trained: int,
    kv_bytes_per_token: int,
    max_sessions: int,
    budget_bytes: int | None,
    asked: int | None = None,
    budget_source: str = "the KV budget",
) -> ContextChoice:
    """The per-session context of a node whose layers need ``kv_bytes_per_token`` (0: unknown) and
    whose sessions share ``budget_bytes`` of KV (None: no limit known). ``InvalidRequest`` (a usage
    error at start-up) when ``asked`` exceeds the cap or the budget cannot hold a usable session."""
    cap = min(trained, PRODUCT_CONTEXT_CAP) if trained > 0 else PRODUCT_CONTEXT_CAP
    bounded_by = (
        f"the model's trained context {trained:,}"
        if 0 < trained <= PRODUCT_CONTEXT_CAP
        else f"the product cap {PRODUCT_CONTEXT_CAP:,}"
    )
    if asked is not None:
        if asked < MIN_CONTEXT:
            raise InvalidRequest(f"--ctx must be at least {MIN_CONTEXT} tokens, got {asked}", param="ctx")
        if asked > cap:
            raise InvalidRequest(
                f"--ctx {asked:,} exceeds the context cap {cap:,} ({bounded_by}); give at most {cap:,}, or leave "
                "--ctx out to take the most the model and this machine allow",
                param="ctx",
            )
        return ContextChoice(asked, f"--ctx {asked:,} as given (the cap is {cap:,}: {bounded_by})")
    if budget_bytes is None or kv_bytes_per_token <= 0:
        return ContextChoice(cap, f"{bounded_by}; no KV budget limits it")
    fits = budget_bytes // (max_sessions * kv_bytes_per_token)
    if fits >= cap:
        return ContextChoice(
            cap,
            f"{bounded_by}; {budget_source} of {budget_bytes / 2**20:,.0f} MiB holds {fits:,} positions per session "
            f"at --max-sessions {max_sessions} ({kv_bytes_per_token:,} KV bytes/token for these layers)",
        )
    lowered = fits - fits % CONTEXT_ALIGN if fits >= CONTEXT_ALIGN else fits
    if lowered < MIN_CONTEXT:
        raise InvalidRequest(
            f"{budget_source} of {budget_bytes / 2**20:,.1f} MiB holds only {fits} positions per session at "
            f"--max-sessions {max_sessions} ({kv_bytes_per_token:,} KV bytes/token for these layers); give more "
            "memory (--kv-budget-mb), fewer --max-sessions or fewer layers",
            param="kv_budget_mb",
        )
    return ContextChoice(
        lowered,
        f"lowered from {cap:,} ({bounded_by}) to fit {budget_source} of {budget_bytes / 2**20:,.0f} MiB at "
        f"--max-sessions {max_sessions} ({kv_bytes_per_token:,} KV bytes/token for these layers)",
    )
