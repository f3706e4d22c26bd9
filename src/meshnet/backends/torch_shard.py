"""``TorchShard``: a layer range of a transformers causal LM, with per-session local KV/state.

The reference backend: it runs transformers' own decoder layers (``torch_models`` holds the small
per-architecture glue), so it is the path to architectures llama.cpp lacks (DeepSeek-V4's
hyper-connections and compressed attention, Qwen3.5-MoE's linear-attention hybrid) and the ground
truth the llama.cpp shards are compared with. Supported: ``torch_models.ARCHITECTURES``.

Ownership: the shard owns its weights (the range's blocks; the head also the embeddings, the tail
the final norm and the lm_head) and nothing else. Each session's cache (``torch_cache.RangeCache``)
lives in the shard's ``SessionStore``. ``ShardBase`` validates inputs and reserves positions
before any compute; a forward that fails is rolled back from the checkpoint taken before it, so a
rejected or failed call leaves the session as it was.

Concurrency: one forward at a time per shard (``ShardBase``'s compute lock). torch's intra-op
threads are process-wide: set them once at the composition root (``torch.set_num_threads``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicLayer

from meshnet.backends import torch_cache
from meshnet.backends.grammar import TokenGrammar
from meshnet.backends.llama_vocab import LlamaVocab
from meshnet.backends.shard import ShardBase, ShardInfo, ShardOutput
from meshnet.backends.torch_cache import RangeCache
from meshnet.backends.torch_gguf import GgufCheckpoint
from meshnet.backends.torch_models import Arch, ShardModules, arch_for, dtype_name, inference
from meshnet.errors import EngineError, InvalidRequest, MeshnetError
from meshnet.ids import SessionId
from meshnet.layers import LayerRange
from meshnet.session.store import StoreLimits

__all__ = ["BACKEND", "StoreBudget", "TorchSession", "TorchShard", "set_threads"]

BACKEND = "torch"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class StoreBudget:
    """The operator's share of a shard's session store; the per-token costs come from the model."""

    budget_bytes: int = 1 << 30
    max_sessions: int = 64
    idle_ttl_s: float = 600.0


@dataclass(slots=True)
class TorchSession:
    """One session's state on this shard: its cache, how many positions it holds, and the undo point."""

    cache: RangeCache
    position: int = 0
    undo: tuple[int, torch_cache.Saved] | None = field(default=None, repr=False)


def _dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        value = dtype_name(value)
    if value not in DTYPES:
        raise InvalidRequest(f"torch_dtype must be one of {', '.join(DTYPES)}, got {value!r}", param="torch_dtype")
    return DTYPES[value]


class TorchShard(ShardBase[TorchSession]):
    def __init__(
        self, modules: ShardModules, *, dtype: torch.dtype, model_id: str, budget: StoreBudget | None = None
    ) -> None:
        """``dtype``: what the residual stream and the cache run in (some modules may stay float32)."""
        super().__init__()
        budget = budget or StoreBudget()
        self.modules = modules
        self.arch: Arch = arch_for(modules.config)
        config = modules.config
        self.dtype = dtype
        # The GGUF a tail shard came from: its tokenizer compiles grammars (``grammar``), loaded when first asked.
        self.vocab_source: Path | None = None
        self._vocab: LlamaVocab | None = None
        kv = self.arch.kv_format(config, modules.range, self.dtype)
        self.info = ShardInfo(
            model_id=model_id,
            architecture=config.model_type,
            backend=BACKEND,
            layers=modules.range,
            seam=self.arch.seam(config),
            n_vocab=config.vocab_size,
            max_positions=config.max_position_embeddings,
            weight_bytes=modules.weight_bytes(),
            kv=kv,
            numerics=f"torch {torch.__version__} cpu; threads {torch.get_num_threads()}; {dtype_name(dtype)}",
        )
        self._init_store(
            StoreLimits(
                bytes_per_token=kv.bytes_per_token,
                fixed_bytes=kv.fixed_bytes,
                budget_bytes=budget.budget_bytes,
                max_sessions=budget.max_sessions,
                max_positions=config.max_position_embeddings,
                idle_ttl_s=budget.idle_ttl_s,
            )
        )

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def from_gguf(
        cls,
        source: str | Path | GgufCheckpoint,
        layers: LayerRange,
        *,
        torch_dtype: torch.dtype | str = torch.float32,
        budget: StoreBudget | None = None,
    ) -> TorchShard:
        """Dequantize only ``layers`` (plus embeddings on the head, norm + lm_head on the tail)."""
        checkpoint = source if isinstance(source, GgufCheckpoint) else GgufCheckpoint(source)
        dtype = _dtype(torch_dtype)
        modules = checkpoint.shard_modules(layers, dtype)
        shard = cls(modules, dtype=dtype, model_id=checkpoint.model_id, budget=budget)
        shard.vocab_source = checkpoint.path if layers.is_tail else None
        return shard

    @classmethod
    def from_model(
        cls,
        model: PreTrainedModel,
        layers: LayerRange,
        *,
        torch_dtype: torch.dtype | str | None = None,
        model_id: str | None = None,
        budget: StoreBudget | None = None,
    ) -> TorchShard:
        """Take ``layers``' modules of an in-memory model.

        In the model's own dtype the modules are shared with ``model`` (drop it to keep only the
        range); another ``torch_dtype`` makes a cast copy, keeping the modules the model lists in
        ``_keep_in_fp32_modules_strict`` in float32 as ``from_pretrained`` would.
        """
        arch_for(model.config)  # fail early, before touching the modules
        modules = ShardModules.take(model, layers)
        dtype = model.dtype if torch_dtype is None else _dtype(torch_dtype)
        if dtype != model.dtype:
            keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
            modules = modules.cast(dtype, keep)
        model_id = model_id or f"memory:{model.config.model_type}"
        return cls(inference(modules), dtype=dtype, model_id=model_id, budget=budget)

    def grammar(self, text: str) -> TokenGrammar:
        if self.vocab_source is None:
            return super().grammar(text)
        if self._vocab is None:
            try:
                self._vocab = LlamaVocab(self.vocab_source)
            except MeshnetError as exc:
                why = f"this tail cannot read a tokenizer for grammars: {exc}"
                raise InvalidRequest(why, param="grammar") from None
        return self._vocab.grammar(text)

    def close(self) -> None:
        super().close()
        if self._vocab is not None:
            self._vocab.close()

    # -- measurement ---------------------------------------------------------------------------
    def state_bytes(self, sid: SessionId) -> int:
        """Measured bytes of a session's cache tensors (the ``KVFormat`` is the model of this)."""
        session = self.store.get(sid)
        with self._compute:
            return torch_cache.state_bytes(session.state.cache)

    def expected_state_bytes(self, positions: int) -> int:
        """What the cache holds after ``positions`` positions, from the config alone."""
        return self.arch.state_bytes(self.modules.config, self.info.layers, self.dtype, positions)

    # -- ShardBase hooks -----------------------------------------------------------------------
    def _new_state(self, sid: SessionId) -> TorchSession:
        return TorchSession(RangeCache(self.modules.config, self.info.layers))

    def _free_state(self, state: TorchSession) -> None:
        state.undo = None
        state.cache.layers.clear()

    def _truncate_state(self, state: TorchSession, position: int) -> None:
        if state.undo is not None and state.undo[0] == position:
            torch_cache.rollback(state.cache, state.undo[1])  # a failed forward may have written part of it
            state.position, state.undo = position, None
        elif state.position != position:
            # Full attention keeps one K/V row per position: drop the rows past ``position``. Other cache
            # layers (sliding windows that dropped rows, compressed or recurrent states) cannot go back.
            own = state.cache.own
            if not 0 <= position < state.position or any(type(layer) is not DynamicLayer for layer in own):
                raise EngineError(
                    f"cannot rewind a PyTorch shard session from {state.position} to {position}: its layers keep "
                    "sliding-window, compressed or recurrent state, which only the chunk being computed can undo"
                )
            for layer in own:
                layer.crop(position - state.position)
            state.position, state.undo = position, None

    def _forward(
        self, state: TorchSession, start: int, tokens: I32 | None, hidden: F32 | None, all_logits: bool = False
    ) -> ShardOutput:
        m, arch = self.modules, self.arch
        try:
            with torch.inference_mode():
                state.undo = (start, torch_cache.checkpoint(state.cache))
                ids = None if tokens is None else torch.from_numpy(tokens.astype(np.int64))[None]
                if hidden is None:
                    assert ids is not None
                    x = arch.embed(m, ids)
                else:
                    x = torch.from_numpy(hidden).to(dtype=self.dtype, copy=True)[None]
                n = x.shape[1]
                positions = torch.arange(start, start + n)[None]  # [1, n], absolute
                x = arch.run(m, x, positions, state.cache, ids)
                if self.info.layers.is_tail:
                    assert m.lm_head is not None
                    rows = m.lm_head(arch.finish(m, x if all_logits else x[:, -1:]))[0]
                    out = ShardOutput(logits=_numpy(rows if all_logits else rows[-1]))
                else:
                    out = ShardOutput(hidden=_numpy(x[0]))
        except MeshnetError:
            raise
        except Exception as exc:  # torch / transformers failures: the store rolls the chunk back
            raise EngineError(f"PyTorch shard {self.info.layers} failed: {type(exc).__name__}: {exc}") from exc
        state.position, state.undo = start + n, None
        return out

    def _dump_state(self, state: TorchSession, position: int) -> bytes:
        return torch_cache.dump(state.cache, position, dtype_name(self.dtype))

    def _load_state(self, sid: SessionId, body: bytes, position: int) -> TorchSession:
        state = self._new_state(sid)
        torch_cache.load(state.cache, body, position, dtype_name(self.dtype))
        state.position = position
        return state


def _numpy(t: torch.Tensor) -> F32:
    array: F32 = np.ascontiguousarray(t.detach().to(torch.float32).numpy(), dtype=np.float32)
    return array


def set_threads(n: int) -> None:
    """torch's intra-op thread count is process-wide: a node sets it once to its share of the cores."""
    torch.set_num_threads(max(1, n))
