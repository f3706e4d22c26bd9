"""``meshnet plan``: what a model costs a shard — KV/state per token and per layer, per-shard KV at a
context length, and the bytes that cross a seam per decode step and per prefill chunk.

Pure arithmetic over a ``ModelShape``, read from a Hugging Face ``config.json``, a GGUF's
metadata, or a published model's ``manifest.json`` (its ``kv_cache`` record). Cache kinds:
standard (GQA/MHA) attention caches K and V per KV head; MLA (DeepSeek V2/V3, GLM-5.x) caches
one compressed latent (``kv_lora_rank``) plus the decoupled RoPE key (``qk_rope_head_dim``) per
token and layer — the seed's GLM-5.2 estimate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnet.artifacts.gguf_source import model_stem
from meshnet.artifacts.shard_file import trunk_layers
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange

if TYPE_CHECKING:
    from meshnet.artifacts.manifest import Manifest

__all__ = ["KVPlan", "ModelShape", "format_plan", "plan", "read_shape", "shape_from_fields", "shape_from_manifest"]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "f16": 2, "bf16": 2, "f32": 4, "q8_0": 1}
GIB = 2**30
KIB = 2**10


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    kind: str  # "gqa" | "mla"
    cache_dtype_bytes: int
    seam_dtype_bytes: int
    kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        if self.kind == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.cache_dtype_bytes
        return 2 * self.kv_heads * self.head_dim * self.cache_dtype_bytes


@dataclass(frozen=True, slots=True)
class KVPlan:
    shape: ModelShape
    layers: LayerRange
    context: int
    prefill_chunk: int

    @property
    def per_token(self) -> int:
        return self.shape.kv_bytes_per_token_per_layer * len(self.layers)

    @property
    def per_layer_at_context(self) -> int:
        return self.shape.kv_bytes_per_token_per_layer * self.context

    @property
    def shard_at_context(self) -> int:
        return self.per_token * self.context

    @property
    def seam_decode_step(self) -> int:
        return self.shape.hidden * self.shape.seam_dtype_bytes

    @property
    def seam_prefill_chunk(self) -> int:
        return self.prefill_chunk * self.seam_decode_step

    @property
    def seam_full_context(self) -> int:
        """What one hop would carry per token if it re-sent the whole activation (the naive route)."""
        return self.context * self.seam_decode_step


def plan(shape: ModelShape, *, context: int, layers: LayerRange | None = None, prefill_chunk: int = 2048) -> KVPlan:
    if context < 1 or prefill_chunk < 1:
        raise InvalidRequest("--context and --prefill-chunk must be positive")
    return KVPlan(shape, layers or LayerRange.full(shape.layers), context, prefill_chunk)


def dtype_bytes(name: str, field: str) -> int:
    try:
        return _DTYPE_BYTES[name.lower()]
    except KeyError:
        raise InvalidRequest(f"{field} {name!r} is not one of {', '.join(_DTYPE_BYTES)}", param=field) from None


def read_shape(path: Path, *, cache_dtype: str | None = None, seam_dtype: str = "bfloat16") -> ModelShape:
    """A model's shape from a Hugging Face ``config.json`` (or a directory holding one), a GGUF or a manifest."""
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InvalidRequest(f"{path} not found: pass a config.json, a folder holding one, or a .gguf", param="config")
    if path.suffix == ".gguf":
        return _from_gguf(path, cache_dtype or "f16", seam_dtype)
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"{path} is not a readable JSON config: {exc}", param="config") from None
    from meshnet.artifacts.manifest import SCHEMA, parse_manifest

    if config.get("schema") == SCHEMA:
        return _from_manifest(parse_manifest(path.read_bytes()), cache_dtype, seam_dtype)
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    return _from_config(path.parent.name or path.stem, config, cache_dtype, seam_dtype)


def shape_from_manifest(manifest: Manifest) -> ModelShape:
    """A published model's shape, from its manifest's ``kv_cache`` record (its own cache dtype)."""
    return _from_manifest(manifest, None, "bfloat16")


def _from_manifest(manifest: Manifest, cache_dtype: str | None, seam_dtype: str) -> ModelShape:
    kv = manifest.kv_cache
    cache_bytes = dtype_bytes(cache_dtype or kv.dtype, "cache dtype")
    seam_bytes = dtype_bytes(seam_dtype, "seam dtype")
    name = manifest.model_id
    if kv.kind == "mla":
        return ModelShape(
            name, manifest.layers, kv.hidden, "mla", cache_bytes, seam_bytes,
            kv_lora_rank=kv.kv_lora_rank, qk_rope_head_dim=kv.qk_rope_head_dim,
        )  # fmt: skip
    return ModelShape(
        name, manifest.layers, kv.hidden, "gqa", cache_bytes, seam_bytes, kv_heads=kv.kv_heads, head_dim=kv.head_dim
    )


def _need(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value <= 0:
        raise InvalidRequest(f"config field {key!r} is missing or not a positive integer", param=key)
    return value


def _from_config(name: str, config: dict[str, Any], cache_dtype: str | None, seam_dtype: str) -> ModelShape:
    dtype = cache_dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    cache_bytes = dtype_bytes(dtype, "cache dtype")
    layers, hidden = _need(config, "num_hidden_layers"), _need(config, "hidden_size")
    seam_bytes = dtype_bytes(seam_dtype, "seam dtype")
    if config.get("kv_lora_rank"):
        return ModelShape(
            name, layers, hidden, "mla", cache_bytes, seam_bytes,
            kv_lora_rank=_need(config, "kv_lora_rank"), qk_rope_head_dim=_need(config, "qk_rope_head_dim"),
        )  # fmt: skip
    heads = _need(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return ModelShape(name, layers, hidden, "gqa", cache_bytes, seam_bytes, kv_heads=kv_heads, head_dim=head_dim)


def _from_gguf(path: Path, cache_dtype: str, seam_dtype: str) -> ModelShape:
    from meshnet.artifacts.gguf_header import read_header

    return shape_from_fields(path, read_header(path).fields, cache_dtype, seam_dtype)


def shape_from_fields(path: Path, fields: Any, cache_dtype: str = "f16", seam_dtype: str = "bfloat16") -> ModelShape:
    """A GGUF's shape from its parsed metadata (``gguf.GGUFReader(...).fields``)."""

    def get(key: str, default: int | None = None) -> int:
        if key in fields:
            return int(fields[key].contents())
        if default is None:
            raise InvalidRequest(f"{path.name} has no {key} metadata", param=key)
        return default

    arch = str(fields["general.architecture"].contents())
    layers, hidden = get(f"{arch}.block_count") and trunk_layers(fields, arch), get(f"{arch}.embedding_length")
    heads = get(f"{arch}.attention.head_count")
    kv_heads = get(f"{arch}.attention.head_count_kv", heads)
    head_dim = get(f"{arch}.attention.key_length", hidden // heads)
    cache_bytes, seam_bytes = dtype_bytes(cache_dtype, "cache dtype"), dtype_bytes(seam_dtype, "seam dtype")
    lora = get(f"{arch}.attention.kv_lora_rank", 0)
    if lora:
        rope = get(f"{arch}.rope.dimension_count")
        return ModelShape(
            model_stem(path), layers, hidden, "mla", cache_bytes, seam_bytes, kv_lora_rank=lora, qk_rope_head_dim=rope
        )
    name = model_stem(path)
    return ModelShape(name, layers, hidden, "gqa", cache_bytes, seam_bytes, kv_heads=kv_heads, head_dim=head_dim)


def _size(n: float) -> str:
    if n >= GIB / 10:
        return f"{n / GIB:.3f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if n >= KIB:
        return f"{n / KIB:.2f} KiB"
    return f"{n:.0f} B"


def format_plan(p: KVPlan) -> str:
    s = p.shape
    formula = (
        f"(kv_lora_rank {s.kv_lora_rank} + qk_rope_head_dim {s.qk_rope_head_dim}) x {s.cache_dtype_bytes} B"
        if s.kind == "mla"
        else f"2 x {s.kv_heads} kv heads x {s.head_dim} head dim x {s.cache_dtype_bytes} B"
    )
    per_layer = s.kv_bytes_per_token_per_layer
    return "\n".join(
        [
            f"model {s.name}: {s.layers} layers, hidden {s.hidden}, {s.kind.upper()} cache",
            f"KV per token per layer: {per_layer:,} B = {formula}",
            f"KV per token, layers {p.layers} ({len(p.layers)} layers): {p.per_token:,} B ({_size(p.per_token)})",
            f"context {p.context:,} tokens (= {p.context / 1024:g} x 1,024 = {p.context / 1000:g} x 1,000)",
            f"KV per layer at that context: {p.per_layer_at_context:,} B ({_size(p.per_layer_at_context)})",
            f"KV of layers {p.layers} at that context: {p.shard_at_context:,} B ({_size(p.shard_at_context)})",
            f"seam per decode step: {p.seam_decode_step:,} B (1 token x hidden {s.hidden} x {s.seam_dtype_bytes} B)",
            f"seam per prefill chunk of {p.prefill_chunk:,} tokens: {p.seam_prefill_chunk:,} B "
            f"({_size(p.seam_prefill_chunk)})",
            f"naive route (whole activation per token) at that context: {_size(p.seam_full_context)} per hop per token",
        ]
    )
