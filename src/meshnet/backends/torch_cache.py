"""One session's KV/state on a PyTorch shard: transformers' own cache layers, for this range only.

Decoder layers address the cache by their *absolute* ``layer_idx`` (and some read
``cache.layers[layer_idx]`` directly: DeepSeek-V4's compressors), so the cache keeps one slot per
layer up to ``stop``: slots below ``start`` are transformers' ``DummyLayer`` (no tensors, never
touched), slots ``[start, stop)`` are the cache layers ``DynamicCache(config=...)`` would build for
those layers (sliding-window, compressed, linear-attention ...). Nothing of another shard's
layers is ever stored.

Rollback: before each forward ``checkpoint`` keeps the shard slots' attributes. Growing tensors
are replaced (``torch.cat``), never written in place, so keeping the old references is enough;
linear-attention conv/recurrent states *are* updated in place, so those (fixed-size) tensors are
cloned and the live cache writes into the clone. ``rollback`` puts the saved attributes back.

Snapshots serialize every slot's tensors and scalars with ``torch.save`` (shared tensors, such
as DeepSeek-V4's K=V, stay shared) and load with ``weights_only=True``.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DummyLayer,
    DynamicCache,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange

__all__ = ["RangeCache", "Saved", "checkpoint", "dump", "load", "rollback", "state_bytes"]

# Attributes of linear-attention cache layers that the model updates in place (``copy_``,
# ``causal_conv1d_update``): a checkpoint must copy them.
_IN_PLACE = ("conv_states", "recurrent_states")
_SNAPSHOT_FORMAT = 1

Saved = list[dict[str, Any]]


class RangeCache(DynamicCache):
    """A ``DynamicCache`` holding cache layers for ``layers`` only (see the module docstring)."""

    def __init__(self, config: PretrainedConfig, layers: LayerRange) -> None:
        types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        slots: list[Any] = [DummyLayer() for _ in range(layers.start)]  # type: ignore[no-untyped-call]
        slots += [DYNAMIC_LAYER_TYPE_MAPPING[types[i]](**kwargs[i]) for i in range(layers.start, layers.stop)]
        Cache.__init__(self, layers=slots)
        self.range = layers

    @property
    def own(self) -> list[Any]:
        """The cache layers of this shard's blocks, in order."""
        return list(self.layers[self.range.start : self.range.stop])


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def state_bytes(cache: RangeCache) -> int:
    """Bytes of the session's state tensors (each shared tensor once; 0-d bookkeeping scalars excluded)."""
    seen: dict[int, int] = {}
    for layer in cache.own:
        for value in vars(layer).values():
            for t in _tensors(value):
                if t.ndim > 0:
                    seen[id(t)] = t.nbytes
    return sum(seen.values())


def checkpoint(cache: RangeCache) -> Saved:
    saved: Saved = []
    for layer in cache.own:
        attrs = {k: dict(v) if isinstance(v, dict) else v for k, v in vars(layer).items()}
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for name in _IN_PLACE:
                live = getattr(layer, name)
                for key, t in live.items():
                    if isinstance(t, torch.Tensor):
                        live[key] = t.clone()
        saved.append(attrs)
    return saved


def rollback(cache: RangeCache, saved: Saved) -> None:
    for layer, attrs in zip(cache.own, saved, strict=True):
        vars(layer).clear()
        vars(layer).update(attrs)


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _portable(value: Any, memo: dict[int, torch.Tensor]) -> tuple[bool, Any]:
    """``(keep, copy)``: a compact copy of a tensor (memoized, so aliases stay aliases) or plain value."""
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.detach().clone()
        return True, memo[id(value)]
    if isinstance(value, _PLAIN):
        return True, value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            keep, copied = _portable(v, memo)
            if not keep:
                return False, None
            out[k] = copied
        return True, out
    return False, None


def dump(cache: RangeCache, position: int, dtype: str) -> bytes:
    memo: dict[int, torch.Tensor] = {}
    layers = []
    for layer in cache.own:
        attrs = {}
        for name, value in vars(layer).items():
            keep, copied = _portable(value, memo)
            if keep:
                attrs[name] = copied
        layers.append({"class": type(layer).__name__, "attrs": attrs})
    buf = io.BytesIO()
    torch.save({"format": _SNAPSHOT_FORMAT, "position": position, "dtype": dtype, "layers": layers}, buf)
    return buf.getvalue()


def load(cache: RangeCache, body: bytes, position: int, dtype: str) -> None:
    """Fill a fresh ``cache`` from ``dump`` output; raises ``InvalidRequest`` if it does not fit."""
    try:
        payload = torch.load(io.BytesIO(body), weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError ... for bad bytes
        raise InvalidRequest(f"snapshot body is corrupt: {exc}") from None
    own = cache.own
    if not isinstance(payload, dict) or payload.get("format") != _SNAPSHOT_FORMAT:
        raise InvalidRequest("snapshot body is not a PyTorch shard state")
    if payload.get("position") != position or len(payload.get("layers", ())) != len(own):
        raise InvalidRequest("snapshot body does not match its header (position or layer count)")
    if payload.get("dtype") != dtype:
        raise InvalidRequest(f"snapshot was taken in {payload.get('dtype')}; this shard runs {dtype}")
    for layer, saved in zip(own, payload["layers"], strict=True):
        if saved["class"] != type(layer).__name__:
            raise InvalidRequest(f"snapshot holds a {saved['class']} cache where this shard has {type(layer).__name__}")
        vars(layer).update(saved["attrs"])
