"""The load-time self-check of ``struct ggml_tensor``'s layout (backends/ggml_layout.py) on the real
libggml llama-cpp-python ships: the offsets the eval callback reads hold, and wrong ones are refused;
ggml's own dequantizer (the head's embedding lookup) computes what gguf-py does."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.artifacts.gguf_source import open_gguf
from meshnet.artifacts.shard_file import embeddings_path, write_shard
from meshnet.backends.ggml_layout import NAME_OFFSET, NE_OFFSET, check_tensor_layout, rows_to_float
from meshnet.backends.llama_shard import HeadEmbeddings
from meshnet.errors import EngineError

pytestmark = pytest.mark.real


def test_the_offsets_hold_for_the_llama_cpp_installed() -> None:
    check_tensor_layout(llama_cpp)


@pytest.mark.parametrize(
    ("ne_offset", "name_offset", "says"),
    [(NE_OFFSET + 8, NAME_OFFSET, "ne[] read at 24"), (NE_OFFSET, NAME_OFFSET + 8, "name is at 256, not 264")],
)
def test_a_wrong_offset_is_refused_with_what_to_do(ne_offset: int, name_offset: int, says: str) -> None:
    with pytest.raises(EngineError, match="struct ggml_tensor") as refused:
        check_tensor_layout(llama_cpp, ne_offset=ne_offset, name_offset=name_offset)
    assert says in str(refused.value) and "llama-cpp-python==0.3.36" in str(refused.value)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K,
                                   GGMLQuantizationType.Q6_K, GGMLQuantizationType.F16])  # fmt: skip
def test_ggmls_own_dequantizer_computes_gguf_pys_floats(qtype: GGMLQuantizationType) -> None:
    """The head's embedding lookup dequantizes with ggml's to_float: the same floats gguf-py computes."""
    block = GGML_QUANT_SIZES[qtype]
    to_float = rows_to_float(llama_cpp, int(qtype), qtype.name, block)
    assert to_float is not None
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((3, 4 * 256)).astype(np.float32)
    try:
        blocks = quantize(values, qtype)
    except NotImplementedError:  # gguf-py cannot quantize K-quants: random blocks (a few hold NaN scales)
        blocks = rng.integers(0, 256, (3, 4 * 256 // block[0] * block[1]), dtype=np.uint8)
    out = np.empty(values.shape, dtype=np.float32)
    to_float(blocks.tobytes(), out.ctypes.data, out.size)
    with np.errstate(invalid="ignore", over="ignore"):  # the NaN scales of random blocks
        want = dequantize(blocks, qtype)
    assert np.array_equal(out, want, equal_nan=True)
    assert np.isfinite(out).mean() > 0.8


def test_no_ggml_dequantizer_where_its_traits_disagree_or_it_has_none() -> None:
    q8 = GGMLQuantizationType.Q8_0
    assert rows_to_float(llama_cpp, int(q8), q8.name, (32, 36)) is None  # another block size: not trusted
    assert rows_to_float(llama_cpp, int(q8), "Q4_0", GGML_QUANT_SIZES[q8]) is None
    f32 = GGMLQuantizationType.F32
    assert rows_to_float(llama_cpp, int(f32), f32.name, GGML_QUANT_SIZES[f32]) is None  # nothing to dequantize


def test_the_heads_lookup_is_the_tables_rows(tmp_path: Path) -> None:
    write_shard(bundled_gguf(), "0:10", tmp_path / "head.gguf")
    sidecar = embeddings_path(tmp_path / "head.gguf")
    table = open_gguf(sidecar).tensor("token_embd.weight")
    assert table is not None
    embeddings = HeadEmbeddings(sidecar)
    tokens = np.random.default_rng(0).integers(0, embeddings.n_vocab, 200).astype(np.int32)
    rows = np.frombuffer(table.read(), dtype=table.dtype).reshape(table.shape)
    want = dequantize(rows[tokens], table.tensor_type)
    assert np.array_equal(embeddings(tokens), want)
    assert np.array_equal(embeddings(tokens[:1]), want[:1])
