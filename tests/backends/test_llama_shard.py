"""llama.cpp shards of the bundled GGUF: parity, sessions, snapshots, accounting, bad inputs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.artifacts.shard_file import write_shard
from meshnet.backends.chain import ChainSession, decode_chain, forward_chain, generate, prefill_chain
from meshnet.backends.llama_shard import SNAPSHOT_CELL_META_BYTES, LlamaShard, LlamaShardConfig
from meshnet.backends.shard import DecodeStep, ShardOutput
from meshnet.errors import (
    ContextOverflow,
    InvalidRequest,
    PositionMismatch,
    SessionBusy,
    SessionGone,
    StoreFull,
)
from meshnet.ids import SessionId
from tests.backends.shard_contract import check_bad_inputs_change_nothing

pytestmark = pytest.mark.real

RANGES = ("0:10", "10:20", "20:30")
N_NEW = 64
KW = {"config": LlamaShardConfig(n_ctx=2048 * 6, max_sessions=6, n_threads=2)}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llama-shards")


@pytest.fixture(scope="module")
def full() -> Iterator[LlamaShard]:
    shard = LlamaShard(bundled_gguf(), **KW)
    yield shard
    shard.close()


def make_chain(cache: Path) -> list[LlamaShard]:
    return [LlamaShard.from_model(bundled_gguf(), r, cache_dir=cache, **KW) for r in RANGES]


@pytest.fixture(scope="module")
def chain(cache: Path) -> Iterator[list[LlamaShard]]:
    shards = make_chain(cache)
    yield shards
    for shard in shards:
        shard.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    import llama_cpp

    vocab = llama_cpp.Llama(str(bundled_gguf()), vocab_only=True, verbose=False)
    texts = [
        "Write a story about a dragon.",
        "What is the capital of France?",
        "List three uses of copper.",
        "Explain photosynthesis to a child.",
    ]
    out = [
        list(vocab.tokenize(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n".encode(), special=True))
        for t in texts
    ]
    vocab.close()
    return out


@pytest.fixture(scope="module")
def reference(full: LlamaShard, prompts: list[list[int]]) -> list[list[int]]:
    return [generate([full], p, N_NEW, chunk=512) for p in prompts]


def test_three_shards_are_token_identical_to_the_full_model(
    chain: list[LlamaShard], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    assert generate(chain, prompts[0], N_NEW, chunk=8) == reference[0]


def test_the_reference_agrees_with_the_single_node_engine(prompts: list[list[int]], reference: list[list[int]]) -> None:
    import threading

    from meshnet.backends.base import TokenStep
    from meshnet.backends.llama_full import LlamaFullEngine
    from meshnet.sampling import Sampler, SamplingParams

    engine = LlamaFullEngine(bundled_gguf(), n_ctx=2048, n_threads=2)
    try:
        steps = engine.generate(prompts[0], Sampler(SamplingParams(temperature=0)), threading.Event())
        tokens: list[int] = []
        for step in steps:
            if isinstance(step, TokenStep):
                tokens.append(step.token)
                if len(tokens) == N_NEW:
                    break
        steps.close()
    finally:
        engine.close()
    assert tokens == reference[0]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunk_sizes_give_identical_tokens(
    chain: list[LlamaShard], prompts: list[list[int]], reference: list[list[int]], chunk: int
) -> None:
    assert generate(chain, prompts[1], N_NEW, chunk=chunk) == reference[1]


def test_four_interleaved_sessions_each_match_their_solo_run(
    chain: list[LlamaShard], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    sids = [SessionId(f"inter-{i}") for i in range(4)]
    for sid in sids:
        for shard in chain:
            shard.open_session(sid)
    # Prefill round-robin, chunk by chunk, then decode round-robin.
    logits = {}
    for begin in range(0, max(len(p) for p in prompts), 5):
        for sid, prompt in zip(sids, prompts, strict=True):
            if begin < len(prompt):
                chunk = np.asarray(prompt[begin : begin + 5], dtype=np.int32)
                logits[sid] = forward_chain(chain, sid, begin, chunk)
    outs: dict[SessionId, list[int]] = {sid: [] for sid in sids}
    positions = {sid: len(p) for sid, p in zip(sids, prompts, strict=True)}
    for _ in range(N_NEW):
        for sid in sids:
            token = int(np.argmax(logits[sid]))
            outs[sid].append(token)
            logits[sid] = decode_chain(chain, sid, positions[sid], token)
            positions[sid] += 1
    for sid in sids:
        for shard in chain:
            shard.close_session(sid)
    assert [outs[sid] for sid in sids] == reference


def test_snapshot_close_restore_into_fresh_shards_continues_identically(
    cache: Path, chain: list[LlamaShard], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    sid = SessionId("snap")
    prompt = prompts[2]
    for shard in chain:
        shard.open_session(sid)
    logits = prefill_chain(chain, sid, prompt, chunk=16)
    out, position = [], len(prompt)
    for _ in range(20):
        token = int(np.argmax(logits))
        out.append(token)
        logits = decode_chain(chain, sid, position, token)
        position += 1
    blobs = [shard.snapshot(sid) for shard in chain]
    for shard in chain:
        shard.close_session(sid)
    fresh = make_chain(cache)
    try:
        for shard, blob in zip(fresh, blobs, strict=True):
            shard.restore(sid, blob)
            assert shard.store.get(sid).position == position
        for _ in range(N_NEW - 20):
            token = int(np.argmax(logits))
            out.append(token)
            logits = decode_chain(fresh, sid, position, token)
            position += 1
        # A snapshot of another layer range is refused with the reason.
        with pytest.raises(InvalidRequest, match="layers"):
            fresh[0].restore(SessionId("wrong"), blobs[1])
    finally:
        for shard in fresh:
            shard.close()
    assert out == reference[2]


@pytest.mark.parametrize("kept_as", ["snapshot", "parked"])
def test_a_session_adopting_cached_blocks_computes_the_bits_of_a_cold_prefill(
    chain: list[LlamaShard], prompts: list[list[int]], kept_as: str
) -> None:
    """The prefix cache's premise (node.prefix_cache): KV of whole 128-position chunks, kept after a
    session decoded past them and cut back to a block boundary, gives a later session — which
    prefills only the rest, in the same aligned chunks — the logits of a cold prefill to the bit.
    128 is past the 63 rows where llama.cpp's kernels change, so a wrong chunk would show. The KV
    is kept as host bytes (a snapshot) or parked in its own llama.cpp sequence (``ShardBase.park``)."""
    block = 128
    history = [t for p in prompts for t in p] * 8  # ~500 tokens
    first, later = history[:260], history[:300]
    kept = 2 * block
    sid, new, ref = SessionId("turn1"), SessionId("turn2"), SessionId("cold")
    for shard in chain:
        shard.open_session(sid)
    logits = prefill_chain(chain, sid, first, chunk=block)
    position = len(first)
    for _ in range(5):  # decode steps past the prompt: not cached
        logits = decode_chain(chain, sid, position, int(np.argmax(logits)))
        position += 1
    blobs, parked = [], []
    for shard in chain:
        if kept_as == "parked":
            parked.append(shard.park(sid, kept))
            blobs.append(b"")
            continue
        shard.rewind(sid, kept)
        blobs.append(shard.snapshot(sid))
        shard.close_session(sid)
    fillers = [SessionId(f"filler-{i}") for i in range(KW["config"].max_sessions - 2 - len(parked[:1]))]
    try:
        for i, (shard, blob) in enumerate(zip(chain, blobs, strict=True)):
            shard.open_session(new)
            shard.open_session(ref)
            for filler in fillers:  # every llama.cpp sequence taken: the KV goes into the session's own
                shard.open_session(filler)
            # one block fewer than kept: the KV is cut on adoption
            if parked:
                shard.adopt_parked(new, parked[i], block)
                assert parked[i].held  # still there for the next session
            else:
                shard.adopt(new, blob, block)
            assert shard.store.get(new).position == block
        warm = prefill_chain(chain, new, later[block:], chunk=block, start=block)
        cold = prefill_chain(chain, ref, later, chunk=block)
        assert np.array_equal(warm, cold)
        for _ in range(8):
            token = int(np.argmax(cold))
            warm = decode_chain(chain, new, position_of(chain, new), token)
            cold = decode_chain(chain, ref, position_of(chain, ref), token)
            assert np.array_equal(warm, cold)
        if parked:  # a live session takes the parked sequence's room: it is gone
            chain[0].close_session(new)
            chain[0].open_session(SessionId("past"))
            chain[0].open_session(new)
            assert not parked[0].held
            with pytest.raises(SessionGone, match="evicted"):
                chain[0].adopt_parked(new, parked[0], block)
            assert chain[0].store.get(new).position == 0
            chain[0].close_session(SessionId("past"))
            return
        # adoption only into a fresh session, and never past the snapshot
        with pytest.raises(PositionMismatch):
            chain[0].adopt(new, blobs[0], block)
        chain[0].close_session(fillers[0])
        chain[0].open_session(SessionId("past"))
        with pytest.raises(InvalidRequest, match="cannot give"):
            chain[0].adopt(SessionId("past"), blobs[0], 3 * block)
        assert chain[0].store.get(SessionId("past")).position == 0
        chain[0].close_session(SessionId("past"))
    finally:
        for shard in chain:
            for s in (new, ref, *fillers):
                if s in shard.store.ids():
                    shard.close_session(s)
        for shard, p in zip(chain, parked, strict=False):
            shard.release(p)


def position_of(chain: list[LlamaShard], sid: SessionId) -> int:
    return chain[0].store.get(sid).position


def test_no_recompute_and_kv_grows_linearly(chain: list[LlamaShard], prompts: list[list[int]]) -> None:
    sid = SessionId("linear")
    prompt = prompts[0]
    for shard in chain:
        shard.open_session(sid)
    logits = prefill_chain(chain, sid, prompt, chunk=8)
    position = len(prompt)
    sizes = []
    for step in range(12):
        before = [shard.store.get(sid).positions_processed for shard in chain]
        logits = decode_chain(chain, sid, position, int(np.argmax(logits)))
        position += 1
        after = [shard.store.get(sid).positions_processed for shard in chain]
        assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]
        if step % 4 == 0:
            sizes.append((position, [shard.kv_state_bytes(sid) for shard in chain]))
    for shard in chain:
        assert shard.store.get(sid).positions_processed == position
        per_token = shard.info.kv.bytes_per_token
        assert per_token == 10 * (2 * 3 * 64) * 2  # 10 layers x (K+V) x 3 kv heads x 64 dims x f16
        assert shard.store.session_bytes(sid) == per_token * position
    (p0, s0), (p1, s1), (p2, s2) = sizes
    for i, shard in enumerate(chain):
        # What llama.cpp serializes per position: the K and V rows plus the cell's metadata.
        per_token = shard.info.kv.bytes_per_token + SNAPSHOT_CELL_META_BYTES
        assert s1[i] - s0[i] == per_token * (p1 - p0)
        assert s2[i] - s1[i] == per_token * (p2 - p1)
    for shard in chain:
        shard.close_session(sid)


def test_each_shard_loads_only_its_tensors(cache: Path, full: LlamaShard) -> None:
    files = write_shard(bundled_gguf(), "10:20", cache / "only-10-20.gguf")
    middle = LlamaShard(files.path, **KW)
    try:
        assert middle.info.weight_bytes == files.tensor_bytes
        blocks = files.tensor_bytes
        assert blocks < 0.36 * full.info.weight_bytes  # a third of the blocks, no vocab-sized tensors
        assert middle.info.n_vocab == 1
    finally:
        middle.close()


def test_the_tail_computes_without_its_tokenizer_and_reads_it_for_a_grammar(chain: list[LlamaShard]) -> None:
    import llama_cpp

    tail = chain[-1]
    # llama.cpp holds the vocabulary as dummies (no token maps, merges or pieces): logits of every token.
    vocab = llama_cpp.llama_model_get_vocab(tail._model)
    assert llama_cpp.llama_vocab_type(vocab) == llama_cpp.LLAMA_VOCAB_TYPE_NONE
    assert tail.info.n_vocab == 49152
    words = llama_cpp.Llama(str(bundled_gguf()), vocab_only=True, verbose=False)
    yes, hello = (words.tokenize(w.encode(), add_bos=False)[0] for w in ("yes", "hello"))
    words.close()
    grammar = tail.grammar('root ::= "yes" | "no"')
    assert grammar.allows(yes) and not grammar.allows(hello)
    assert tail.grammar('root ::= "no"').allows(hello) is False  # the tokenizer is read once, then kept


def test_a_tail_refuses_more_rows_of_logits_than_it_reserved_and_changes_nothing(chain: list[LlamaShard]) -> None:
    tail, sid = chain[-1], SessionId("many-logits")
    tail.open_session(sid)
    rows = tail.info.max_verify + 1
    try:
        # llama.cpp sizes the tail's output for a verify chunk or a batch of sessions, and would abort past it.
        with pytest.raises(InvalidRequest, match=f"at most {max(rows, 6)} per call"):
            tail.prefill(sid, 0, hidden=np.zeros((64, 576), dtype=np.float32), all_logits=True)
        out = tail.prefill(sid, 0, hidden=np.zeros((rows, 576), dtype=np.float32), all_logits=True)
        assert out.logits is not None and out.logits.shape == (rows, 49152)
    finally:
        tail.close_session(sid)


def test_bad_inputs_raise_named_errors_and_change_nothing(
    chain: list[LlamaShard], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    middle = chain[1]
    sid = SessionId("bad")
    prompt = prompts[3]
    for shard in chain:
        shard.open_session(sid)
    logits = prefill_chain(chain, sid, prompt, chunk=64)
    position = len(prompt)
    check_bad_inputs_change_nothing(chain, sid, position)
    out = []
    for _ in range(N_NEW):
        token = int(np.argmax(logits))
        out.append(token)
        logits = decode_chain(chain, sid, position, token)
        position += 1
    assert out == reference[3]
    for shard in chain:
        shard.close_session(sid)
    with pytest.raises(SessionGone, match="closed"):
        middle.decode_step(sid, position, hidden=np.zeros((1, 576), dtype=np.float32))


def test_store_full_is_named_and_leaves_sessions_intact(cache: Path) -> None:
    # 128 cells for 2 sessions: each session's context holds 64 positions.
    config = LlamaShardConfig(n_ctx=128, max_sessions=2, n_threads=2)
    small = LlamaShard.from_model(bundled_gguf(), "20:30", cache_dir=cache, config=config)
    try:
        hidden = np.random.default_rng(0).standard_normal((40, 576)).astype(np.float32)
        a, b, c = SessionId("a"), SessionId("b"), SessionId("c")
        small.open_session(a)
        first = small.prefill(a, 0, hidden=hidden).logits
        with pytest.raises(ContextOverflow, match="capped at 64"):
            small.prefill(a, 40, hidden=hidden[:30])
        assert small.store.get(a).position == 40
        small.open_session(b)
        with pytest.raises(StoreFull, match="maximum of 2 sessions"):
            small.open_session(c)
        small.prefill(a, 40, hidden=hidden[:24])  # what fits still works
        assert small.store.get(a).position == 64
        # The rejected calls left no trace: a fresh session given the same input agrees.
        again = small.prefill(b, 0, hidden=hidden).logits
        assert first is not None and again is not None and np.array_equal(first, again)
    finally:
        small.close()


def test_a_second_concurrent_call_on_one_session_is_refused(chain: list[LlamaShard]) -> None:
    tail = chain[2]
    sid = SessionId("busy")
    tail.open_session(sid)
    with tail.store.use(sid, 0, 1), pytest.raises(SessionBusy):
        tail.decode_step(sid, 0, hidden=np.zeros((1, 576), dtype=np.float32))
    tail.close_session(sid)


def test_a_verify_chunk_past_the_kv_padding_keeps_the_bits_of_steps(
    chain: list[LlamaShard], prompts: list[list[int]]
) -> None:
    # Past 256 cells llama.cpp sums a lone row's attention in per-thread parts (2 threads here),
    # a chunk's in one pass: the shards measured it and verify position by position there.
    assert [(s.info.verify_batched, s.info.verify_batched_below) for s in chain] == [(True, 256)] * 3
    long = (prompts[0] * 20)[:300]
    plain, spec = ChainSession(chain), ChainSession(chain)
    logits = plain.prefill(long, 64)
    spec.prefill(long, 64)
    tokens, rows = [], []
    for _ in range(5):
        tokens.append(int(np.argmax(logits)))
        logits = plain.step(tokens[-1])
        rows.append(logits)
    verified = spec.verify(tokens)
    plain.close()
    spec.close()
    assert all(np.array_equal(v, r) for v, r in zip(verified, rows, strict=True))


@pytest.fixture(scope="module")
def one_thread_chain(cache: Path) -> Iterator[list[LlamaShard]]:
    config = LlamaShardConfig(n_ctx=1024 * 6, max_sessions=6, n_threads=1)
    shards = [LlamaShard.from_model(bundled_gguf(), r, cache_dir=cache, config=config) for r in RANGES]
    yield shards
    for shard in shards:
        shard.close()


def _decode_together(shards: list[LlamaShard], steps: list[DecodeStep]) -> list[ShardOutput | Exception]:
    """One batched decode step of several sessions through every shard; a failed step stops there."""
    outs: list[ShardOutput | Exception] = list(shards[0].decode_many(steps))
    for shard in shards[1:]:
        live = [i for i, o in enumerate(outs) if isinstance(o, ShardOutput)]
        got = shard.decode_many([replace(steps[i], token=None, hidden=outs[i].hidden) for i in live])  # type: ignore[union-attr]
        for i, o in zip(live, got, strict=True):
            outs[i] = o
    return outs


@pytest.mark.parametrize("threads", [1, 2])
def test_sessions_decoded_as_one_batch_match_their_solo_runs(
    one_thread_chain: list[LlamaShard], chain: list[LlamaShard], prompts: list[list[int]], threads: int
) -> None:
    shards = one_thread_chain if threads == 1 else chain
    # measured at load: with one thread a batch keeps the bits of lone steps everywhere; with two,
    # below 256 positions only (the long session computes alone there)
    below = None if threads == 1 else 256
    assert [(s.info.decode_batch, s.info.decode_batch_below) for s in shards] == [(6, below)] * 3
    texts = [prompts[0], (prompts[1] * 30)[:300], prompts[2], prompts[3]]  # one past 256 cells
    solo = [generate(shards, p, 24, chunk=64) for p in texts]
    sids = [SessionId(f"batch-{threads}-{i}") for i in range(len(texts))]
    logits, positions = {}, {}
    for sid, text in zip(sids, texts, strict=True):
        for shard in shards:
            shard.open_session(sid)
        logits[sid] = prefill_chain(shards, sid, text, chunk=64)
        positions[sid] = len(text)
    outs: dict[SessionId, list[int]] = {sid: [] for sid in sids}
    for n in range(24):
        steps = []
        for sid in sids:
            outs[sid].append(int(np.argmax(logits[sid])))
            steps.append(DecodeStep(sid, positions[sid], token=outs[sid][-1]))
        if n == 5:  # a step at a wrong position fails alone and changes nothing
            bad = _decode_together(shards, [replace(steps[0], position=positions[sids[0]] + 3), *steps[1:2]])
            assert isinstance(bad[0], PositionMismatch) and isinstance(bad[1], ShardOutput)
            for shard in shards:
                shard.rewind(sids[1], positions[sids[1]])
        results = _decode_together(shards, steps)
        for sid, out in zip(sids, results, strict=True):
            assert isinstance(out, ShardOutput) and out.logits is not None
            logits[sid] = out.logits
            positions[sid] += 1
    for sid in sids:
        for shard in shards:
            shard.close_session(sid)
    assert [outs[sid] for sid in sids] == solo


def test_a_second_load_reads_the_load_checks_from_the_cache(cache: Path, tmp_path: Path) -> None:
    """The bit checks run once per shard file, build, thread count and shapes; the next load of the same
    shard finds the same answers on disk without measuring (llama_shard's measurement is not called)."""
    config = LlamaShardConfig(n_ctx=1024 * 4, max_sessions=4, n_threads=1, checks_cache=tmp_path / "checks")
    first = LlamaShard.from_model(bundled_gguf(), "10:20", cache_dir=cache, config=config)
    first.close()
    assert len(list((tmp_path / "checks").glob("*.json"))) == 1

    def measured(*_: object) -> tuple[bool, bool]:
        raise AssertionError("the cached load checks were measured again")

    patch = pytest.MonkeyPatch()
    patch.setattr(LlamaShard, "_batch_matches_steps", measured)
    patch.setattr(LlamaShard, "_batch_matches_solo", measured)
    try:
        second = LlamaShard.from_model(bundled_gguf(), "10:20", cache_dir=cache, config=config)
    finally:
        patch.undo()
    assert second.info == first.info and first.info.decode_batch == 4
    second.close()
    # other threads: another key, measured anew
    other = LlamaShard.from_model(bundled_gguf(), "10:20", cache_dir=cache, config=replace(config, n_threads=2))
    other.close()
    assert len(list((tmp_path / "checks").glob("*.json"))) == 2
