"""`meshnet plan` reproduces the seed's GLM-5.2 figures and the bundled model's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshnet.artifacts.plan import format_plan, plan, read_shape
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange

GIB = 2**30
GLM_52 = {"num_hidden_layers": 78, "hidden_size": 6144, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
          "num_attention_heads": 64, "torch_dtype": "bfloat16"}  # fmt: skip


@pytest.fixture
def glm(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(GLM_52))
    return tmp_path


def test_glm_52_matches_the_seed(glm: Path) -> None:
    shape = read_shape(glm)
    # The seed: 78 * (512 + 64) * 2 = 89,856 bytes ~= 87.75 KiB per token.
    p = plan(shape, context=128_000)
    assert p.per_token == 89_856 and p.per_token / 1024 == 87.75
    # Its table (1 layer 137 MiB ~ 0.137 GiB, 10 -> 1.37 GiB, 20 -> 2.75 GiB, 78 -> 10.7 GiB) is at 128,000 tokens.
    per_layer_gib = p.per_layer_at_context / GIB
    assert round(per_layer_gib, 3) == 0.137
    for layers, seed in ((10, "1.37"), (20, "2.75"), (78, "10.7")):
        gib = plan(shape, context=128_000, layers=LayerRange(0, layers, 78)).shard_at_context / GIB
        assert f"{gib:.{len(seed.split('.')[1])}f}" == seed  # to the seed's own rounding
    # Its 1.5 GiB seam activation is 128K = 131,072 tokens x hidden 6144 x 2 bytes.
    assert plan(shape, context=131_072).seam_full_context == int(1.5 * GIB)
    assert "89,856 B (87.75 KiB)" in format_plan(p)


def test_bundled_model_from_its_gguf() -> None:
    from meshnet.artifacts.bundled import bundled_gguf

    shape = read_shape(bundled_gguf())
    assert (shape.layers, shape.hidden, shape.kind) == (30, 576, "gqa")
    assert shape.kv_bytes_per_token_per_layer == 768  # 2 x 3 kv heads x 64 x f16: what the llama.cpp shard measures
    p = plan(shape, context=8192, layers=LayerRange(10, 20, 30))
    assert p.per_token == 7680 and p.seam_decode_step == 576 * 2


def test_bad_configs_name_the_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(InvalidRequest, match="num_hidden_layers"):
        read_shape(tmp_path)
    with pytest.raises(InvalidRequest, match="not found"):
        read_shape(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InvalidRequest, match="JSON"):
        read_shape(tmp_path / "bad.json")
    with pytest.raises(InvalidRequest, match="cache dtype"):
        read_shape(tmp_path / "config.json", cache_dtype="int3")
