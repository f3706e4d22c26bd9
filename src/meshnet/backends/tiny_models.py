"""Tiny random models of the architectures Meshnet targets, built in code with a fixed seed.

They run on a CPU in milliseconds and exercise the real transformers model classes (hyper-
connections and compressed attention of DeepSeek-V4, the linear-attention / full-attention hybrid
of Qwen3.5-MoE), so parity tests and benchmarks can split them like real models. The configs are
verified to give ``generate`` with cache == without cache on transformers 5.24.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
)

from meshnet.backends.torch_models import inference

__all__ = ["TINY_MODELS", "tiny_deepseek_v4", "tiny_glm_moe_dsa", "tiny_llama", "tiny_qwen3_5_moe"]

VOCAB = 256
HIDDEN = 64
LAYERS = 4

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
}


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)


def tiny_llama(seed: int = 0) -> PreTrainedModel:
    """Plain llama (grouped-query attention, KV grows per token): the cheapest KV architecture."""
    _seeded(seed)
    config = LlamaConfig(**_COMMON, num_key_value_heads=2, head_dim=16)
    return inference(LlamaForCausalLM(config))


def tiny_deepseek_v4(seed: int = 0, *, sliding_window: int = 16) -> PreTrainedModel:
    """DeepSeek-V4: 4 hyper-connection streams, layers sliding / sliding / CSA (ratio 4) / HCA (ratio 128).

    ``sliding_window`` is lowered from the default 128 so short tests see the window fill up and
    the CSA compressor emit entries.
    """
    _seeded(seed)
    config = AutoConfig.for_model(
        "deepseek_v4",
        **_COMMON,
        moe_intermediate_size=32,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        o_lora_rank=32,
        qk_rope_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        index_head_dim=16,
        index_n_heads=4,
        index_topk=8,
        compress_ratios=[0, 0, 4, 128],
        num_hash_layers=1,
        o_groups=2,
        first_k_dense_replace=1,
        sliding_window=sliding_window,
    )
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return inference(model)


def tiny_qwen3_5_moe(seed: int = 0) -> PreTrainedModel:
    """Qwen3.5-MoE text hybrid (Ornith's base): 3 linear-attention layers, then 1 full-attention layer."""
    _seeded(seed)
    config = Qwen3_5MoeTextConfig(
        **_COMMON,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        head_dim=16,
        num_key_value_heads=2,
    )
    return inference(Qwen3_5MoeForCausalLM(config))


def tiny_glm_moe_dsa(seed: int = 0) -> PreTrainedModel:
    """GLM-5.x (MLA + DSA): one dense layer, then MoE; a top-8 selection (sparse within a prompt of
    21), layers 1 and 3 reusing the previous layer's selection as GLM-5.2 does."""
    _seeded(seed)
    config = AutoConfig.for_model(
        "glm_moe_dsa",
        **_COMMON,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        n_group=1,
        topk_group=1,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=2,
        num_nextn_predict_layers=0,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        indexer_types=["full", "shared", "full", "shared"],
    )
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return inference(model)


TINY_MODELS = {
    "llama": tiny_llama,
    "deepseek_v4": tiny_deepseek_v4,
    "qwen3_5_moe_text": tiny_qwen3_5_moe,
    "glm_moe_dsa": tiny_glm_moe_dsa,
}
