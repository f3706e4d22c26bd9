"""The tiny random models each family is certified on (``tests/backends/test_certification.py``,
``make certify``, ``benchmarks/bench_families.py``): one per GGUF architecture, with the cuts and
prefill chunks it is held to. Hidden 64, 6 to 12 blocks, a ~400-token tokenizer trained on the spot;
each config sets what the family's converter and graph read (small expert counts, head sizes, the
layer patterns a cut must respect) and token ids inside the vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tests.certify.convert import TinyModel

CUTS = [(3,), (1, 4), (2, 5)]  # of 6 blocks: 2 shards, and 3 shards of uneven sizes
CUTS_FOR = {
    "smollm3": [(4,), (4, 8), (8,)],  # of 12 blocks, ranges starting at multiples of 4
    # of 9 hybrid blocks: every range holds both kinds; cuts on and off the pattern
    "qwen3next": [(4,), (3, 7), (5,)],
    "qwen35moe": [(4,), (3, 7), (5,)],
    "glm-dsa": [(2,), (1, 4), (2, 4)],  # ranges start where a layer computes its own top-k
    # of 9 blocks: the two hash-routed layers stay on the head, every range holds CSA and HCA layers
    "deepseek4": [(4,), (4, 6), (5,)],
    # of 9 blocks (recurrent, recurrent, attention) x 3: every range holds both kinds
    **{arch: [(4,), (3, 7), (5,)] for arch in ("qwen35", "lfm2", "lfm2moe", "jamba", "granitehybrid")},
    # (Mamba-2, MoE, attention) x 3: a range needs a Mamba-2 and an attention layer
    "nemotron_h_moe": [(4,), (3, 6), (5,)],
    "llama4": [(4,), (4, 8), (8,)],  # of 12 blocks: every 4th skips rope, and every range needs one
    "afmoe": [(4,), (4, 8), (8,)],  # of 12 blocks, ranges starting at multiples of 4 (every 4th skips rope)
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
# Qwen3.5's partial multimodal rope (interleaved sections), as its text models configure it
QWEN35_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [1, 1, 0],
    "mrope_interleaved": True,
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
            "rope_parameters": QWEN35_ROPE,
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

# Token ids the tiny vocabulary holds (transformers' defaults for some families point past it).
IDS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
# Four experts, two per token: every MoE family's routing runs, in a model this small.
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
LOCAL_EXPERTS = {"num_local_experts": 4, "num_experts_per_tok": 2}
FULL_KV = {"num_key_value_heads": 4}  # families whose llama.cpp graph has no grouped-query attention
# Granite's multipliers away from 1, so that a scale applied at the wrong place would show.
GRANITE_SCALES = {"embedding_multiplier": 12.0, "residual_multiplier": 0.5, "logits_scaling": 4.0}
SIGMOID_ROUTER = {"scoring_func": "sigmoid"}  # what the converter writes as the expert gating function
MAMBA2 = {
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
}
HYBRID_9 = ["conv", "conv", "full_attention"] * 3  # LFM2's short convolutions and attention


def _tiny(arch: str, model_type: str, config: dict[str, Any] | None = None, **kw: Any) -> TinyModel:
    return TinyModel(arch, model_type, {**IDS, **(config or {})}, **kw)


TINY.update(
    {
        m.arch: m
        for m in (
            _tiny("stablelm", "stablelm"),
            _tiny("starcoder2", "starcoder2"),
            _tiny("olmo", "olmo"),
            _tiny("olmoe", "olmoe", {"num_experts": 4, "num_experts_per_tok": 2, **FULL_KV}),
            _tiny("granitemoe", "granitemoe", {**LOCAL_EXPERTS, **GRANITE_SCALES, "attention_multiplier": 0.2}),
            _tiny("granite_swa", "granite_swa", {"sliding_window": 16, **GRANITE_SCALES}),
            _tiny("arcee", "arcee", {"head_dim": 16}),
            _tiny("seed_oss", "seed_oss", {"head_dim": 16}),
            _tiny(
                "apertus", "apertus", {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
            ),
            _tiny("hunyuan-dense", "hunyuan_v1_dense", {"head_dim": 16}),
            _tiny("hy_v3", "hy_v3", {"head_dim": 16, **EXPERTS, "num_shared_experts": 1}),
            _tiny("falcon", "falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
            _tiny("chatglm", "glm", {"head_dim": 16}),
            _tiny("jais2", "jais2", {"head_dim": 16}),
            _tiny("ernie4_5", "ernie4_5", {"head_dim": 16}, tokenizer="spm"),
            _tiny(
                "ernie4_5-moe",
                "ernie4_5_moe",
                {
                    "head_dim": 16,
                    "moe_num_experts": 4,
                    "moe_k": 2,
                    "moe_intermediate_size": 64,
                    "moe_num_shared_experts": 1,
                    "moe_layer_start_index": 1,  # one dense layer first
                    "moe_layer_end_index": 5,
                },
                tokenizer="spm",
            ),
            _tiny("nemotron", "nemotron", {"head_dim": 16}, tokenizer="spm"),
            _tiny("command-r", "cohere", {"tie_word_embeddings": True}),
            # sliding windows on 3 layers of 4; the full-attention layers skip rope
            _tiny(
                "cohere2",
                "cohere2",
                {"head_dim": 16, "sliding_window": 16, "tie_word_embeddings": True},
                raw_config={"rotary_pct": 1.0},
            ),
            _tiny("cohere2moe", "cohere2_moe", {"head_dim": 16, **EXPERTS, "sliding_window": 16}),
            # learned position embeddings added to the token embeddings at the head
            _tiny("gpt2", "gpt2", {"n_head": 4}, raw_config={"n_ctx": 512}),
            _tiny("starcoder", "gpt_bigcode", {"n_head": 4}),
            _tiny("gptneox", "gpt_neox", raw_config={"rotary_pct": 0.25}),
            # ALiBi, and a norm over the token embeddings at the head
            _tiny("bloom", "bloom", {"n_head": 4}),
            _tiny("phi2", "phi", {**FULL_KV, "intermediate_size": 256}),
            _tiny(
                "minimax-m2",
                "minimax_m2",
                {"head_dim": 16, **LOCAL_EXPERTS},
                raw_config={"rotary_dim": 16, **SIGMOID_ROUTER},
            ),
            # sliding windows on every other layer, attention sinks
            _tiny(
                "gpt-oss",
                "gpt_oss",
                {
                    "head_dim": 16,
                    **LOCAL_EXPERTS,
                    "sliding_window": 16,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                },
            ),
            _tiny(
                "dots1",
                "dots1",
                {
                    "n_routed_experts": 4,
                    "num_experts_per_tok": 2,
                    "n_shared_experts": 1,
                    "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1,
                    **FULL_KV,
                },
                raw_config=SIGMOID_ROUTER,
            ),
            _tiny(
                "afmoe",
                "afmoe",
                {
                    "head_dim": 16,
                    **EXPERTS,
                    "num_dense_layers": 1,
                    "num_shared_experts": 1,
                    "global_attn_every_n_layers": 4,
                    "sliding_window": 16,
                    "mup_enabled": True,
                },
                layers=12,
            ),
            # llama.cpp gives Llama 4 an 8192-token attention chunk whatever the config says: the same here
            _tiny(
                "llama4",
                "llama4_text",
                {
                    "head_dim": 16,
                    **LOCAL_EXPERTS,
                    "num_experts_per_tok": 1,
                    "intermediate_size_mlp": 128,
                    "attention_chunk_size": 8192,
                    "interleave_moe_layer_step": 2,
                },
                layers=12,
            ),
            _tiny(
                "exaone-moe",
                "exaone_moe",
                {"head_dim": 16, **EXPERTS, "num_shared_experts": 1, "sliding_window": 16, "sliding_window_pattern": 4},
                raw_config=SIGMOID_ROUTER,
            ),
            # llama.cpp gives EXAONE 4 sliding windows only at 64 layers (the 32B): the 1.2B's graph
            _tiny(
                "exaone4", "exaone4", {"head_dim": 16, "sliding_window": None, "layer_types": ["full_attention"] * 6}
            ),
            _tiny(
                "mellum",
                "mellum",
                {
                    "head_dim": 16,
                    **LOCAL_EXPERTS,
                    "moe_intermediate_size": 32,
                    "sliding_window": 16,
                    "layer_types": ["sliding_attention", "full_attention"] * 3,
                },
            ),
            _tiny(
                "qwen35",
                "qwen3_5_text",
                {
                    "head_dim": 16,
                    "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16,
                    "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4,
                    "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 3,
                    "rope_parameters": QWEN35_ROPE,
                },
                layers=9,
                convert_args=("--no-mtp",),
            ),
            # state-space models: every layer recurrent, no KV
            _tiny("mamba", "mamba", {"state_size": 16, "time_step_rank": 8}),
            _tiny(
                "mamba2",
                "mamba2",
                {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 1, "chunk_size": 16, "expand": 2},
            ),
            # Mamba-2 heads and attention side by side in every layer
            _tiny("falcon-h1", "falcon_h1", {**MAMBA2, "mamba_d_ssm": 128, "head_dim": 16}),
            _tiny(
                "lfm2",
                "lfm2",
                {"layer_types": HYBRID_9, "block_ff_dim": 128, "block_auto_adjust_ff_dim": False},
                layers=9,
            ),
            _tiny(
                "lfm2moe",
                "lfm2_moe",
                {**EXPERTS, "num_dense_layers": 1, "layer_types": HYBRID_9, "tie_word_embeddings": True},
                layers=9,
            ),
            _tiny(
                "jamba",
                "jamba",
                {
                    "num_experts": 4,
                    "num_experts_per_tok": 2,
                    "attn_layer_period": 3,
                    "attn_layer_offset": 2,
                    "expert_layer_period": 2,
                    "expert_layer_offset": 1,
                    "mamba_d_state": 16,
                    "mamba_dt_rank": 8,
                    "use_mamba_kernels": False,
                },
                layers=9,
                tokenizer="spm",
            ),
            # Granite 4 hybrid as Bamba writes it: Mamba-2 layers, attention at 2, 5 and 8
            _tiny("granitehybrid", "bamba", {**MAMBA2, "attn_layer_indices": [2, 5, 8]}, layers=9),
            _tiny(
                "nemotron_h_moe",
                "nemotron_h",
                {
                    "head_dim": 16,
                    "ssm_state_size": 16,
                    "mamba_num_heads": 8,
                    "mamba_head_dim": 16,
                    "n_groups": 1,
                    "chunk_size": 16,
                    "n_routed_experts": 4,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "moe_shared_expert_intermediate_size": 32,
                    "layers_block_type": ["mamba", "moe", "attention"] * 3,
                },
                layers=9,
            ),
        )
    }
)
# A family the table refuses, with a tiny model: refused by every command.
UNCERTIFIED = _tiny(
    "minicpm3",
    "minicpm3",
    {
        "head_dim": 16,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        **FULL_KV,
    },
    tokenizer="spm",
)
