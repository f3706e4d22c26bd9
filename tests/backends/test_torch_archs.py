"""PyTorch shards of tiny random DeepSeek-V4 and Qwen3.5-MoE (hybrid) models: split parity with
``generate``, chunking, interleaving, snapshots, state accounting, rollback and store limits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from meshnet.backends.chain import ChainSession, generate
from meshnet.backends.tiny_models import VOCAB, tiny_deepseek_v4, tiny_glm_moe_dsa, tiny_llama, tiny_qwen3_5_moe
from meshnet.backends.torch_shard import StoreBudget, TorchShard
from meshnet.errors import EngineError, InvalidRequest, SeamMismatch, StoreFull
from meshnet.ids import SessionId
from meshnet.layers import LayerRange

N_NEW = 32
SPLITS = {
    "deepseek_v4": ((0, 1), (1, 3), (3, 4)),  # a hash-routed head, sliding + CSA, HCA tail
    "qwen3_5_moe_text": ((0, 2), (2, 4)),  # linear + linear, linear + full attention
    "llama": ((0, 2), (2, 4)),
    "glm_moe_dsa": ((0, 2), (2, 4)),  # each range opens on a layer computing its own top-k
}
BUILDERS: dict[str, Callable[[], PreTrainedModel]] = {
    "deepseek_v4": tiny_deepseek_v4,
    "qwen3_5_moe_text": tiny_qwen3_5_moe,
    "llama": tiny_llama,
    "glm_moe_dsa": tiny_glm_moe_dsa,
}
HYBRID = "qwen3_5_moe_text"


def _prompt(seed: int, n: int = 21) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, n)]


def _shards(model: PreTrainedModel, name: str, **kwargs: Any) -> list[TorchShard]:
    return [TorchShard.from_model(model, LayerRange(a, b, 4), **kwargs) for a, b in SPLITS[name]]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and spinning threads on a shared 2-core
    machine slow them twentyfold (two busy processes on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models() -> dict[str, PreTrainedModel]:
    return {name: build() for name, build in BUILDERS.items()}


@pytest.fixture(scope="module")
def routes(models: dict[str, PreTrainedModel]) -> Iterator[dict[str, list[TorchShard]]]:
    out = {name: _shards(model, name) for name, model in models.items()}
    yield out
    for shards in out.values():
        for shard in shards:
            shard.close()


@pytest.fixture(scope="module")
def reference(models: dict[str, PreTrainedModel]) -> dict[str, list[int]]:
    """transformers' greedy ``generate`` on each whole model."""
    out = {}
    for name, model in models.items():
        prompt = torch.tensor([_prompt(0)])
        with torch.inference_mode():
            tokens = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=N_NEW, do_sample=False
            )
        out[name] = [int(t) for t in tokens[0, prompt.shape[1] :]]
    return out


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("name", ["deepseek_v4", HYBRID, "glm_moe_dsa"])
def test_split_route_matches_generate_at_every_chunk_size(
    routes: dict[str, list[TorchShard]],
    reference: dict[str, list[int]],
    models: dict[str, PreTrainedModel],
    name: str,
    chunk: int,
) -> None:
    got = generate(routes[name], _prompt(0), N_NEW, chunk=chunk)
    if name == "glm_moe_dsa" and chunk == 1:
        # DSA's top-8 selection flips on the last bits, which one-position prefill chunks change for
        # the whole model too (other matmul shapes): the reference is the whole model, same chunks.
        whole = TorchShard.from_model(models[name], LayerRange(0, 4, 4))
        assert got == generate([whole], _prompt(0), N_NEW, chunk=chunk)
        whole.close()
    else:
        assert got == reference[name]


def test_deepseek_seam_carries_every_hyper_connection_stream_and_the_token_ids(
    routes: dict[str, list[TorchShard]],
) -> None:
    head, middle, tail = routes["deepseek_v4"]
    assert {s.info.seam.shape for s in (head, middle, tail)} == {(4, 64)}  # hc_mult x hidden
    assert all(s.info.seam.carries_token_ids for s in (head, middle, tail))
    sid = SessionId("seam")
    middle.open_session(sid)
    hidden = np.zeros((3, 4, 64), dtype=np.float32)
    with pytest.raises(SeamMismatch, match="token ids"):
        middle.prefill(sid, 0, hidden=hidden)
    with pytest.raises(SeamMismatch, match="shape"):
        middle.prefill(sid, 0, tokens=np.arange(3, dtype=np.int32), hidden=np.zeros((3, 64), dtype=np.float32))
    out = middle.prefill(sid, 0, tokens=np.arange(3, dtype=np.int32), hidden=hidden)
    assert out.hidden is not None and out.hidden.shape == (3, 4, 64) and out.hidden.dtype == np.float32
    middle.close_session(sid)


@pytest.mark.parametrize("name", ["llama", HYBRID, "glm_moe_dsa"])
def test_four_interleaved_sessions_each_match_their_solo_run(routes: dict[str, list[TorchShard]], name: str) -> None:
    shards = routes[name]
    prompts = [_prompt(seed, 15 + 3 * seed) for seed in range(4)]
    solo = [generate(shards, p, 16) for p in prompts]
    sessions = [ChainSession(shards) for _ in prompts]
    logits: list[Any] = [None] * 4
    for begin in range(0, max(map(len, prompts)), 4):
        for i, (session, prompt) in enumerate(zip(sessions, prompts, strict=True)):
            if begin < len(prompt):
                logits[i] = session.prefill(prompt[begin : begin + 4], 4)
    outs: list[list[int]] = [[] for _ in prompts]
    for step in range(16):
        for i, session in enumerate(sessions):
            outs[i].append(int(np.argmax(logits[i])))
            if step + 1 < 16:
                logits[i] = session.step(outs[i][-1])
    for session in sessions:
        session.close()
    assert outs == solo


@pytest.mark.parametrize("name", ["deepseek_v4", HYBRID, "glm_moe_dsa"])
def test_snapshot_close_restore_into_fresh_shards_continues_identically(
    models: dict[str, PreTrainedModel],
    routes: dict[str, list[TorchShard]],
    reference: dict[str, list[int]],
    name: str,
) -> None:
    session = ChainSession(routes[name])
    logits = session.prefill(_prompt(0), 8)
    out = session.generate(logits, 12)
    logits = session.step(out[-1])
    blobs = session.snapshot()
    session.close()
    fresh = _shards(models[name], name)
    for shard, blob in zip(fresh, blobs, strict=True):
        shard.restore(session.sid, blob)
    resumed = ChainSession(fresh, session.sid, position=session.position, opened=True)
    out += resumed.generate(logits, N_NEW - 12)
    resumed.close()
    assert out == reference[name]


@pytest.mark.parametrize("name", ["llama", "deepseek_v4", HYBRID, "glm_moe_dsa"])
def test_measured_state_bytes_follow_the_formula(routes: dict[str, list[TorchShard]], name: str) -> None:
    shards = routes[name]
    session = ChainSession(shards)
    logits = session.prefill(_prompt(1, 3), 3)
    for _ in range(40):  # past DeepSeek's 16-token window and several CSA windows
        for shard in shards:
            measured = shard.state_bytes(session.sid)
            assert measured == shard.expected_state_bytes(session.position)
            assert measured <= shard.store.session_bytes(session.sid)  # the store's model is an upper bound
            kv = shard.info.kv
            if name != "deepseek_v4":  # linear (+ fixed for the hybrid's recurrent layers): exact
                assert measured == kv.fixed_bytes + kv.bytes_per_token * session.position
        logits = session.step(int(np.argmax(logits)))
    session.close()
    if name == HYBRID:
        first, second = (s.info.kv for s in shards)
        assert first.bytes_per_token == 0 and first.fixed_bytes > 0  # two linear-attention layers
        assert second.per_layer_bytes_per_token == (0, 2 * 2 * 16 * 4)  # linear, then full attention


def test_a_failed_forward_rolls_the_hybrid_state_back(
    routes: dict[str, list[TorchShard]], reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = routes[HYBRID]
    session = ChainSession(shards)
    logits = session.prefill(_prompt(0), 64)
    out = [int(np.argmax(logits))]
    last = shards[1].modules.blocks[-1]  # full attention, after a linear layer updated its state
    before = [s.state_bytes(session.sid) for s in shards]
    monkeypatch.setattr(last, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
    hidden = shards[0].decode_step(session.sid, session.position, token=out[-1]).hidden
    with pytest.raises(EngineError, match="injected"):
        shards[1].decode_step(session.sid, session.position, hidden=hidden)
    monkeypatch.undo()
    assert shards[1].store.get(session.sid).position == session.position
    assert [s.state_bytes(session.sid) for s in shards][1] == before[1]
    # The head has computed this position already: retry only the hop that failed.
    logits = shards[1].decode_step(session.sid, session.position, hidden=hidden).logits
    session.position += 1
    assert logits is not None
    out += session.generate(logits, N_NEW - 1)
    session.close()
    assert out == reference[HYBRID]


def test_store_full_is_named_and_the_session_continues(models: dict[str, PreTrainedModel]) -> None:
    model = models["llama"]
    per_token = 2 * (2 * 2 * 16 * 4)  # 2 layers x (K, V) x 2 kv heads x 16 dims x fp32
    budget = StoreBudget(budget_bytes=40 * per_token, max_sessions=2)
    small = _shards(model, "llama", budget=budget)
    wide = _shards(model, "llama")
    prompt = _prompt(2, 24)
    solo = generate(wide, prompt, 8)
    hog = ChainSession(small)
    hog.prefill(_prompt(3, 20), 20)
    session = ChainSession(small)
    with pytest.raises(StoreFull, match="KV store full"):
        session.prefill(prompt, 24)  # 20 + 24 > 40 positions
    with pytest.raises(StoreFull, match="maximum of 2 sessions"):
        ChainSession(small)
    assert [s.store.get(session.sid).position for s in small] == [0, 0]
    assert [s.state_bytes(session.sid) for s in small] == [0, 0]
    hog.close()
    assert session.generate(session.prefill(prompt, 24), 8) == solo
    session.close()


def test_snapshots_are_checked_before_they_are_used(models: dict[str, PreTrainedModel]) -> None:
    fp32 = _shards(models[HYBRID], HYBRID)
    bf16 = _shards(models[HYBRID], HYBRID, torch_dtype=torch.bfloat16)
    session = ChainSession(fp32)
    session.prefill(_prompt(4), 8)
    blob = fp32[1].snapshot(session.sid)
    with pytest.raises(InvalidRequest, match="float32"):
        bf16[1].restore(SessionId("other-dtype"), blob)
    with pytest.raises(InvalidRequest, match="corrupt"):
        fp32[1].restore(SessionId("corrupt"), blob[:-50])
    session.close()


@pytest.mark.parametrize("name", ["deepseek_v4", HYBRID, "glm_moe_dsa"])
def test_bfloat16_shards_run(models: dict[str, PreTrainedModel], name: str) -> None:
    shards = _shards(models[name], name, torch_dtype="bfloat16")
    assert {s.info.kv.dtype for s in shards} == {"bfloat16"}
    session = ChainSession(shards)
    logits = session.prefill(_prompt(0), 7)
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    session.generate(logits, 8)
    assert [s.state_bytes(session.sid) for s in shards] == [s.expected_state_bytes(session.position) for s in shards]
    session.close()
    if name == "deepseek_v4":  # the hyper-connection mixers stay float32, as from_pretrained keeps them
        hc = shards[0].modules.blocks[0].attn_hc
        assert {p.dtype for p in hc.parameters()} == {torch.float32}


def test_a_route_must_cover_the_layers_in_order(routes: dict[str, list[TorchShard]]) -> None:
    head, tail = routes["llama"]
    with pytest.raises(ValueError, match="starting at layer 0"):
        ChainSession([tail, head])
    with pytest.raises(ValueError, match="stops at layer 2"):
        ChainSession([head])


def test_a_glm_range_may_not_open_on_a_layer_that_reuses_a_selection(models: dict[str, PreTrainedModel]) -> None:
    with pytest.raises(InvalidRequest, match=r"layer 1 reuses .* start at one of layers \[0, 2\]"):
        TorchShard.from_model(models["glm_moe_dsa"], LayerRange(1, 4, 4))
