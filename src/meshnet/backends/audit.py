"""``meshnet plan --nodes N``: what serving a model over N nodes costs, from its ``config.json``.

Weights are counted, not estimated: transformers builds the model on the ``meta`` device (no memory,
no download) and every decoder layer's parameters are summed, as are the embeddings, the final norm
and the lm_head (plus DeepSeek-V4's ``hc_head``). KV and recurrent state per layer come from the same
formulas the backends account with (``backends.torch_models`` for hybrid and compressed-attention
models; MLA plus the DSA indexer keys for GLM-5.x; GQA otherwise). The seam is what one decode step
sends across one cut: the residual stream (``hc_mult`` streams for DeepSeek-V4) and, where layers
read them, the token id.

Layers are laid out over the nodes as ``meshnet up`` would: the allowed cuts (the family's rules)
nearest to an even split; the busiest node is what must fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange

__all__ = ["Audit", "NodeCost", "audit", "format_audit", "is_model_config"]

GIB = 2**30


@dataclass(frozen=True, slots=True)
class NodeCost:
    layers: LayerRange
    weight_bytes: int
    kv_bytes: int  # at the audited context, fixed states included

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True, slots=True)
class Audit:
    name: str
    model_type: str
    params: int
    layer_params: tuple[int, ...]
    outer_params: dict[str, int]  # embeddings, norm, lm_head, ...
    weight_bits: float
    kv_kind: str
    kv_per_token: tuple[int, ...]  # per layer, bytes per token
    kv_fixed: tuple[int, ...]  # per layer, bytes per session whatever the length
    kv_formula: str
    seam_shape: tuple[int, ...]
    seam_token_ids: bool
    seam_dtype_bytes: int
    context: int
    nodes: tuple[NodeCost, ...]
    nodes_asked: int

    @property
    def seam_decode_step(self) -> int:
        elements = 1
        for n in self.seam_shape:
            elements *= n
        return elements * self.seam_dtype_bytes + (4 if self.seam_token_ids else 0)

    def weight_bytes(self, params: int) -> int:
        return int(params * self.weight_bits / 8)

    @property
    def kv_at_context(self) -> int:
        return sum(self.kv_per_token) * self.context + sum(self.kv_fixed)


def is_model_config(path: Path) -> bool:
    """A Hugging Face ``config.json`` (or a folder holding one) that names its ``model_type``."""
    if path.is_dir():
        path = path / "config.json"
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("text_config", raw).get("model_type"), str)


def _config(path: Path) -> tuple[str, Any]:
    from meshnet.backends.hf_config import config_for

    if path.is_dir():
        path = path / "config.json"
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"{path} is not a readable config.json: {exc}", param="config") from None
    raw = raw.get("text_config", raw)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise InvalidRequest(f"{path} names no model_type", param="config")
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "transformers_version")}
    try:
        name = path.parent.name if path.name == "config.json" else path.stem
        return name, config_for(model_type, fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(f"transformers cannot build a {model_type!r} config from {path}: {exc}") from None


def _starts(config: Any, total: int) -> list[int]:
    """Where a range may start, by the family rules the shard writer enforces (``range_starts``)."""
    indexers = getattr(config, "indexer_types", None)
    if indexers:  # GLM-5.x: only on layers computing their own top-k selection
        return [i for i, t in enumerate(indexers[:total]) if t == "full"]
    types = getattr(config, "layer_types", None)
    if types and "linear_attention" in types:  # hybrids: right after a full-attention layer
        return [i for i in range(total) if i == 0 or types[i - 1] != "linear_attention"]
    return list(range(total))


def audit(path: Path, *, context: int, nodes: int, weight_bits: float = 4.5, seam_dtype_bytes: int = 2) -> Audit:
    """The cost of serving the model of ``path`` (a config.json or its folder) over ``nodes`` nodes."""
    from meshnet.backends.torch_models import ARCHITECTURES
    from meshnet.layers import split_layers

    if context < 1 or nodes < 1 or not 1 <= weight_bits <= 32:
        raise InvalidRequest("--context and --nodes must be positive, --weight-bits within 1..32")
    from meshnet.backends.hf_config import layer_kv, parameter_counts

    name, config = _config(path)
    layer_params, outer = parameter_counts(config)
    total = len(layer_params)
    kind, per_token, fixed, formula = layer_kv(config, total)
    arch = ARCHITECTURES.get(config.model_type)
    seam = arch.seam(config) if arch is not None else None
    shape = seam.shape if seam is not None else (config.hidden_size,)
    token_ids = bool(seam is not None and seam.carries_token_ids)
    ranges = split_layers(total, min(nodes, len(_starts(config, total))), _starts(config, total))
    head_extra = outer.get("embed_tokens", 0)
    tail_extra = sum(v for k, v in outer.items() if k != "embed_tokens")
    costs = []
    for r in ranges:
        params = sum(layer_params[r.start : r.stop])
        params += head_extra if r.is_head else 0
        params += tail_extra if r.is_tail else 0
        kv = sum(per_token[r.start : r.stop]) * context + sum(fixed[r.start : r.stop])
        costs.append(NodeCost(r, int(params * weight_bits / 8), kv))
    return Audit(
        name=name,
        model_type=config.model_type,
        params=sum(layer_params) + sum(outer.values()),
        layer_params=layer_params,
        outer_params=outer,
        weight_bits=weight_bits,
        kv_kind=kind,
        kv_per_token=tuple(per_token),
        kv_fixed=tuple(fixed),
        kv_formula=formula,
        seam_shape=tuple(shape),
        seam_token_ids=token_ids,
        seam_dtype_bytes=seam_dtype_bytes,
        context=context,
        nodes=tuple(costs),
        nodes_asked=nodes,
    )


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _groups(values: tuple[int, ...]) -> str:
    """Each distinct per-layer figure once, with how many layers have it: ``8 (22 layers), 320 (21 layers)``."""
    counts: dict[int, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return ", ".join(f"{value:,}" + (f" ({n} layers)" if n > 1 else " (1 layer)") for value, n in counts.items())


def format_audit(a: Audit) -> str:
    busiest = max(a.nodes, key=lambda n: n.total)
    seam = " x ".join(str(n) for n in a.seam_shape)
    lines = [
        f"model {a.name} ({a.model_type}): {a.params / 1e9:,.1f}B parameters, {len(a.layer_params)} layers",
        f"parameters per layer: {_groups(a.layer_params)}",
        "outside the layers: " + ", ".join(f"{k} {v:,}" for k, v in a.outer_params.items()),
        f"weights at {a.weight_bits:g} bits/parameter: {_gib(a.weight_bytes(a.params))} in all, "
        f"{_gib(a.weight_bytes(max(a.layer_params)))} for the largest layer",
        f"KV ({a.kv_kind}) per token, per layer: {_groups(a.kv_per_token)} B ({a.kv_formula})",
        f"KV per token, whole model: {sum(a.kv_per_token):,} B; fixed state per session: {sum(a.kv_fixed):,} B",
        f"KV of one session at {a.context:,} tokens: {_gib(a.kv_at_context)}",
        f"seam per decode step: {a.seam_decode_step:,} B ([{seam}] x {a.seam_dtype_bytes} B"
        + (" + a 4 B token id" if a.seam_token_ids else "")
        + ")",
        f"{len(a.nodes)} nodes (cuts nearest to an even split"
        + (
            f"; asked for {a.nodes_asked}, but the family's cut rules allow no more"
            if len(a.nodes) < a.nodes_asked
            else ""
        )
        + f"), one session of {a.context:,} tokens:",
    ]
    for n in a.nodes:
        mark = "  <- busiest" if n is busiest else ""
        lines.append(
            f"  layers {n.layers!s:<8} weights {_gib(n.weight_bytes):>12}  KV {_gib(n.kv_bytes):>10}  "
            f"total {_gib(n.total):>12}{mark}"
        )
    return "\n".join(lines)
