"""Whole GGUF in one llama.cpp context vs the same GGUF cut into a llama.cpp route: greedy tokens and
logits, at several cut points and prefill chunk sizes, with two sessions interleaved.

A family is certified when every comparison is token-identical and bit-identical (the route's seams
carry float32 activations, so nothing but a seam bug can change a bit). The whole GGUF is also held
against transformers' own forward on the same weights, which tells a converter or kernel difference
apart from a split bug.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshnet.backends.chain import ChainSession
from meshnet.backends.llama_shard import LlamaShard, LlamaShardConfig
from meshnet.backends.shard import F32, ShardBackend, ShardInfo

STEPS = 20
PROMPT_LEN = 37
# MESHNET_TEST_GPU_LAYERS=-1 certifies on the GPU (benchmarks/device_check.sh): whole and route alike offloaded.
CONFIG = LlamaShardConfig(
    n_ctx=1024, max_sessions=2, n_threads=1, gpu_layers=int(os.environ.get("MESHNET_TEST_GPU_LAYERS", "0"))
)

Seam = Callable[[F32], F32]  # what crosses a seam; identity for a faithful route


@dataclass(frozen=True)
class Parity:
    cuts: tuple[int, ...]
    chunk: int
    tokens_equal: bool
    bits_equal: bool
    max_abs_diff: float


def prompt_for(n_vocab: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, n_vocab, PROMPT_LEN)]


class _SeamShard:
    """A shard whose inbound hidden state first passes through ``seam`` (to prove the harness sees it)."""

    def __init__(self, shard: ShardBackend, seam: Seam) -> None:
        self._shard, self._seam = shard, seam

    def __getattr__(self, name: str) -> object:
        return getattr(self._shard, name)

    def prefill(
        self, sid: object, start: int, *, tokens: object = None, hidden: F32 | None = None, all_logits: bool = False
    ) -> object:
        seamed = None if hidden is None else self._seam(hidden)
        return self._shard.prefill(sid, start, tokens=tokens, hidden=seamed, all_logits=all_logits)  # type: ignore[arg-type]


Run = tuple[list[int], list[F32]]  # greedy tokens, and the logits each was picked from


def greedy(shards: Sequence[ShardBackend], prompts: Sequence[list[int]], chunk: int) -> list[Run]:
    """Greedy runs of ``prompts`` on one route, their sessions stepped in turn (interleaved)."""
    sessions = [ChainSession(shards) for _ in prompts]
    logits = [s.prefill(p, chunk) for s, p in zip(sessions, prompts, strict=True)]
    runs: list[Run] = [([], []) for _ in prompts]
    for _ in range(STEPS):
        for i, session in enumerate(sessions):
            token = int(np.argmax(logits[i]))
            runs[i][0].append(token)
            runs[i][1].append(logits[i].copy())
            logits[i] = session.step(token)
    for session in sessions:
        session.close()
    return runs


def route(
    gguf: Path,
    cuts: Sequence[int],
    total: int,
    cache: Path,
    seam: Seam | None = None,
    config: LlamaShardConfig = CONFIG,
) -> list[ShardBackend]:
    bounds = [0, *cuts, total]
    shards: list[ShardBackend] = [
        LlamaShard.from_model(gguf, f"{a}:{b}", cache_dir=cache, config=config) for a, b in itertools.pairwise(bounds)
    ]
    if seam is not None:
        shards = [shards[0], *(_SeamShard(s, seam) for s in shards[1:])]  # type: ignore[misc]
    return shards


def compare(
    gguf: Path,
    cut_sets: Sequence[Sequence[int]],
    chunks: Sequence[int],
    cache: Path,
    seam: Seam | None = None,
    config: LlamaShardConfig = CONFIG,
) -> list[Parity]:
    """The whole GGUF (``CONFIG``) against routes of it cut at each of ``cut_sets`` (shards of ``config``)."""
    whole = LlamaShard(gguf, config=CONFIG)
    try:
        total = whole.info.layers.total
        prompts = [prompt_for(whole.info.n_vocab, 0), prompt_for(whole.info.n_vocab, 1)]
        reference = {chunk: greedy([whole], prompts, chunk) for chunk in chunks}
    finally:
        whole.close()
    results = []
    for cuts in cut_sets:
        shards = route(gguf, cuts, total, cache, seam, config)
        try:
            for chunk in chunks:
                got = greedy(shards, prompts, chunk)
                want = reference[chunk]
                pairs = [
                    (a, b) for (_, la), (_, lb) in zip(got, want, strict=True) for a, b in zip(la, lb, strict=True)
                ]
                results.append(
                    Parity(
                        tuple(cuts),
                        chunk,
                        all(g[0] == w[0] for g, w in zip(got, want, strict=True)),
                        all(np.array_equal(a, b) for a, b in pairs),
                        max(float(np.max(np.abs(a - b))) for a, b in pairs),
                    )
                )
        finally:
            for shard in shards:
                shard.close()
    return results


def transformers_gap(gguf: Path, hf_dir: Path) -> float:
    """Max |logit difference| / max |logit| between the whole GGUF and transformers on the prompt's last position."""
    import torch
    from transformers import AutoModelForCausalLM

    whole = LlamaShard(gguf, config=CONFIG)
    try:
        prompt = prompt_for(whole.info.n_vocab)
        ours = greedy([whole], [prompt], 64)[0][1][0]
    finally:
        whole.close()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.tensor([prompt])).logits[0, -1].numpy()
    return float(np.max(np.abs(ours - theirs)) / max(1e-9, float(np.max(np.abs(theirs)))))


def whole_info(gguf: Path) -> ShardInfo:
    """What the whole GGUF in one context is (layers, vocabulary, whether it verifies drafts)."""
    whole = LlamaShard(gguf, config=CONFIG)
    try:
        return whole.info
    finally:
        whole.close()


def rewind_replays_exactly(gguf: Path, cuts: Sequence[int], cache: Path) -> bool:
    """On a route: decode, rewind every shard one step (what route repair does to a hop that already
    holds the resent step), decode the same token again: the logits must be bit-identical."""
    info = whole_info(gguf)
    total, n_vocab = info.layers.total, info.n_vocab
    shards = route(gguf, cuts, total, cache)
    try:
        session = ChainSession(shards)
        logits = session.prefill(prompt_for(n_vocab), 7)
        for _ in range(3):
            logits = session.step(int(np.argmax(logits)))
        token = int(np.argmax(logits))
        first = session.step(token)
        session.position -= 1
        for shard in shards:
            shard.rewind(session.sid, session.position)
        again = session.step(token)
        session.close()
        return bool(np.array_equal(first, again))
    finally:
        for shard in shards:
            shard.close()


def verify_matches_decoding(gguf: Path, cuts: Sequence[int], cache: Path, drafts: int = 6) -> bool:
    """Speculative decoding on a route: a verify chunk of ``drafts + 1`` positions gives every row
    the bits one-position steps give, and after dropping the rejected rows the session decodes
    exactly as one that never drafted (its KV is the same)."""
    info = whole_info(gguf)
    total, n_vocab = info.layers.total, info.n_vocab
    shards = route(gguf, cuts, total, cache)
    try:
        plain, spec = ChainSession(shards), ChainSession(shards)
        prompt = prompt_for(n_vocab)
        logits = plain.prefill(prompt, 7)
        spec.prefill(prompt, 7)
        tokens, rows = [], []
        for _ in range(drafts + 4):
            tokens.append(int(np.argmax(logits)))
            rows.append(logits)
            logits = plain.step(tokens[-1])
        rows.append(logits)
        # the first ``drafts - 2`` drafts are right, the rest wrong: keep those, drop the others
        kept = drafts - 2
        wrong = [(t + 1) % n_vocab for t in tokens[kept + 1 : drafts + 1]]
        verified = spec.verify([*tokens[: kept + 1], *wrong])
        same_rows = all(np.array_equal(verified[i], rows[i + 1]) for i in range(kept + 1))
        spec.rewind(len(prompt) + kept + 1)
        again = [spec.step(t) for t in tokens[kept + 1 :]]
        same_after = all(np.array_equal(a, b) for a, b in zip(again, rows[kept + 2 :], strict=True))
        plain.close()
        spec.close()
        return same_rows and same_after
    finally:
        for shard in shards:
            shard.close()
