"""GGUFs for context and identity tests, written with gguf-py in seconds (no converter, no network).

- ``tiny_long_llama``: a random llama of hidden 16 and two layers whose metadata says it was trained
  for ``context`` positions (131,072 by default), with the bundled model's tokenizer (so the gateway
  and the nodes load it like any GGUF). Its KV is 64 bytes per token per layer: a 128K session fits
  in a few MiB, and a 128K prefill costs seconds of attention per layer, not hours.
- ``requantized``: the bundled model in another quantization (llama.cpp's own quantize API): the same
  model id by file name, another model identity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

HIDDEN = 16
LAYERS = 2
FFN = 32
_TOKENIZER_PREFIX = "tokenizer."


def tiny_long_llama(out: Path, *, context: int = 131_072, seed: int = 0, tokenizer: bool = True) -> Path:
    """Write the tiny llama to ``out`` (a .gguf) and return it. ``tokenizer=False``: a 64-token
    vocabulary and no tokenizer (gguf-py reads it in milliseconds; llama.cpp does not load it)."""
    import gguf

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(out.stem)
    writer.add_context_length(context)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(HIDDEN)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = _copy_tokenizer(writer) if tokenizer else 64
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.08).astype(np.float32)

    writer.add_tensor("token_embd.weight", weights(n_vocab, HIDDEN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        for part in ("q", "k", "v", "output"):
            writer.add_tensor(f"blk.{i}.attn_{part}.weight", weights(HIDDEN, HIDDEN))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights(FFN, HIDDEN))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights(FFN, HIDDEN))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weights(HIDDEN, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _copy_tokenizer(writer: Any) -> int:
    """The bundled model's tokenizer metadata into ``writer``; its vocabulary size."""
    import gguf

    from meshnet.artifacts.bundled import bundled_gguf

    n_vocab = 0
    for name, field in gguf.GGUFReader(str(bundled_gguf())).fields.items():
        if not name.startswith(_TOKENIZER_PREFIX) or name == "tokenizer.chat_template":
            continue
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub)
    return n_vocab


def requantized(out: Path, ftype: str = "Q8_0") -> Path:
    """The bundled model requantized to ``ftype`` (a ``LLAMA_FTYPE_MOSTLY_*`` name) at ``out``."""
    import llama_cpp
    from llama_cpp._utils import suppress_stdout_stderr

    from meshnet.artifacts.bundled import bundled_gguf

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = 1
    with suppress_stdout_stderr(disable=False):
        failed = llama_cpp.llama_model_quantize(str(bundled_gguf()).encode(), str(out).encode(), params)
    if failed:
        raise RuntimeError(f"llama.cpp could not quantize the bundled model to {ftype} (status {failed})")
    return out
