"""llama.cpp shards in one process vs one full context, and what cutting the vocabulary saves.

All variants run in this process one after another (never concurrently), each with all cores:
only one shard computes at a time in an in-process chain, so the total thread count matches the
full context's. Rounds alternate between variants so drift on a shared VM hits all alike.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import Section, median, timed_decode
from meshnet.artifacts.bundled import bundled_gguf
from meshnet.artifacts.shard_file import write_shard
from meshnet.backends.llama_shard import SNAPSHOT_CELL_META_BYTES, LlamaShard, LlamaShardConfig
from meshnet.ids import SessionId

THREADS = os.cpu_count() or 2
RANGES = ("0:10", "10:20", "20:30")
PROMPT_TEXT = "<|im_start|>user\nWrite a story about a dragon.<|im_end|>\n<|im_start|>assistant\n"
DECODE = 128
ROUNDS = 5


def _prompt() -> list[int]:
    import llama_cpp

    vocab = llama_cpp.Llama(str(bundled_gguf()), vocab_only=True, verbose=False)
    try:
        return list(vocab.tokenize(PROMPT_TEXT.encode(), special=True))
    finally:
        vocab.close()


PROMPT = _prompt()


def _decode_rate(chain: list[LlamaShard], round_no: int) -> float:
    sid = SessionId(f"bench-{round_no}")
    for shard in chain:
        shard.open_session(sid)
    rate, _, _ = timed_decode(chain, sid, PROMPT, DECODE)
    for shard in chain:
        shard.close_session(sid)
    return rate


def _kv_bytes_per_token(shard: LlamaShard) -> float:
    sid = SessionId("kv-measure")
    shard.open_session(sid)
    hidden = np.zeros((1, shard.info.seam.shape[0]), dtype=np.float32)
    tokens = np.asarray([PROMPT[0]], dtype=np.int32)
    sizes = []
    for position in range(65):
        if shard.info.layers.is_head:
            shard.prefill(sid, position, tokens=tokens)
        else:
            shard.prefill(sid, position, hidden=hidden)
        if position in (0, 64):
            sizes.append(shard.kv_state_bytes(sid))
    shard.close_session(sid)
    return (sizes[1] - sizes[0]) / 64 - SNAPSHOT_CELL_META_BYTES


def run() -> Section:
    section = Section(
        "llama.cpp shards: 3 shards in one process vs one full context",
        f"python benchmarks/run.py --only shards  (SmolLM2-135M Q4_1, shards {', '.join(RANGES)}, "
        f"threads {THREADS} per shard = the full context's, {len(PROMPT)}-token prompt, "
        f"{DECODE} greedy tokens, median of {ROUNDS})",
    )
    config = LlamaShardConfig(n_ctx=1024, max_sessions=2, n_threads=THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        full = [LlamaShard(bundled_gguf(), config=config)]
        cut = [LlamaShard.from_model(bundled_gguf(), r, cache_dir=cache, config=config) for r in RANGES]
        keep_paths = [
            write_shard(bundled_gguf(), r, cache / f"keep-{i}.gguf", cut_vocab=False) for i, r in enumerate(RANGES)
        ]
        keep = [LlamaShard(f.path, config=config) for f in keep_paths]
        variants = {"full": full, "cut": cut, "keep": keep}
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for chain in variants.values():
            _decode_rate(chain, -1)  # warm up
        for round_no in range(ROUNDS):
            for name, chain in variants.items():
                rates[name].append(_decode_rate(chain, round_no))
        kv = [(s.info.layers, _kv_bytes_per_token(s), s.info.kv.bytes_per_token) for s in cut]
        weights = [(s.info.layers, s.info.weight_bytes) for s in cut]
        full_weights = full[0].info.weight_bytes
        for chain in variants.values():
            for shard in chain:
                shard.close()
    full_rate, cut_rate, keep_rate = (median(rates[n]) for n in ("full", "cut", "keep"))
    ratio = cut_rate / full_rate
    section.add("full model, one context: decode", f"{full_rate:.1f} tok/s")
    section.add("3 shards, non-tail vocabulary cut to 1 token: decode", f"{cut_rate:.1f} tok/s")
    section.add("decode ratio 3 shards ÷ full", f"{ratio:.3f}", "≥ 0.9", ratio >= 0.9)
    pairs = ", ".join(f"{c / f:.2f}" for c, f in zip(rates["cut"], rates["full"], strict=True))
    section.add("ratio of each round", pairs)
    section.add("3 shards, full vocabulary everywhere (lm_head on every row): decode", f"{keep_rate:.1f} tok/s")
    section.add("speed-up from cutting the vocabulary", f"{cut_rate / keep_rate:.2f}x")
    for layers, measured, formula in kv:
        section.add(
            f"KV bytes/token, shard {layers}: measured ÷ formula",
            f"{measured:.0f} ÷ {formula}",
            "= 1",
            measured == formula,
        )
    for layers, nbytes in weights:
        section.add(f"weights loaded by shard {layers}", f"{nbytes / 2**20:.1f} MiB of {full_weights / 2**20:.1f} MiB")
    section.notes.append(
        "KV measured as the growth of llama.cpp's per-sequence state over 64 positions, less its 12 bytes of "
        "cell metadata per position; formula: per layer (n_embd_k_gqa + n_embd_v_gqa) x 2 bytes (f16)."
    )
    section.notes.append("The head's weights include its embedding table (looked up in NumPy, not by llama.cpp).")
    return section
