"""Certification of model families for layer-split llama.cpp routes (``meshnet.models.families``).

Each family's tiny random model is converted by llama.cpp's own converter (``tests/certify``), then
the whole GGUF in one context is held against the same GGUF cut into 2 and 3 shards — cuts that
fall on no layer pattern, prefill chunks of 64, 7 and 13, two sessions interleaved: a certified
family is bit-identical and token-identical everywhere. The table may not claim a family no test
certifies; a deliberately broken seam must fail; an uncertified GGUF is refused by the CLI.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshnet.models.families import FAMILIES
from tests.certify.convert import TinyModel, gguf_for
from tests.certify.parity import compare, transformers_gap

pytestmark = pytest.mark.real

CUTS = [(3,), (1, 4), (2, 5)]  # of 6 blocks: 2 shards, and 3 shards of uneven sizes
CHUNKS = (64, 7, 13)
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
}
CERTIFIED = sorted(arch for arch, family in FAMILIES.items() if family.llama_route)


@pytest.fixture(scope="module")
def shard_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("certify-shards")


def test_the_table_claims_no_family_that_no_test_certifies() -> None:
    assert set(CERTIFIED) <= set(TINY), set(CERTIFIED) - set(TINY)


@pytest.mark.parametrize("arch", CERTIFIED)
def test_a_certified_family_splits_bit_identically(arch: str, shard_cache: Path) -> None:
    gguf, hf_dir = gguf_for(TINY[arch])
    results = compare(gguf, CUTS, CHUNKS, shard_cache)
    assert len(results) == len(CUTS) * len(CHUNKS)
    broken = [r for r in results if not (r.tokens_equal and r.bits_equal)]
    assert not broken, broken
    # The whole GGUF against transformers on the same weights: a converter or kernel difference
    # would show here, not be mistaken for (or hidden by) a split bug.
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


def test_granite_is_not_exact_yet(shard_cache: Path) -> None:
    """A tripwire: when granite's split route becomes exact, certify it in models.families."""
    assert not FAMILIES["granite"].llama_route
    gguf, _ = gguf_for(TINY["granite"])
    results = compare(gguf, [(3,)], (64,), shard_cache)
    assert not all(r.bits_equal for r in results), "granite now splits exactly: certify it"


def meshnet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnet.cli.main", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_an_uncertified_architecture_is_refused_unless_allowed(tmp_path: Path) -> None:
    gguf, _ = gguf_for(TINY["granite"])
    for args in (
        ["shard", "make", "--gguf", str(gguf), "--layers", "0:3", "--out", str(tmp_path / "s.gguf")],
        ["publish", str(gguf), "--out", str(tmp_path / "pub")],
        ["node", "--gguf", str(gguf), "--layers", "0:3", "--port", "0"],
        ["up", "--gguf", str(gguf), "--port", "0", "--nodes", "2", "--workdir", str(tmp_path / "up")],
    ):
        done = meshnet(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "architecture 'granite' is not certified" in done.stderr and "docs/models.md" in done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "s.gguf").exists() and not (tmp_path / "pub").exists()
    allowed = meshnet("shard", "make", "--gguf", str(gguf), "--layers", "0:3", "--out", str(tmp_path / "s.gguf"),
                      "--allow-uncertified")  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    assert "warning: architecture 'granite' is not certified" in allowed.stderr
    assert (tmp_path / "s.gguf").is_file()
