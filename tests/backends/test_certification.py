"""Certification of model families for layer-split llama.cpp routes (``meshnet.models.families``).

Each family's tiny random model is converted by llama.cpp's own converter (``tests/certify``), then
the whole GGUF in one context is held against the same GGUF cut into 2 and 3 shards — cuts that
fall on no layer pattern, prefill chunks of 64, 7 and 13, two sessions interleaved: a certified
family is bit-identical and token-identical everywhere. The table may not claim a family no test
certifies; a deliberately broken seam must fail; an uncertified GGUF is refused by the CLI.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshnet.artifacts.shard_file import merge_shards, range_starts, write_shard
from meshnet.backends.chain import ChainSession
from meshnet.backends.llama_shard import SNAPSHOT_CELL_META_BYTES, LlamaShard
from meshnet.errors import EngineError, InvalidRequest
from meshnet.ids import new_session_id
from meshnet.models.families import FAMILIES
from tests.certify.convert import TinyModel, gguf_for
from tests.certify.parity import (
    CONFIG,
    compare,
    prompt_for,
    rewind_replays_exactly,
    route,
    transformers_gap,
    verify_matches_decoding,
    whole_info,
)

pytestmark = pytest.mark.real

CUTS = [(3,), (1, 4), (2, 5)]  # of 6 blocks: 2 shards, and 3 shards of uneven sizes
CUTS_FOR = {
    "smollm3": [(4,), (4, 8), (8,)],  # of 12 blocks, ranges starting at multiples of 4
    # of 9 hybrid blocks: every range holds both kinds; cuts on and off the pattern
    "qwen3next": [(4,), (3, 7), (5,)],
    "qwen35moe": [(4,), (3, 7), (5,)],
    "glm-dsa": [(2,), (1, 4), (2, 4)],  # ranges start where a layer computes its own top-k
    # of 9 blocks: the two hash-routed layers stay on the head, every range holds CSA and HCA layers
    "deepseek4": [(4,), (4, 6), (5,)],
}
# transformers against the whole GGUF where the route's model differs: glm-dsa's sparse top-k picks
# differently between the two near ties, so its converter is checked on the dense (top-64) variant.
GAP_MODEL = {"glm-dsa": lambda m: dataclasses.replace(m, config={**m.config, "index_topk": 64})}
CHUNKS = (64, 7, 13)
# A sliding window shorter than the prompt, so a pattern shifted at a cut would change the text.
GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16, "tie_word_embeddings": True}
# DeepSeek-style MoE (two dense layers first: a cut inside them must keep the count relative) and MLA
DEEPSEEK_MOE = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 2,
    "n_group": 1,
    "topk_group": 1,
}
MLA = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}
HYBRID = {
    "head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 3,
    "pad_token_id": 0,
}
TINY = {
    "llama": TinyModel("llama", "llama", {"head_dim": 16}),
    "qwen2": TinyModel("qwen2", "qwen2"),
    "qwen3": TinyModel("qwen3", "qwen3", {"head_dim": 16}),
    "qwen3moe": TinyModel(
        "qwen3moe",
        "qwen3_moe",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "olmo2": TinyModel("olmo2", "olmo2"),
    # Non-default multipliers, so that a scale applied at the wrong place would show.
    "granite": TinyModel(
        "granite",
        "granite",
        {"head_dim": 16, "embedding_multiplier": 12.0, "residual_multiplier": 0.5, "logits_scaling": 4.0},
    ),
    "gemma": TinyModel("gemma", "gemma", {"head_dim": 16, "tie_word_embeddings": True}, tokenizer="spm"),
    "gemma2": TinyModel("gemma2", "gemma2", GEMMA, tokenizer="spm"),
    "gemma3": TinyModel("gemma3", "gemma3_text", GEMMA),
    "phi3": TinyModel("phi3", "phi3", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}, tokenizer="spm"),
    # Two dense layers before the MoE ones: a cut inside them must keep the count relative.
    "deepseek2": TinyModel(
        "deepseek2",
        "deepseek_v2",
        {
            "num_key_value_heads": 4,
            **MLA,
            **DEEPSEEK_MOE,
            "topk_method": "greedy",
        },
    ),
    "qwen2moe": TinyModel(
        "qwen2moe",
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "glm4": TinyModel("glm4", "glm4", {"head_dim": 16, "pad_token_id": 0}),
    "smollm3": TinyModel("smollm3", "smollm3", {"head_dim": 16, "pad_token_id": 0}, layers=12),
    "mistral3": TinyModel(
        "mistral3",
        "ministral3",
        {
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
        },
    ),
    # Hybrid linear/full attention, (linear, linear, full) x 3; MTP blocks left out by the converter.
    "qwen3next": TinyModel("qwen3next", "qwen3_next", HYBRID, layers=9, convert_args=("--no-mtp",)),
    "qwen35moe": TinyModel(
        "qwen35moe",
        "qwen3_5_moe_text",
        {
            **HYBRID,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        },
        layers=9,
        convert_args=("--no-mtp",),
    ),
    # GLM-5.x: MLA + DSA lightning indexer with a top-8 selection (sparse within the prompt); layers
    # 3 and 5 reuse the previous layer's selection, so ranges may not start there.
    "glm-dsa": TinyModel(
        "glm-dsa",
        "glm_moe_dsa",
        {
            "num_key_value_heads": 4,
            **MLA,
            "head_dim": 8,
            **DEEPSEEK_MOE,
            "index_topk": 8,
            "index_head_dim": 64,  # llama.cpp's Hadamard rotation of indexer keys needs a multiple of 64
            "index_n_heads": 2,
            "num_nextn_predict_layers": 0,
            "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
            "layer_types": ["indexed_attention"] * 6,
            "indexer_types": ["full", "full", "full", "shared", "full", "shared"],
            "pad_token_id": 0,
        },
    ),
    # One multi-token-prediction layer declared after the trunk: routes run the trunk only.
    "glm4moe": TinyModel(
        "glm4moe",
        "glm4_moe",
        {
            "head_dim": 16,
            **DEEPSEEK_MOE,
            "num_nextn_predict_layers": 1,
        },
    ),
    # DeepSeek-V4 in DeepSeek's own checkpoint layout (what llama.cpp's converter reads), routed
    # experts in MXFP4: 4 hyper-connection streams, two hash-routed MoE layers; two sliding-window
    # layers, then CSA (ratio 4, indexer top-8) and HCA (ratio 128) in turn, a sliding one last; a
    # 16-token window.
    "deepseek4": TinyModel(
        "deepseek4",
        "deepseek_v4",
        {
            "num_key_value_heads": 1,
            "head_dim": 64,  # llama.cpp ropes half of it; the Hadamard rotation wants multiples of 64
            "qk_rope_head_dim": 32,
            "q_lora_rank": 32,
            "o_lora_rank": 32,
            "o_groups": 2,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "index_head_dim": 64,
            "index_n_heads": 4,
            "index_topk": 8,
            "sliding_window": 16,
            "num_nextn_predict_layers": 0,
            "layer_types": ["sliding_attention"] * 2
            + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3
            + ["sliding_attention"],
            "mlp_layer_types": ["hash_moe"] * 2 + ["moe"] * 7,
        },
        layers=9,
        raw_config={"compress_ratios": [0, 0, *[4, 128] * 3, 0], "num_hash_layers": 2},
        layout="deepseek4",
    ),
}
# A family the table does not list: refused by every command.
UNCERTIFIED = TinyModel("stablelm", "stablelm", {"pad_token_id": 0})
CERTIFIED = sorted(arch for arch, family in FAMILIES.items() if family.llama_route)


@pytest.fixture(scope="module")
def shard_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("certify-shards")


def test_the_table_claims_no_family_that_no_test_certifies() -> None:
    assert set(CERTIFIED) <= set(TINY), set(CERTIFIED) - set(TINY)


@pytest.mark.parametrize("arch", CERTIFIED)
def test_a_certified_family_splits_bit_identically(arch: str, shard_cache: Path) -> None:
    gguf, hf_dir = gguf_for(TINY[arch])
    cuts = CUTS_FOR.get(arch, CUTS)
    results = compare(gguf, cuts, CHUNKS, shard_cache)
    assert len(results) == len(cuts) * len(CHUNKS)
    broken = [r for r in results if not (r.tokens_equal and r.bits_equal)]
    assert not broken, broken
    # Route repair rewinds a hop by a step and resends it: the same bits again (a recurrent state
    # is restored from its checkpoint, not truncated).
    assert rewind_replays_exactly(gguf, cuts[-1], shard_cache)
    # Speculative decoding: where the shards take verify chunks, a chunk of drafts computes what
    # one-position steps do, and dropping the rejected drafts leaves the KV of a run that never drafted.
    if whole_info(gguf).max_verify:
        assert verify_matches_decoding(gguf, cuts[-1], shard_cache)
    # The whole GGUF against transformers on the same weights: a converter or kernel difference
    # would show here, not be mistaken for (or hidden by) a split bug.
    if arch in GAP_MODEL:
        gguf, hf_dir = gguf_for(GAP_MODEL[arch](TINY[arch]))
    assert transformers_gap(gguf, hf_dir) < 1e-2


def _bfloat16(hidden: np.ndarray) -> np.ndarray:
    bits = hidden.view(np.uint32)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def test_a_broken_seam_fails_certification(shard_cache: Path) -> None:
    """The harness sees what it is for: activations rounded at a seam (what a seam bug does) fail it."""
    gguf, _ = gguf_for(TINY["qwen2"])
    results = compare(gguf, [(3,)], (7,), shard_cache, seam=_bfloat16)
    assert not any(r.bits_equal for r in results), results
    assert all(r.max_abs_diff > 0 for r in results)


BROKEN_CUTS = {"smollm3": (1, 5), "deepseek4": (4, 6)}
# Each family's seam handling switched off: the split route must then differ from the whole model
# (or refuse to load) — the fix is what makes it exact, and the harness sees its absence.
WITHOUT_FIX = {
    "granite": {"rescaled_input": None},
    "gemma": {"rescaled_input": None},
    "gemma2": {"swa_period": None},
    "gemma3": {"head_scale": None},
    "deepseek2": {"leading_layer_keys": ()},
    "smollm3": {"cut_multiple": 1},
    "deepseek4": {"leading_layer_keys": ()},
}


@pytest.mark.parametrize("arch", sorted(WITHOUT_FIX))
def test_a_family_without_its_seam_fix_fails_certification(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert FAMILIES[arch].llama_route
    gguf, _ = gguf_for(TINY[arch])
    monkeypatch.setitem(FAMILIES, arch, dataclasses.replace(FAMILIES[arch], **WITHOUT_FIX[arch]))
    try:
        results = compare(gguf, [BROKEN_CUTS.get(arch, (1, 4))], (7,), tmp_path)
    except InvalidRequest as exc:  # llama.cpp could not even load the shard: refused, not wrong
        assert "could not load" in str(exc)
        return
    assert not all(r.bits_equal for r in results), results


def meshnet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnet.cli.main", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_an_uncertified_architecture_is_refused_unless_allowed(tmp_path: Path) -> None:
    gguf, _ = gguf_for(UNCERTIFIED)
    for args in (
        ["shard", "make", "--gguf", str(gguf), "--layers", "0:3", "--out", str(tmp_path / "s.gguf")],
        ["publish", str(gguf), "--out", str(tmp_path / "pub")],
        ["node", "--gguf", str(gguf), "--layers", "0:3", "--port", "0"],
        ["up", "--gguf", str(gguf), "--port", "0", "--nodes", "2", "--workdir", str(tmp_path / "up")],
    ):
        done = meshnet(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "architecture 'stablelm' is not certified" in done.stderr and "docs/models.md" in done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "s.gguf").exists() and not (tmp_path / "pub").exists()
    allowed = meshnet("shard", "make", "--gguf", str(gguf), "--layers", "0:3", "--out", str(tmp_path / "s.gguf"),
                      "--allow-uncertified")  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    assert "warning: architecture 'stablelm' is not certified" in allowed.stderr
    assert (tmp_path / "s.gguf").is_file()


def test_a_hybrid_range_of_one_layer_kind_is_refused(tmp_path: Path) -> None:
    """llama.cpp aborts the process on a hybrid range whose memory for one kind would be empty: the
    shard writer refuses it first, saying what to change."""
    gguf, _ = gguf_for(TINY["qwen3next"])
    for layers, kind in (("0:2", "recurrent"), ("8:9", "full-attention")):
        with pytest.raises(InvalidRequest, match=f"are all {kind}.*both kinds"):
            write_shard(gguf, layers, tmp_path / "s.gguf")
    assert not list(tmp_path.iterdir())


def test_a_recurrent_state_rewinds_one_chunk_and_refuses_more(tmp_path: Path) -> None:
    gguf, _ = gguf_for(TINY["qwen3next"])
    shards = route(gguf, (4,), 9, tmp_path)
    try:
        session = ChainSession(shards)
        logits = session.prefill(prompt_for(shards[-1].info.n_vocab), 7)
        for _ in range(3):
            logits = session.step(int(np.argmax(logits)))
        with pytest.raises(EngineError, match=r"recurrent state.*last chunk"):
            shards[0].rewind(session.sid, session.position - 2)
        # Nothing lost: the session goes on from where it was.
        assert shards[0].store.get(session.sid).position == session.position
        nxt = session.step(int(np.argmax(logits)))
        assert np.isfinite(nxt).all()
        session.close()
    finally:
        for shard in shards:
            shard.close()


@pytest.mark.parametrize(
    ("arch", "kind", "caches"),
    [("llama", "kv", 1), ("deepseek2", "mla", 1), ("glm-dsa", "mla", 2), ("qwen3next", "hybrid", 1)],
)
def test_the_kv_format_is_what_llama_cpp_stores(arch: str, kind: str, caches: int) -> None:
    """Per-token and fixed bytes by layer type, held against llama.cpp's own serialized session."""
    gguf, _ = gguf_for(TINY[arch])
    shard = LlamaShard(gguf, config=CONFIG)
    try:
        kv = shard.info.kv
        assert kv.kind == kind
        sid = new_session_id()
        shard.open_session(sid)
        tokens = np.array(prompt_for(shard.info.n_vocab)[:10], dtype=np.int32)
        shard.prefill(sid, 0, tokens=tokens[:2])
        two = shard.kv_state_bytes(sid)
        shard.prefill(sid, 2, tokens=tokens[2:])
        ten = shard.kv_state_bytes(sid)
        # each of the session's caches (glm-dsa: MLA latents, indexer keys) stores its cells' positions
        assert (ten - two) / 8 == kv.bytes_per_token + caches * SNAPSHOT_CELL_META_BYTES
        if kind == "hybrid":  # the recurrent states: live, plus the checkpoint a rewind restores
            assert 0 < kv.fixed_bytes / 2 <= two - 2 * (kv.bytes_per_token + SNAPSHOT_CELL_META_BYTES)
            assert 0 in kv.per_layer_bytes_per_token
    finally:
        shard.close()


def test_a_glm_dsa_range_may_not_open_on_a_layer_that_reuses_a_selection(tmp_path: Path) -> None:
    gguf, _ = gguf_for(TINY["glm-dsa"])
    with pytest.raises(InvalidRequest, match=r"layer 3 .* cannot open a range.*may start at layers \[0, 1, 2, 4\]"):
        write_shard(gguf, "3:6", tmp_path / "s.gguf")
    assert range_starts(gguf) == [0, 1, 2, 4]
    assert range_starts(gguf_for(TINY["qwen3next"])[0]) == [0, 3, 6]
    assert range_starts(gguf_for(TINY["smollm3"])[0]) == [0, 4, 8]
    assert range_starts(gguf_for(TINY["llama"])[0]) == list(range(6))


def test_shards_cut_with_different_sliding_windows_are_not_merged(tmp_path: Path) -> None:
    """gemma2's layer 5 slides nowhere: its one-layer shard gets a window that masks nothing, which
    would be wrong for layer 4 in a merged file."""
    gguf, _ = gguf_for(TINY["gemma2"])
    parts = [write_shard(gguf, r, tmp_path / f"{r.replace(':', '-')}.gguf").path for r in ("4:5", "5:6")]
    with pytest.raises(InvalidRequest, match="different sliding windows"):
        merge_shards(parts, tmp_path / "merged.gguf")
    assert not (tmp_path / "merged.gguf").exists()


def test_deepseek4_ranges_keep_hash_layers_on_the_head_and_hold_both_compressed_kinds(tmp_path: Path) -> None:
    """The two hash-routed layers read token ids: a range may not open inside them, and the head
    keeps its vocabulary (it runs on token ids). llama.cpp crashes on a DeepSeek-V4 range without a
    CSA or an HCA layer: the writer refuses one first. Published files merge into a head that
    still runs on token ids, computing what the shard cut in one piece computes."""
    gguf, _ = gguf_for(TINY["deepseek4"])
    assert range_starts(gguf) == [0, 4, 5, 6]
    with pytest.raises(InvalidRequest, match=r"layer 1 .* cannot open a range: its first 2 layers read token ids"):
        write_shard(gguf, "1:9", tmp_path / "s.gguf")
    with pytest.raises(InvalidRequest, match=r"layers 7:9 .* hold no layer with attention.compress_ratios = \[4\]"):
        write_shard(gguf, "7:9", tmp_path / "s.gguf")
    assert not list(tmp_path.iterdir())
    head = write_shard(gguf, "0:4", tmp_path / "head.gguf")
    assert not head.vocab_cut and head.embeddings is None
    parts = [head.path, write_shard(gguf, "4:6", tmp_path / "mid.gguf").path]
    merged = LlamaShard(merge_shards(parts, tmp_path / "merged.gguf").path, config=CONFIG)
    whole = LlamaShard(write_shard(gguf, "0:6", tmp_path / "whole.gguf").path, config=CONFIG)
    try:
        assert merged.info.n_vocab == whole.info.n_vocab > 1 and merged.info.seam.shape == (4, 64)
        tokens = np.array(prompt_for(whole.info.n_vocab), dtype=np.int32)
        outputs = []
        for shard in (merged, whole):
            sid = new_session_id()
            shard.open_session(sid)
            outputs.append(shard.prefill(sid, 0, tokens=tokens).hidden)
        assert outputs[0] is not None and outputs[0].shape == (len(tokens), 4, 64)
        assert np.array_equal(outputs[0], outputs[1])
    finally:
        merged.close()
        whole.close()


def test_deepseek4_kv_format_counts_compressed_entries_as_llama_cpp_stores_them() -> None:
    """Raw K for every position (the cache is allocated for the whole context; llama.cpp serializes
    only the sliding window of it), plus compressed entries: CSA and indexer keys every 4 positions,
    HCA every 128. Past the window, a session's serialized size grows by exactly the compressed part."""
    gguf, _ = gguf_for(TINY["deepseek4"])
    shard = LlamaShard(gguf, config=CONFIG)
    try:
        kv = shard.info.kv
        assert kv.kind == "compressed" and kv.fixed_bytes > 0
        raw = 64 * 2  # key_length 64, f16
        assert kv.per_layer_bytes_per_token == (raw, raw, *[raw + 64, raw + 1] * 3, raw)
        sid = new_session_id()
        shard.open_session(sid)
        tokens = np.random.default_rng(0).integers(3, shard.info.n_vocab, 256).astype(np.int32)
        shard.prefill(sid, 0, tokens=tokens[:128])
        before = shard.kv_state_bytes(sid)
        shard.prefill(sid, 128, tokens=tokens[128:])
        compressed = kv.bytes_per_token - 9 * raw
        assert shard.kv_state_bytes(sid) - before == 128 * (compressed + SNAPSHOT_CELL_META_BYTES)
    finally:
        shard.close()
