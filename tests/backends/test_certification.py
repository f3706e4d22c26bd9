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
from tests.certify.convert import gguf_for, prepare
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
from tests.certify.tiny import CHUNKS, CUTS, CUTS_FOR, GAP_MODEL, TINY, UNCERTIFIED

pytestmark = pytest.mark.real

CERTIFIED = sorted(arch for arch, family in FAMILIES.items() if family.llama_route)


@pytest.fixture(scope="module", autouse=True)
def _converted_together(request: pytest.FixtureRequest) -> None:
    """The selected families' tiny models, converted in one process before their tests run."""
    selected = {
        item.callspec.params["arch"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "arch" in item.callspec.params
    }
    models = [TINY[arch] for arch in sorted(selected) if arch in TINY]
    prepare([*models, *(GAP_MODEL[arch](TINY[arch]) for arch in selected if arch in GAP_MODEL), UNCERTIFIED])


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


@pytest.mark.parametrize("arch", ["gemma", "qwen35moe"])
def test_the_python_eval_callback_splits_as_bit_identically_as_the_compiled_one(arch: str, shard_cache: Path) -> None:
    """Certification runs the compiled eval callback (backends/eval_capture.py); a node where it is not built
    runs the Python one. Both copy the seam out, and both overwrite a family's rescaled input (gemma) and
    its looked-up token rows (qwen35moe) with the inbound rows."""
    gguf, _ = gguf_for(TINY[arch])
    python = dataclasses.replace(CONFIG, eval_callback="python")
    results = compare(gguf, [CUTS_FOR.get(arch, CUTS)[-1]], (7,), shard_cache, config=python)
    assert results and all(r.tokens_equal and r.bits_equal for r in results), results
    total = whole_info(gguf).layers.total
    shards = route(gguf, CUTS_FOR.get(arch, CUTS)[-1], total, shard_cache, config=python)
    try:
        assert [s.eval_callback for s in shards] == ["python"] * len(shards)  # type: ignore[attr-defined]
    finally:
        for shard in shards:
            shard.close()


def test_a_broken_seam_fails_certification(shard_cache: Path) -> None:
    """The harness sees what it is for: activations rounded at a seam (what a seam bug does) fail it."""
    gguf, _ = gguf_for(TINY["qwen2"])
    results = compare(gguf, [(3,)], (7,), shard_cache, seam=_bfloat16)
    assert not any(r.bits_equal for r in results), results
    assert all(r.max_abs_diff > 0 for r in results)


BROKEN_CUTS = {
    "smollm3": (1, 5),
    "afmoe": (1, 5),
    "llama4": (5, 9),
    "deepseek4": (4, 6),
    "nemotron_h_moe": (3, 6),
    "lfm2moe": (3, 6),
}
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
    "granitemoe": {"rescaled_input": None},
    "granite_swa": {"rescaled_input": None},
    "gpt2": {"rescaled_input": None},
    "starcoder": {"rescaled_input": None},
    "bloom": {"rescaled_input": None},
    "gpt-oss": {"swa_period": None},
    "cohere2": {"swa_period": None},
    "dots1": {"leading_layer_keys": ()},
    "ernie4_5-moe": {"leading_layer_keys": ()},
    "exaone-moe": {"leading_layer_keys": ()},
    "lfm2moe": {"leading_layer_keys": ()},
    "nemotron_h_moe": {"layer_output": "l_out"},
    "afmoe": {"cut_multiple": 1},
    "apertus": {"layer_key_prefixes": ()},
    "llama4": {"cut_multiple": 1},
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
    except EngineError as exc:  # the shard saw it could not compute its range (e.g. no layer output captured)
        assert "captured" in str(exc), exc
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
        assert "architecture 'minicpm3' is not certified" in done.stderr and "docs/models.md" in done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "s.gguf").exists() and not (tmp_path / "pub").exists()
    allowed = meshnet("shard", "make", "--gguf", str(gguf), "--layers", "0:3", "--out", str(tmp_path / "s.gguf"),
                      "--allow-uncertified")  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    assert "warning: architecture 'minicpm3' is not certified" in allowed.stderr
    assert (tmp_path / "s.gguf").is_file()


def test_a_hybrid_range_of_one_layer_kind_is_refused(tmp_path: Path) -> None:
    """llama.cpp aborts the process on a hybrid range whose memory for one kind would be empty: the
    shard writer refuses it first, saying what to change."""
    gguf, _ = gguf_for(TINY["qwen3next"])
    for layers, kind in (("0:2", "an attention"), ("8:9", "a recurrent")):
        with pytest.raises(InvalidRequest, match=f"hold no {kind} layer.*both kinds"):
            write_shard(gguf, layers, tmp_path / "s.gguf")
    assert not list(tmp_path.iterdir())


def test_a_range_of_full_attention_layers_only_is_refused_where_they_skip_rope(tmp_path: Path) -> None:
    """cohere2's full-attention layers (every 4th) skip rope: declared sliding with a window that masks
    nothing they would compute something else, and llama.cpp cannot load a range without a sliding
    one. The writer refuses such a range, saying what to change; a range with one is served."""
    for arch, layers in (("cohere2", "3:4"), ("cohere2moe", "3:4"), ("exaone-moe", "3:4")):
        gguf, _ = gguf_for(TINY[arch])
        with pytest.raises(InvalidRequest, match=r"skip rope.*includes one"):
            write_shard(gguf, layers, tmp_path / "s.gguf")
        assert not list(tmp_path.iterdir())
    assert write_shard(gguf_for(TINY["cohere2"])[0], "3:5", tmp_path / "s.gguf").layers.start == 3


def test_a_llama4_range_without_a_rope_free_layer_is_refused(tmp_path: Path) -> None:
    """llama.cpp aborts the process on a Llama 4 graph without a rope-free layer (every 4th): the
    writer refuses such a range first, and the starts it offers never leave the last range without one."""
    gguf, _ = gguf_for(TINY["llama4"])
    with pytest.raises(InvalidRequest, match=r"layers 8:11 .* hold none of its rope-free layers"):
        write_shard(gguf, "8:11", tmp_path / "s.gguf")
    assert not list(tmp_path.iterdir())
    assert range_starts(gguf) == [0, 4, 8]


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
    [
        ("llama", "kv", 1),
        ("starcoder", "kv", 1),
        ("deepseek2", "mla", 1),
        ("glm-dsa", "mla", 2),
        ("qwen3next", "hybrid", 1),
        ("mamba", "recurrent", 0),
        ("mamba2", "recurrent", 0),
        ("falcon-h1", "hybrid", 1),
        ("lfm2", "hybrid", 1),
        ("jamba", "hybrid", 1),
        ("nemotron_h_moe", "hybrid", 1),
    ],
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
        if kind in ("hybrid", "recurrent"):  # the recurrent states: live, plus the checkpoint a rewind restores
            states = two - 2 * (kv.bytes_per_token + caches * SNAPSHOT_CELL_META_BYTES)
            assert 0 < kv.fixed_bytes / 2 <= states < kv.fixed_bytes / 2 + 1024  # + the format's headers
            assert 0 in kv.per_layer_bytes_per_token or arch == "falcon-h1"  # falcon-h1: both on every layer
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
