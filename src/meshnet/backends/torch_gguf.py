"""Load a layer range of a GGUF file into transformers modules, dequantizing only that range.

gguf-py memory-maps the file, so opening it costs only the metadata parse (the tokenizer arrays
dominate: ~3 s for SmolLM2); open a ``GgufCheckpoint`` once and build every shard from it.
transformers' own GGUF tables do the naming: its config-key mapping, its tensor-name map
(``get_gguf_hf_weights_map`` over a weightless ``meta`` model) and its tensor processor, which
undoes llama.cpp's Q/K row permutation (K with the KV head count). Weights are dequantized with
``gguf.dequantize`` to float32 and cast to the requested dtype.

Only llama is enabled: every other architecture needs its own parity test first (docs/models.md).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
)

from meshnet.backends.torch_models import ShardModules, inference
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange

__all__ = ["GGUF_ARCHITECTURES", "GgufCheckpoint"]

GGUF_ARCHITECTURES = ("llama",)

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


class GgufCheckpoint:
    """One opened GGUF file: its transformers config, and dequantized weights on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise InvalidRequest(f"GGUF file not found: {self.path}", param="gguf")
        self._reader = gguf.GGUFReader(str(self.path))
        arch = _field(self._reader, "general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise InvalidRequest(
                f"GGUF architecture {arch!r} is not enabled for the PyTorch backend "
                f"(enabled: {', '.join(GGUF_ARCHITECTURES)}); use the llama.cpp backend",
                param="gguf",
            )
        self.architecture: str = arch
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._refuse_unsupported()
        self.config = self._config()
        with torch.device("meta"):
            self._skeleton: PreTrainedModel = AutoModelForCausalLM.from_config(self.config)  # type: ignore[no-untyped-call]
        config_dict = self.config.to_dict()
        processor_class: Any = TENSOR_PROCESSORS.get(arch, TensorProcessor)
        self._processor: TensorProcessor = processor_class(config=config_dict)
        self._hf_names: dict[str, str] = get_gguf_hf_weights_map(self._skeleton, self._processor)

    def _refuse_unsupported(self) -> None:
        """GGUF features the config mapping below would silently drop (wrong text, no error)."""
        arch = self.architecture
        found = [key for key in self._reader.fields if key.startswith(f"{arch}.rope.scaling.")]
        found += [key for key in (f"{arch}.expert_count",) if key in self._reader.fields]
        found += [name for name in ("rope_freqs.weight",) if name in self._tensors]
        if found:
            raise InvalidRequest(
                f"{self.path.name} uses {', '.join(found)}, which the PyTorch backend does not map yet; "
                "use the llama.cpp backend",
                param="gguf",
            )

    @property
    def model_id(self) -> str:
        return self.path.stem

    def _config(self) -> PretrainedConfig:
        prefix = f"{self.architecture}."
        values: dict[str, Any] = {}
        mapping: dict[str, str | None] = cast(Any, GGUF_CONFIG_MAPPING)[self.architecture]
        for gguf_key, hf_key in mapping.items():
            value = _field(self._reader, prefix + gguf_key)
            if value is not None and hf_key is not None:
                values[hf_key] = value
        if "vocab_size" not in values:
            values["vocab_size"] = len(self._reader.fields["tokenizer.ggml.tokens"].data)
        for name in ("bos", "eos"):
            token = _field(self._reader, f"tokenizer.ggml.{name}_token_id")
            if token is not None:
                values[f"{name}_token_id"] = int(token)
        values["tie_word_embeddings"] = "output.weight" not in self._tensors
        config: PretrainedConfig = AutoConfig.for_model(self.architecture, **values)
        return config

    # -- weights -----------------------------------------------------------------------------
    def _dequantized(self, gguf_name: str, dtype: torch.dtype) -> torch.Tensor:
        tensor = self._tensors[gguf_name]
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        weights = self._processor.process(weights=weights, name=gguf_name).weights  # type: ignore[no-untyped-call]
        # Unquantized tensors come back as read-only views of the memory map: copy those.
        array = np.array(weights, dtype=np.float32, copy=not weights.flags.writeable, order="C")
        return torch.from_numpy(array).to(dtype)

    def state_dict(self, layers: LayerRange | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """transformers-named weights of ``layers`` (all of them for ``None``), plus head/tail extras."""
        total = self.config.num_hidden_layers
        layers = layers or LayerRange.full(total)
        out: dict[str, torch.Tensor] = {}
        for gguf_name in self._tensors:
            block = _BLOCK.match(gguf_name)
            hf_name = self._hf_names.get(gguf_name)
            if hf_name is None:
                continue  # e.g. rope_freqs: not a transformers parameter
            if block is not None:
                wanted = layers.start <= int(block.group(1)) < layers.stop
            elif hf_name == "model.embed_tokens.weight":
                wanted = layers.is_head
            else:
                wanted = layers.is_tail
            if wanted:
                out[hf_name] = self._dequantized(gguf_name, dtype)
        if layers.is_tail and self.config.tie_word_embeddings:
            embed = out.get("model.embed_tokens.weight")
            out["lm_head.weight"] = embed if embed is not None else self._dequantized("token_embd.weight", dtype)
        return out

    def shard_modules(self, layers: LayerRange, dtype: torch.dtype) -> ShardModules:
        """The range's modules with only the range's weights materialized."""
        # The skeleton's modules live on the meta device: copy them (cheap) so that shards never
        # share parameters, then assign the dequantized weights.
        modules = copy.deepcopy(ShardModules.take(self._skeleton, layers))
        renamed = {_shard_name(k, layers.start): t for k, t in self.state_dict(layers, dtype).items()}
        modules.load_state_dict(renamed, strict=True, assign=True)
        modules.rotary = _fresh_rotary(self._skeleton, self.config)  # computed tables, not weights
        return inference(modules)

    def causal_lm(self, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
        """The whole model built from the same dequantized weights (the parity reference)."""
        model = copy.deepcopy(self._skeleton)
        model.load_state_dict(self.state_dict(None, dtype), strict=True, assign=True)
        core: Any = getattr(model, model.base_model_prefix)
        core.rotary_emb = _fresh_rotary(self._skeleton, self.config)
        return inference(model)


def _shard_name(hf_name: str, start: int) -> str:
    """``model.layers.12.mlp.up_proj.weight`` → ``blocks.{12 - start}.mlp.up_proj.weight``."""
    if hf_name.startswith("model.layers."):
        index, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        return f"blocks.{int(index) - start}.{rest}"
    return {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(hf_name, hf_name)


def _fresh_rotary(skeleton: PreTrainedModel, config: PretrainedConfig) -> nn.Module:
    core: Any = getattr(skeleton, skeleton.base_model_prefix)
    rotary: nn.Module = type(core.rotary_emb)(config=config)
    return rotary
