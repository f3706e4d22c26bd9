"""``meshnet plan CONFIG``'s counts checked against real (tiny) transformers models: weights per layer,
KV by layer type, seam bytes (the torch tier; the seed audits are in test_audit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedModel

from meshnet.backends.audit import audit, format_audit
from meshnet.backends.tiny_models import TINY_MODELS


def saved(model: PreTrainedModel, tmp_path: Path) -> Path:
    model.config.to_json_file(tmp_path / "config.json")
    return tmp_path / "config.json"


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_weights_are_the_models_own_parameters(name: str, tmp_path: Path) -> None:
    model = TINY_MODELS[name]()
    found = audit(saved(model, tmp_path), context=1000, nodes=2, weight_bits=16)
    assert found.params == sum(p.numel() for p in model.parameters())
    assert found.layer_params == tuple(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    # Every node's weights: its layers, plus the embeddings at the head and the rest at the tail.
    assert sum(n.weight_bytes for n in found.nodes) == pytest.approx(found.params * 2, abs=len(found.nodes))
    # Two nodes, cut as meshnet up would; a 4-layer hybrid (3 linear + 1 full) cannot be cut at all.
    expected = {
        "llama": ["0:2", "2:4"],
        "deepseek_v4": ["0:2", "2:4"],
        "qwen3_5_moe_text": ["0:4"],
        "glm_moe_dsa": ["0:2", "2:4"],
    }[name]
    assert [str(n.layers) for n in found.nodes] == expected
    assert ("asked for 2" in format_audit(found)) == (len(expected) == 1)


def test_layer_types_decide_kv_and_the_seam(tmp_path: Path) -> None:
    dsv4 = TINY_MODELS["deepseek_v4"]()
    found = audit(saved(dsv4, tmp_path), context=4096, nodes=1)
    c = dsv4.config
    assert found.kv_kind == "compressed" and found.seam_token_ids
    assert found.seam_decode_step == c.hc_mult * c.hidden_size * 2 + 4
    assert "hc_head" in found.outer_params
    hybrid = TINY_MODELS["qwen3_5_moe_text"]()
    (tmp_path / "h").mkdir()
    found = audit(saved(hybrid, tmp_path / "h"), context=4096, nodes=2)
    linear = [t == "linear_attention" for t in hybrid.config.layer_types]
    assert found.kv_kind == "hybrid"
    assert [b == 0 for b in found.kv_per_token] == linear
    assert [f > 0 for f in found.kv_fixed] == linear
    assert found.kv_at_context == sum(found.kv_per_token) * 4096 + sum(found.kv_fixed)
    # Cuts fall only right after a full-attention layer, as the shard writer requires.
    assert [str(n.layers) for n in found.nodes] == ["0:4"]
