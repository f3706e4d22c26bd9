"""Per-architecture glue for running a layer range of a transformers causal LM.

Each supported architecture gets an ``Arch``: how a token becomes the residual stream (head), how
one chunk runs through the range's decoder layers (absolute positions, masks, position
embeddings and cache exactly as the model's own ``forward`` builds them), how the residual stream
becomes normed hidden states for the lm_head (tail), and what the per-session cache costs. The
layers, rotary embeddings, norms, mask builders and cache classes are transformers' own: this
module only replays the few lines of each model's ``forward`` that sit around its layer loop.

Adding an architecture means a new ``Arch`` plus a parity test (docs/models.md: some models scale the
embedding or read token ids inside layers, which a generic path would get silently wrong).
"""

from __future__ import annotations

import copy
import math
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.masking_utils import (
    create_causal_mask,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
)

from meshnet.backends.shard import KVFormat, SeamSpec
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange

__all__ = ["ARCHITECTURES", "Arch", "ShardModules", "arch_for", "dtype_name", "inference"]

M = TypeVar("M", bound=nn.Module)


def inference(model: M) -> M:
    """``model`` in eval mode (transformers leaves ``PreTrainedModel.eval`` untyped)."""
    nn.Module.eval(model)
    return model


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _head_dim(config: PretrainedConfig) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class ShardModules(nn.Module):
    """The weights one shard keeps: its blocks, the rotary tables, and the head / tail extras.

    ``embed`` exists on the head only; ``norm``, ``hc_head`` (DeepSeek-V4) and ``lm_head`` on the
    tail only.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        layers: LayerRange,
        blocks: nn.ModuleList,
        rotary: nn.Module,
        *,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        hc_head: nn.Module | None = None,
        lm_head: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.range = layers
        self.blocks = blocks
        self.rotary = rotary
        self.embed = embed
        self.norm = norm
        self.hc_head = hc_head
        self.lm_head = lm_head

    @classmethod
    def take(cls, model: PreTrainedModel, layers: LayerRange) -> ShardModules:
        """The range's modules of ``model`` (shared, not copied: drop ``model`` to free the rest)."""
        core: Any = getattr(model, model.base_model_prefix)
        config = model.config
        if layers.total != config.num_hidden_layers:
            raise InvalidRequest(
                f"layer range {layers} is for {layers.total} layers; the model has {config.num_hidden_layers}"
            )
        arch_for(config).check_range(config, layers)
        tail = layers.is_tail
        return cls(
            config,
            layers,
            nn.ModuleList(core.layers[layers.start : layers.stop]),
            core.rotary_emb,
            embed=core.embed_tokens if layers.is_head else None,
            norm=core.norm if tail else None,
            hc_head=getattr(core, "hc_head", None) if tail else None,
            lm_head=model.get_output_embeddings() if tail else None,  # type: ignore[no-untyped-call]
        )

    def weight_bytes(self) -> int:
        """Bytes of parameters and persistent buffers (tied tensors counted once)."""
        unique = {t.data_ptr(): t.nbytes for t in self.state_dict().values() if t.device.type != "meta"}
        return sum(unique.values())

    def cast(self, dtype: torch.dtype, keep_fp32: set[str]) -> ShardModules:
        """A copy in ``dtype``; parameters under a module named in ``keep_fp32`` stay float32."""
        out = copy.deepcopy(self)
        for name, param in out.named_parameters():
            if param.is_floating_point() and not any(f".{k}." in f".{name}." for k in keep_fp32):
                param.data = param.data.to(dtype)
        return out


class Arch:
    """Llama-style decoder: embeddings → layers (one causal mask, one rotary table) → RMSNorm."""

    name: ClassVar[str] = "llama"
    carries_token_ids: ClassVar[bool] = False

    def seam(self, config: PretrainedConfig) -> SeamSpec:
        return SeamSpec((config.hidden_size,), carries_token_ids=self.carries_token_ids)

    def check_range(self, config: PretrainedConfig, layers: LayerRange) -> None:
        """Refuse a range this architecture cannot start or end at (``InvalidRequest``); any by default."""

    def embed(self, m: ShardModules, ids: torch.Tensor) -> torch.Tensor:
        assert m.embed is not None
        x: torch.Tensor = m.embed(ids)
        return x  # [1, n, hidden]

    def run(self, m: ShardModules, x: torch.Tensor, pos: torch.Tensor, cache: Any, ids: Any) -> torch.Tensor:
        # x: [1, n, hidden]; pos: [1, n] absolute positions
        mask = _causal_mask(m, x, pos, cache, m.range.start)
        rope = m.rotary(x, position_ids=pos)
        for block in m.blocks:
            x = block(
                x,
                attention_mask=mask,
                position_embeddings=rope,
                position_ids=pos,
                cache=cache,
                use_cache=True,
            )
        return x

    def finish(self, m: ShardModules, x: torch.Tensor) -> torch.Tensor:
        assert m.norm is not None
        out: torch.Tensor = m.norm(x)
        return out

    def kv_format(self, config: PretrainedConfig, layers: LayerRange, dtype: torch.dtype) -> KVFormat:
        b, kv, hd = dtype.itemsize, config.num_key_value_heads, _head_dim(config)
        per = 2 * kv * hd * b
        return KVFormat(
            kind="kv",
            dtype=dtype_name(dtype),
            bytes_per_token=per * len(layers),
            fixed_bytes=0,
            per_layer_bytes_per_token=(per,) * len(layers),
            formula=f"per layer per token: 2 (K, V) x {kv} kv heads x {hd} head_dim x {b} B = {per} B",
        )

    def state_bytes(self, config: PretrainedConfig, layers: LayerRange, dtype: torch.dtype, n: int) -> int:
        """What the cache holds after ``n`` positions, exactly (the tests measure it)."""
        kv = self.kv_format(config, layers, dtype)
        return 0 if n == 0 else kv.fixed_bytes + kv.bytes_per_token * n


class Qwen35MoeArch(Arch):
    """Qwen3.5-MoE text hybrid: Gated-DeltaNet linear attention with full attention every 4th layer.

    Its rotary table is multimodal (3 position streams, all equal for text); linear layers get a
    padding mask (``None`` here), full layers the causal one.
    """

    name = "qwen3_5_moe_text"

    def run(self, m: ShardModules, x: torch.Tensor, pos: torch.Tensor, cache: Any, ids: Any) -> torch.Tensor:
        types = m.config.layer_types
        mine = [types[i] for i in range(m.range.start, m.range.stop)]
        masks: dict[str, Any] = {"linear_attention": create_recurrent_attention_mask(m.config, x, None, cache)}
        if "full_attention" in mine:
            masks["full_attention"] = _causal_mask(m, x, pos, cache, m.range.start + mine.index("full_attention"))
        rope = m.rotary(x, pos[None].expand(3, -1, -1))
        for block, kind in zip(m.blocks, mine, strict=True):
            x = block(
                x,
                position_embeddings=rope,
                attention_mask=masks[kind],
                position_ids=pos,
                cache=cache,
                use_cache=True,
            )
        return x

    def kv_format(self, config: PretrainedConfig, layers: LayerRange, dtype: torch.dtype) -> KVFormat:
        b, kv, hd = dtype.itemsize, config.num_key_value_heads, _head_dim(config)
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv, k = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim
        conv = (2 * nk * dk + nv * dv) * k * b
        recurrent = nv * dk * dv * 4  # the reference delta-rule kernels keep the state in float32
        full = 2 * kv * hd * b
        types = [config.layer_types[i] for i in range(layers.start, layers.stop)]
        n_linear = types.count("linear_attention")
        return KVFormat(
            kind="hybrid",
            dtype=dtype_name(dtype),
            bytes_per_token=full * types.count("full_attention"),
            fixed_bytes=(conv + recurrent) * n_linear,
            per_layer_bytes_per_token=tuple(full if t == "full_attention" else 0 for t in types),
            formula=(
                f"full-attention layer: 2 x {kv} kv heads x {hd} head_dim x {b} B = {full} B per token; "
                f"linear-attention layer: fixed conv state (2 x {nk} x {dk} + {nv} x {dv}) x kernel {k} x {b} B "
                f"= {conv} B + recurrent state {nv} x {dk} x {dv} x 4 B (float32) = {recurrent} B"
            ),
        )


class DeepseekV4Arch(Arch):
    """DeepSeek-V4: ``hc_mult`` residual streams (the seam is ``[hc_mult, hidden]``), hash-routed
    first layers that read token ids (so every shard receives them), one sliding-window mask and
    a ``{"main", "compress"}`` pair of rotary tables; the tail collapses the streams (``hc_head``)
    before the final norm.
    """

    name = "deepseek_v4"
    carries_token_ids = True

    def seam(self, config: PretrainedConfig) -> SeamSpec:
        return SeamSpec((config.hc_mult, config.hidden_size), carries_token_ids=True)

    def embed(self, m: ShardModules, ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(m, ids)
        return x.unsqueeze(2).expand(-1, -1, m.config.hc_mult, -1).contiguous()  # [1, n, hc, hidden]

    def run(self, m: ShardModules, x: torch.Tensor, pos: torch.Tensor, cache: Any, ids: Any) -> torch.Tensor:
        flat = x[:, :, 0]  # [1, n, hidden]: the mask and rotary builders read only its shape and dtype
        mask = create_sliding_window_causal_mask(
            config=m.config,
            inputs_embeds=flat,
            attention_mask=None,
            cache=cache,
            position_ids=pos,
            layer_idx=m.range.start,
        )
        rope = {kind: m.rotary(flat, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        for block in m.blocks:
            x = block(x, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=ids, cache=cache)
        return x

    def finish(self, m: ShardModules, x: torch.Tensor) -> torch.Tensor:
        assert m.hc_head is not None
        return super().finish(m, m.hc_head(x))

    def _layer(self, config: PretrainedConfig, kind: str, b: int, n: int) -> int:
        hd, ih, window = config.head_dim, config.index_head_dim, config.sliding_window
        total: int = min(n, window - 1) * hd * b * _window_copies(kind)
        if kind == "compressed_sparse_attention":
            r = config.compress_rates[kind]
            windows, pending = divmod(n, r)
            total += windows * (hd + ih) * b  # compressed entries: attention + indexer keys
            total += pending * 2 * (2 * hd + 2 * ih) * b  # buffered kv + gate (two overlapping series)
            total += r * (hd + ih) * (b + 4) if windows else 0  # overlap: last window's Ca kv + gate
        elif kind == "heavily_compressed_attention":
            r = config.compress_rates[kind]
            windows, pending = divmod(n, r)
            total += windows * hd * b + pending * 2 * hd * b
        return total

    def state_bytes(self, config: PretrainedConfig, layers: LayerRange, dtype: torch.dtype, n: int) -> int:
        kinds = config.layer_types[layers.start : layers.stop]
        return sum(self._layer(config, kind, dtype.itemsize, n) for kind in kinds)

    def kv_format(self, config: PretrainedConfig, layers: LayerRange, dtype: torch.dtype) -> KVFormat:
        b, hd, ih, window = dtype.itemsize, config.head_dim, config.index_head_dim, config.sliding_window
        per_layer, fixed = [], 0
        for kind in config.layer_types[layers.start : layers.stop]:
            fixed += (window - 1) * hd * b * _window_copies(kind)
            if kind == "compressed_sparse_attention":
                r = config.compress_rates[kind]
                per_layer.append(math.ceil((hd + ih) * b / r))
                fixed += (r - 1) * 2 * (2 * hd + 2 * ih) * b + r * (hd + ih) * (b + 4)
            elif kind == "heavily_compressed_attention":
                r = config.compress_rates[kind]
                per_layer.append(math.ceil(hd * b / r))
                fixed += (r - 1) * 2 * hd * b
            else:
                per_layer.append(0)
        return KVFormat(
            kind="compressed",
            dtype=dtype_name(dtype),
            bytes_per_token=sum(per_layer),
            fixed_bytes=fixed,
            per_layer_bytes_per_token=tuple(per_layer),
            formula=(
                f"every layer: a sliding window of at most {window - 1} tokens x {hd} head_dim x {b} B (fixed; "
                "sliding layers store it twice, as K and V, CSA/HCA layers once, K=V); "
                f"CSA (ratio r): (head_dim {hd} + index_head_dim {ih}) x {b} B / r per token, plus at most "
                "r - 1 buffered tokens and the overlap window (fixed; its gate is float32); "
                f"HCA (ratio r): {hd} x {b} B / r per token plus at most r - 1 buffered tokens (fixed). "
                "An upper bound: exact below the window."
            ),
        )


class GlmMoeDsaArch(Arch):
    """GLM-5.x (``glm_moe_dsa``): MLA attention whose sparse (DSA) selection is chosen per token by a
    lightning indexer; ``"shared"`` layers reuse the previous full layer's top-k selection, which
    travels from layer to layer inside a shard. A range therefore starts on a ``"full"`` layer (the
    llama.cpp route's rule too): no selection has to cross a seam. The mask is always materialized
    (the indexer reads it)."""

    name = "glm_moe_dsa"

    def check_range(self, config: PretrainedConfig, layers: LayerRange) -> None:
        types = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
        if types[layers.start] != "full":
            starts = [i for i, t in enumerate(types) if t == "full"]
            raise InvalidRequest(
                f"layer {layers.start} reuses the previous layer's top-k selection, which would have to cross the "
                f"seam: a range of this model must start at one of layers {starts}",
                param="layers",
            )

    def run(self, m: ShardModules, x: torch.Tensor, pos: torch.Tensor, cache: Any, ids: Any) -> torch.Tensor:
        mask = _causal_mask(m, x, pos, cache, m.range.start, allow_is_causal_skip=False)
        rope = m.rotary(x, position_ids=pos)
        topk = None
        for block in m.blocks:
            x, topk = block(
                x,
                attention_mask=mask,
                position_embeddings=rope,
                position_ids=pos,
                cache=cache,
                use_cache=True,
                prev_topk_indices=topk,
            )
        return x

    def kv_format(self, config: PretrainedConfig, layers: LayerRange, dtype: torch.dtype) -> KVFormat:
        b, lora, rope, ih = dtype.itemsize, config.kv_lora_rank, config.qk_rope_head_dim, config.index_head_dim
        types = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
        latent = (lora + rope) * b
        per_layer = tuple(latent + (ih * b if types[i] == "full" else 0) for i in range(layers.start, layers.stop))
        return KVFormat(
            kind="mla",
            dtype=dtype_name(dtype),
            bytes_per_token=sum(per_layer),
            fixed_bytes=0,
            per_layer_bytes_per_token=per_layer,
            formula=(
                f"per layer per token: the MLA latent (kv_lora_rank {lora} + rope {rope}) x {b} B = {latent} B, "
                f"plus the indexer key {ih} x {b} B on layers computing their own top-k"
            ),
        )


def _window_copies(kind: str) -> int:
    """DeepSeek-V4 attends with K == V: the compressed layers' cache stores the window once, the
    plain sliding layers (transformers' ``DynamicSlidingWindowLayer``) store it as K and V."""
    return 2 if kind == "sliding_attention" else 1


def _causal_mask(m: ShardModules, x: torch.Tensor, pos: torch.Tensor, cache: Any, layer: int, **extra: Any) -> Any:
    """transformers' causal mask for the shard's input at absolute positions ``pos``, as layer ``layer`` sees it."""
    return create_causal_mask(
        config=m.config,
        inputs_embeds=x,
        attention_mask=None,
        cache=cache,
        position_ids=pos,
        layer_idx=layer,
        **extra,
    )


ARCHITECTURES: dict[str, Arch] = {a.name: a for a in (Arch(), Qwen35MoeArch(), DeepseekV4Arch(), GlmMoeDsaArch())}


def arch_for(config: PretrainedConfig) -> Arch:
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise InvalidRequest(
            f"architecture {config.model_type!r} has no PyTorch shard support "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})",
            param="architecture",
        )
    return arch
