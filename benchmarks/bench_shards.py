"""llama.cpp shards in one process vs one full context, and what cutting the vocabulary saves.

All variants run in this process one after another (never concurrently), each with all cores:
only one shard computes at a time in an in-process chain, so the total thread count matches the
full context's. Rounds alternate between variants so drift on a shared VM hits all alike.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
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


def _middle_steps_ms(cache: Path, steps: int = 300) -> dict[str, float]:
    """A middle shard's one-position decode step (layers 10:20, 1 thread) through each eval callback,
    the two shards' steps interleaved so drift hits both alike: median ms, in a loop ("python",
    "compiled") and each after 64 MiB went through the caches ("python cold", "compiled cold"), as on
    a route, where a hop's step follows the other hops' (bench route: 'a hop reading a STEP frame')."""
    rows = np.random.default_rng(0).standard_normal((129, 576)).astype(np.float32)
    sid = SessionId("bench-middle")
    shards = {
        kind: LlamaShard.from_model(
            bundled_gguf(),
            "10:20",
            cache_dir=cache,
            config=LlamaShardConfig(n_ctx=1024, max_sessions=2, n_threads=1, eval_callback=kind),
        )
        for kind in ("python", "compiled")
    }
    times: dict[str, list[float]] = {f"{kind}{cold}": [] for kind in shards for cold in ("", " cold")}
    stream = np.ones(8 << 20)  # 64 MiB
    try:
        for shard in shards.values():
            shard.open_session(sid)
            shard.prefill(sid, 0, hidden=rows[:128])
        for _ in range(steps):
            for cold in ("", " cold"):
                for kind, shard in shards.items():
                    if cold:
                        stream.sum()
                    began = time.perf_counter()
                    shard.decode_step(sid, 128, hidden=rows[128:])
                    times[f"{kind}{cold}"].append(time.perf_counter() - began)
                    shard.rewind(sid, 128)
    finally:
        for shard in shards.values():
            shard.close()
    return {kind: median(t) * 1e3 for kind, t in times.items()}


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
        python_config = dataclasses.replace(config, eval_callback="python")
        python = [LlamaShard.from_model(bundled_gguf(), r, cache_dir=cache, config=python_config) for r in RANGES]
        variants = {"full": full, "cut": cut, "keep": keep, "python": python}
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for chain in variants.values():
            _decode_rate(chain, -1)  # warm up
        for round_no in range(ROUNDS):
            for name, chain in variants.items():
                rates[name].append(_decode_rate(chain, round_no))
        kv = [(s.info.layers, _kv_bytes_per_token(s), s.info.kv.bytes_per_token) for s in cut]
        weights = [(s.info.layers, s.info.weight_bytes) for s in cut]
        full_weights = full[0].info.weight_bytes
        callbacks = [s.eval_callback for s in cut]
        for chain in variants.values():
            for shard in chain:
                shard.close()
        middle = _middle_steps_ms(cache)
    full_rate, cut_rate, keep_rate = (median(rates[n]) for n in ("full", "cut", "keep"))
    ratio = cut_rate / full_rate
    section.add("full model, one context: decode", f"{full_rate:.1f} tok/s")
    section.add("3 shards, non-tail vocabulary cut to 1 token: decode", f"{cut_rate:.1f} tok/s")
    section.add("decode ratio 3 shards ÷ full", f"{ratio:.3f}", "≥ 0.9", ratio >= 0.9)
    pairs = ", ".join(f"{c / f:.2f}" for c, f in zip(rates["cut"], rates["full"], strict=True))
    section.add("ratio of each round", pairs)
    section.add("3 shards, full vocabulary everywhere (lm_head on every row): decode", f"{keep_rate:.1f} tok/s")
    section.add("speed-up from cutting the vocabulary", f"{cut_rate / keep_rate:.2f}x")
    python_rate = median(rates["python"])
    section.add("3 shards, the eval callback in Python: decode", f"{python_rate:.1f} tok/s")
    section.add(
        f"eval callback in C ({', '.join(str(c) for c in callbacks)}) ÷ Python, 3 shards",
        f"{cut_rate / python_rate:.3f}",
    )
    section.add(
        "a middle shard's decode step (10:20, 1 thread): Python callback / C callback",
        f"{middle['python']:.2f} / {middle['compiled']:.2f} ms ({middle['python'] - middle['compiled']:.2f} ms saved)",
    )
    section.add(
        "the same, each step after 64 MiB through the caches (as on a route)",
        f"{middle['python cold']:.2f} / {middle['compiled cold']:.2f} ms "
        f"({middle['python cold'] - middle['compiled cold']:.2f} ms saved)",
    )
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
    section.notes.append(
        "llama.cpp calls a shard's eval callback for every node of every graph (~330 a step on 10 layers) to find "
        "the one whose output crosses the seam; in Python each is a trip into the interpreter, in C "
        "(backends/_capture.c) none is. The tail of this family needs no callback, so a 3-shard chain saves on two."
    )
    return section
