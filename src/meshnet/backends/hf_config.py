"""Model shapes from Hugging Face configs, for ``meshnet plan`` (``backends.audit``): transformers'
config classes, parameters counted on a model built on the meta device (no memory, no download),
and KV/state per layer by layer type with the PyTorch backend's own accounting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from meshnet.backends.torch_models import ARCHITECTURES
from meshnet.backends.torch_shard import StoreBudget, TorchShard
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange

__all__ = ["config_for", "hf_model_type", "layer_kv", "load_hf_shard", "parameter_counts"]

_CACHE_BYTES = 2  # bf16/f16 KV cells


def hf_model_type(folder: Path) -> tuple[str, int]:
    """``(model_type, num_hidden_layers)`` of a saved transformers model folder."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"{folder} holds no readable config.json ({exc}): pass a folder saved with "
                             "save_pretrained", param="hf") from None  # fmt: skip
    raw = raw.get("text_config", raw)
    if not isinstance(raw.get("model_type"), str) or not isinstance(raw.get("num_hidden_layers"), int):
        raise InvalidRequest(f"{path} names no model_type and num_hidden_layers", param="hf")
    return raw["model_type"], raw["num_hidden_layers"]


def load_hf_shard(folder: Path, layers: LayerRange, *, model_id: str, budget: StoreBudget) -> TorchShard:
    """One layer range of a saved transformers model (float32), as a PyTorch shard."""
    if not any(folder.glob("*.safetensors")):
        raise InvalidRequest(f"{folder} holds no *.safetensors weights", param="hf")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return TorchShard.from_model(model, layers, model_id=model_id, budget=budget)


def config_for(model_type: str, fields: dict[str, Any]) -> Any:
    return AutoConfig.for_model(model_type, **fields)


def parameter_counts(config: Any) -> tuple[tuple[int, ...], dict[str, int]]:
    """Parameters of each decoder layer, and of the modules outside the layers, of the model
    ``config`` describes — counted on transformers' own model, built on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    body = model.model
    layers = tuple(sum(p.numel() for p in layer.parameters()) for layer in body.layers)
    outer = {
        name: sum(p.numel() for p in module.parameters())
        for name, module in body.named_children()
        if name != "layers" and any(True for _ in module.parameters())
    }
    if not getattr(config, "tie_word_embeddings", False):
        outer["lm_head"] = sum(p.numel() for p in model.lm_head.parameters())
    return layers, outer


def layer_kv(config: Any, total: int) -> tuple[str, list[int], list[int], str]:
    """Per layer: KV bytes per token, and fixed bytes per session (recurrent states, windows); the
    kind and the formula — the PyTorch backend's own accounting for hybrid and compressed models."""
    arch = ARCHITECTURES.get(config.model_type)
    if arch is not None and arch.name != "llama":
        per_token, fixed = [], []
        for i in range(total):  # fixed state per layer: a one-layer range each
            kv = arch.kv_format(config, LayerRange(i, i + 1, total), torch.bfloat16)
            per_token.append(kv.bytes_per_token)
            fixed.append(kv.fixed_bytes)
        return kv.kind, per_token, fixed, kv.formula
    lora = getattr(config, "kv_lora_rank", None)
    if lora:
        rope = config.qk_rope_head_dim
        latent = (lora + rope) * _CACHE_BYTES
        index_dim = getattr(config, "index_head_dim", 0) or 0
        types = getattr(config, "indexer_types", None) or ["full"] * total
        per_token = [
            latent + (index_dim * _CACHE_BYTES if index_dim and types[i] == "full" else 0) for i in range(total)
        ]
        formula = f"MLA latent (kv_lora_rank {lora} + rope {rope}) x {_CACHE_BYTES} B per token and layer"
        if index_dim:
            formula += f"; DSA indexer key {index_dim} x {_CACHE_BYTES} B on layers that compute their own top-k"
        return "mla", per_token, [0] * total, formula
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per = 2 * kv_heads * head_dim * _CACHE_BYTES
    return "gqa", [per] * total, [0] * total, f"2 x {kv_heads} kv heads x {head_dim} head dim x {_CACHE_BYTES} B"
