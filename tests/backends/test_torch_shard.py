"""PyTorch shards of the bundled GGUF (SmolLM2-135M, llama): parity with transformers' ``generate``,
chunking, snapshots, KV accounting, bfloat16 and bad inputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.backends.chain import ChainSession, decode_chain, prefill_chain
from meshnet.backends.llama_vocab import LlamaVocab
from meshnet.backends.torch_gguf import GgufCheckpoint
from meshnet.backends.torch_shard import TorchShard
from meshnet.errors import (
    InvalidRequest,
    SessionGone,
)
from meshnet.ids import SessionId
from meshnet.layers import LayerRange
from tests.backends.shard_contract import check_bad_inputs_change_nothing

pytestmark = pytest.mark.real

RANGES = ((0, 10), (10, 20), (20, 30))
N_NEW = 64
HIDDEN = 576


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a shared 2-core machine two spinning threads slow decode from
    ~10 tok/s to under 1; tests must not depend on having the machine alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint() -> GgufCheckpoint:
    return GgufCheckpoint(bundled_gguf())


def make_chain(checkpoint: GgufCheckpoint, dtype: torch.dtype = torch.float32) -> list[TorchShard]:
    return [TorchShard.from_gguf(checkpoint, LayerRange(a, b, 30), torch_dtype=dtype) for a, b in RANGES]


@pytest.fixture(scope="module")
def chain(checkpoint: GgufCheckpoint) -> Iterator[list[TorchShard]]:
    shards = make_chain(checkpoint)
    yield shards
    for shard in shards:
        shard.close()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    """A chat prompt of ~30 tokens, tokenized by llama.cpp's own vocabulary."""
    vocab = LlamaVocab(bundled_gguf())
    try:
        return vocab.tokenize(
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "Write a short story about a dragon who learns to bake bread.<|im_end|>\n<|im_start|>assistant\n",
            add_special=True,
        )
    finally:
        vocab.close()


@pytest.fixture(scope="module")
def full_model(checkpoint: GgufCheckpoint) -> PreTrainedModel:
    """The whole model, built by transformers from the same dequantized weights."""
    return checkpoint.causal_lm(torch.float32)


@pytest.fixture(scope="module")
def reference(full_model: PreTrainedModel, prompt: list[int]) -> list[int]:
    """transformers' own greedy ``generate``."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = full_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
    return [int(t) for t in out[0, ids.shape[1] :]]


@pytest.mark.parametrize(("chunk", "n_new"), [(7, N_NEW), (1, 24), (64, 24)])
def test_three_shards_match_generate_at_every_chunk_size_without_recompute(
    chain: list[TorchShard], prompt: list[int], reference: list[int], chunk: int, n_new: int
) -> None:
    session = ChainSession(chain)
    logits = session.prefill(prompt, chunk)
    out: list[int] = []
    for i in range(n_new):
        out.append(int(np.argmax(logits)))
        if i + 1 < n_new:
            before = [shard.store.get(session.sid).positions_processed for shard in chain]
            logits = session.step(out[-1])
            after = [shard.store.get(session.sid).positions_processed for shard in chain]
            assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]
    total = len(prompt) + n_new - 1  # the last token is returned, never fed back
    assert [shard.store.get(session.sid).positions_processed for shard in chain] == [total] * 3
    session.close()
    assert out == reference[:n_new]


def test_each_shard_keeps_only_its_weights(full_model: PreTrainedModel, chain: list[TorchShard]) -> None:
    head, middle, tail = chain
    full: Any = full_model
    blocks = [sum(p.nbytes for p in layer.parameters()) for layer in full.model.layers]
    embed = full.model.embed_tokens.weight.nbytes
    assert middle.modules.embed is None and middle.modules.lm_head is None and middle.modules.norm is None
    assert middle.info.weight_bytes == sum(blocks[10:20])
    assert abs(middle.info.weight_bytes - sum(blocks) / 3) < 0.01 * sum(blocks)
    assert head.info.weight_bytes == sum(blocks[:10]) + embed
    assert head.modules.lm_head is None and tail.modules.embed is None
    # SmolLM2 ties the lm_head to the embeddings: the tail holds that matrix (as its lm_head) and the norm.
    assert tail.info.weight_bytes == sum(blocks[20:]) + embed + full.model.norm.weight.nbytes
    assert [s.info.seam.shape for s in chain] == [(HIDDEN,)] * 3
    assert not any(s.info.seam.carries_token_ids for s in chain)


def test_snapshot_close_restore_into_fresh_shards_continues_identically(
    checkpoint: GgufCheckpoint, chain: list[TorchShard], prompt: list[int], reference: list[int]
) -> None:
    session = ChainSession(chain, SessionId("snap"))
    logits = session.prefill(prompt, 16)
    out: list[int] = []
    for _ in range(8):
        out.append(int(np.argmax(logits)))
        logits = session.step(out[-1])
    blobs = session.snapshot()
    session.close()
    fresh = make_chain(checkpoint)
    try:
        for shard, blob in zip(fresh, blobs, strict=True):
            shard.restore(session.sid, blob)
            assert shard.store.get(session.sid).position == session.position
        resumed = ChainSession(fresh, session.sid, position=session.position, opened=True)
        out += resumed.generate(logits, 24 - 8)
        with pytest.raises(InvalidRequest, match="layers"):
            fresh[0].restore(SessionId("wrong"), blobs[1])  # another layer range's snapshot
    finally:
        for shard in fresh:
            shard.close()
    assert out == reference[:24]


def test_a_session_adopting_cached_blocks_gets_the_logits_of_a_cold_prefill(
    chain: list[TorchShard], prompt: list[int]
) -> None:
    """The prefix cache on PyTorch shards (node.prefix_cache): full-attention K/V rows are cut back
    to a block boundary (``DynamicLayer.crop``), so a session that decoded past its prompt leaves
    KV a later session adopts; the rest, prefilled in the same aligned chunks, gives a cold
    prefill's logits exactly."""
    block = 8
    first, later = prompt[:28], prompt[:30]
    sid, new, cold = SessionId("torch-turn1"), SessionId("torch-turn2"), SessionId("torch-cold")
    for shard in chain:
        shard.open_session(sid)
    logits = prefill_chain(chain, sid, first, chunk=block)
    for position in range(len(first), len(first) + 3):
        logits = decode_chain(chain, sid, position, int(np.argmax(logits)))
    blobs = []
    for shard in chain:
        shard.rewind(sid, 3 * block)
        blobs.append(shard.snapshot(sid))
        shard.close_session(sid)
    try:
        for shard, blob in zip(chain, blobs, strict=True):
            shard.open_session(new)
            shard.adopt(new, blob, 2 * block)
            shard.open_session(cold)
        warm = prefill_chain(chain, new, later[2 * block :], chunk=block, start=2 * block)
        assert np.array_equal(warm, prefill_chain(chain, cold, later, chunk=block))
    finally:
        for shard in chain:
            for s in (new, cold):
                if s in shard.store.ids():
                    shard.close_session(s)


def test_kv_bytes_grow_by_the_formula(chain: list[TorchShard], prompt: list[int]) -> None:
    for shard in chain:
        kv = shard.info.kv
        assert kv.bytes_per_token == 10 * 2 * 3 * 64 * 4  # 10 layers x (K, V) x 3 kv heads x 64 x fp32
        assert kv.fixed_bytes == 0 and kv.per_layer_bytes_per_token == (2 * 3 * 64 * 4,) * 10
        assert shard.store.limits.bytes_per_token == kv.bytes_per_token
    session = ChainSession(chain)
    logits = session.prefill(prompt, 8)
    for _ in range(6):
        measured = [shard.state_bytes(session.sid) for shard in chain]
        assert measured == [shard.info.kv.bytes_per_token * session.position for shard in chain]
        assert measured == [shard.store.session_bytes(session.sid) for shard in chain]
        logits = session.step(int(np.argmax(logits)))
    session.close()


def test_bfloat16_shards_run_and_stay_sane(checkpoint: GgufCheckpoint, prompt: list[int], reference: list[int]) -> None:
    shards = make_chain(checkpoint, torch.bfloat16)
    try:
        assert {s.info.kv.dtype for s in shards} == {"bfloat16"}
        assert shards[1].info.kv.bytes_per_token == 10 * 2 * 3 * 64 * 2
        session = ChainSession(shards)
        logits = session.prefill(prompt, 16)
        assert logits.dtype == np.float32 and np.isfinite(logits).all()
        assert reference[0] in np.argsort(logits)[-5:]  # the fp32 choice is among bf16's top 5
        out = session.generate(logits, 12)
        assert [s.state_bytes(session.sid) for s in shards] == [
            s.info.kv.bytes_per_token * session.position for s in shards
        ]
        session.close()
        assert len(set(out)) > 3 and all(0 <= t < 49152 for t in out)
    finally:
        for shard in shards:
            shard.close()


def test_bad_inputs_raise_named_errors_and_change_nothing(
    chain: list[TorchShard], prompt: list[int], reference: list[int]
) -> None:
    middle = chain[1]
    sid = SessionId("bad")
    for shard in chain:
        shard.open_session(sid)
    logits = prefill_chain(chain, sid, prompt, chunk=64)
    position = len(prompt)
    check_bad_inputs_change_nothing(chain, sid, position)
    for shard in chain:
        assert shard.state_bytes(sid) == shard.info.kv.bytes_per_token * position  # nothing appended
    out: list[int] = []
    for _ in range(8):
        out.append(int(np.argmax(logits)))
        logits = decode_chain(chain, sid, position, out[-1])
        position += 1
    assert out == reference[:8]
    for shard in chain:
        shard.close_session(sid)
    with pytest.raises(SessionGone, match="closed"):
        middle.decode_step(sid, position, hidden=np.zeros((1, HIDDEN), dtype=np.float32))


@pytest.mark.parametrize(
    ("arch", "extra", "reason"),
    [("qwen2", None, "qwen2"), ("llama", "llama.rope.scaling.type", "rope.scaling")],
)
def test_ggufs_the_torch_backend_cannot_map_are_refused(
    tmp_path: Path, arch: str, extra: str | None, reason: str
) -> None:
    import gguf

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if extra is not None:
        writer.add_string(extra, "linear")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidRequest, match=reason):
        GgufCheckpoint(path)
