"""llama.cpp shard backend: one layer range of a GGUF, per-session KV as llama.cpp sequences.

Recipe (docs/backends.md): the shard file is written by ``meshnet.artifacts.shard_file``; inbound hidden
states go in through ``batch.embd`` at absolute positions; the outbound hidden state is copied out
of the graph by a ``cb_eval`` callback on ``l_out-{n_layer-1}``; every session is a ``seq_id`` of
one shared ``llama_context`` with a KV stream of its own (``kv_unified`` off; ``n_ubatch == n_batch``
so a chunk's rows keep batch order; several sessions' decode steps go in as one batch, by seq id);
snapshots are ``llama_state_seq_get_data`` / ``set_data``.

Non-tail shards have a one-token vocabulary, so marking every row as an output (needed: llama.cpp
keeps only output rows in its last layer) costs no lm_head work. The head looks its embeddings up
itself from the sidecar table and feeds them in as hidden states.

Concurrency: ``ShardBase`` serializes compute with one lock; the context is never touched outside
it. The eval callback runs on the thread that called ``llama_decode``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import heapq
import os
import platform
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from meshnet.artifacts.gguf_header import read_header
from meshnet.artifacts.gguf_source import model_stem, open_gguf, split_parts
from meshnet.artifacts.shard_file import (
    embeddings_path,
    hybrid_layers,
    layer_flags,
    layer_values,
    read_shard_range,
    write_shard,
)
from meshnet.backends.eval_capture import Capture, EvalCallback, make_capture
from meshnet.backends.ggml_layout import check_tensor_layout, rows_to_float
from meshnet.backends.gpu import offload_numerics, require_offload
from meshnet.backends.llama_vocab import LlamaVocab, model_meta
from meshnet.backends.load_checks import BatchChecks, CheckCache, check_key
from meshnet.backends.shard import F32, I32, KVFormat, SeamSpec, ShardBase, ShardInfo, ShardOutput
from meshnet.errors import EngineError, InvalidRequest, StoreFull
from meshnet.ids import SessionId
from meshnet.layers import LayerRange
from meshnet.models.families import Family, family
from meshnet.session.store import StoreLimits

if TYPE_CHECKING:
    from meshnet.backends.grammar import TokenGrammar

__all__ = ["MAX_VERIFY", "SNAPSHOT_CELL_META_BYTES", "HeadEmbeddings", "LlamaShard", "LlamaShardConfig"]

_KV_CACHE_BYTES = 2  # llama.cpp's default K/V cache type is f16
_STATE_BYTES = 4  # recurrent (conv and linear-attention) states are f32
# A sequence snapshot stores, per cell, its position, a seq-id count and one seq id (int32 each).
SNAPSHOT_CELL_META_BYTES = 12
# The most drafted positions one verify chunk adds (speculative decoding): more than a
# prompt-lookup drafter usually gets accepted, and few enough to measure at load (_batch_matches_steps).
MAX_VERIFY = 12
# The most sessions' decode steps one llama_decode holds (batched decode), measured at load
# (_batch_matches_solo) up to this many sessions.
MAX_DECODE_BATCH = 16
# llama.cpp pads a sequence's attended KV cells to a multiple of 256; from 512 cells on, the
# attention of a lone row (a decode step) splits the cells across threads and sums the parts,
# while several rows (a chunk, a batch of sessions) each sum all cells in one pass.
KV_PAD = 256
# Rows per compute call of a load-time measurement's scratch history: the gateway's default prefill
# chunk (a node's memory after its checks is then what serving such chunks touches, docs/backends.md).
HISTORY_CHUNK = 128


class HeadEmbeddings:
    """Token-embedding lookup from a GGUF's ``token_embd.weight``, dequantized per lookup.

    Rows are read from the file one by one (``os.pread``), never through a mapping: the kernel maps
    a mapped file's neighbouring pages on every fault (64 KiB around it), so a few thousand scattered
    lookups through an mmap made the whole table resident in the node's memory. Reads go through
    the page cache, which is not the process's.

    Rows are dequantized by ggml's own ``to_float`` of the table's type (``ggml_layout.rows_to_float``),
    the function llama.cpp's ``get_rows`` computes a whole model's embeddings with: ~10 µs a decode
    step's row on a 2-core VM, where gguf-py's NumPy dequantization took 55 (Q8_0) to 145 µs (Q4_K).
    gguf-py's stays for an f32 table and for a ggml whose type traits do not read as expected."""

    def __init__(self, path: Path) -> None:
        import gguf
        import llama_cpp

        tensor = open_gguf(path).tensor("token_embd.weight")
        if tensor is None:
            raise InvalidRequest(f"{path} holds no token_embd.weight")
        self._qtype = tensor.tensor_type
        self._dequantize = gguf.quants.dequantize
        self._dtype, self._row_shape = tensor.dtype, tensor.shape[1:]
        self.n_vocab = tensor.shape[0]
        self.nbytes = tensor.nbytes
        self._row_bytes = tensor.nbytes // self.n_vocab
        block = gguf.GGML_QUANT_SIZES[self._qtype]
        self._to_float = rows_to_float(llama_cpp, int(self._qtype), self._qtype.name, block)
        self._row_floats = self._row_bytes // block[1] * block[0]
        self._offset = tensor.offset
        self._fd = os.open(tensor.path, os.O_RDONLY)
        self._close = weakref.finalize(self, os.close, self._fd)

    def __call__(self, tokens: I32) -> F32:
        n = int(tokens.shape[0])
        if n and not (int(tokens.min()) >= 0 and int(tokens.max()) < self.n_vocab):
            raise InvalidRequest(f"a token id is outside the vocabulary of {self.n_vocab}")
        size = self._row_bytes
        data = b"".join(os.pread(self._fd, size, self._offset + int(t) * size) for t in tokens)
        if len(data) != n * size:
            raise EngineError(f"the embedding table ended early: {len(data)} of {n * size} bytes read")
        if self._to_float is not None:
            out = np.empty((n, self._row_floats), dtype=np.float32)
            self._to_float(data, out.ctypes.data, out.size)
            return out
        rows = np.frombuffer(data, dtype=self._dtype).reshape(n, *self._row_shape)
        return np.ascontiguousarray(self._dequantize(rows, self._qtype), dtype=np.float32)


@dataclass(frozen=True, slots=True)
class _BatchViews:
    """NumPy views of a ``llama_batch``'s per-row arrays, made once: ``np.ctypeslib.as_array`` builds a
    ctypes array type at each call, four times a decode step. Valid until ``llama_batch_free``."""

    token: np.ndarray[Any, np.dtype[np.int32]] | None  # None: a batch of embeddings
    pos: np.ndarray[Any, np.dtype[np.int32]]
    n_seq_id: np.ndarray[Any, np.dtype[np.int32]]
    logits: np.ndarray[Any, np.dtype[np.int8]]

    @classmethod
    def of(cls, batch: Any, rows: int, by_token: bool) -> _BatchViews:
        def view(pointer: Any) -> Any:
            return np.ctypeslib.as_array(pointer, shape=(rows,))

        return cls(view(batch.token) if by_token else None, view(batch.pos), view(batch.n_seq_id), view(batch.logits))


@dataclass(frozen=True, slots=True)
class LlamaShardConfig:
    """``n_ctx`` KV cells in all, split evenly between ``max_sessions`` sessions."""

    n_ctx: int = 4096
    max_sessions: int = 8
    n_threads: int | None = None
    n_batch: int = 512
    idle_ttl_s: float = 600.0
    # The most sessions' decode steps one compute call may hold (1: one at a time); capped by
    # max_sessions and MAX_DECODE_BATCH, and used only where measured to keep every session's bits.
    decode_batch: int = MAX_DECODE_BATCH
    # Where the load-time bit checks of a shard are kept between starts (backends/load_checks.py);
    # None: measured at every load.
    checks_cache: Path | None = None
    # Layers offloaded to a GPU (backends.gpu): 0 computes on the CPU only, -1 every layer of the shard
    # file, N its last N (llama.cpp's n_gpu_layers, which counts the output layer as one).
    gpu_layers: int = 0
    # The eval callback that copies the seam's rows out (backends.eval_capture): "auto" is the compiled
    # one where meshnet's C extension is built, else the Python one.
    eval_callback: EvalCallback = "auto"

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.n_ctx < self.max_sessions or self.n_batch < 1 or self.decode_batch < 1:
            raise ValueError("a shard needs n_ctx >= max_sessions >= 1, n_batch >= 1 and decode_batch >= 1")
        if self.gpu_layers < -1:
            raise ValueError(f"gpu_layers is -1 (every layer), 0 (CPU only) or a layer count, not {self.gpu_layers}")

    @property
    def positions_per_session(self) -> int:
        return self.n_ctx // self.max_sessions


class LlamaShard(ShardBase[int]):
    """State per session: its llama.cpp ``seq_id``."""

    def __init__(
        self,
        shard_path: Path,
        *,
        model_id: str | None = None,
        embeddings: Path | None = None,
        config: LlamaShardConfig | None = None,
    ) -> None:
        super().__init__()
        import llama_cpp

        check_tensor_layout(llama_cpp)  # the eval callback reads struct ggml_tensor at fixed offsets
        self._ll = llama_cpp
        self._path = shard_path
        self._tokenizer: LlamaVocab | None = None  # a tail's, for grammars (grammar)
        self._grammar_lock = threading.Lock()
        cfg = config or LlamaShardConfig()
        found = read_shard_range(shard_path)
        layers, self._vocab_cut = found if found is not None else (None, False)
        self._embed: HeadEmbeddings | None = None
        if self._vocab_cut and layers is not None and layers.is_head:
            sidecar = embeddings or embeddings_path(shard_path)
            if not sidecar.is_file():
                raise InvalidRequest(f"the head shard needs its embedding table {sidecar}; rebuild the shard")
            self._embed = HeadEmbeddings(sidecar)
        self._model = self._load_model(shard_path, cfg.gpu_layers)
        n_layer = int(llama_cpp.llama_model_n_layer(self._model))
        if layers is None:  # a full model GGUF: one shard holding every layer
            layers = LayerRange.full(n_layer)
        elif len(layers) != n_layer:
            llama_cpp.llama_model_free(self._model)
            raise InvalidRequest(f"{shard_path} declares layers {layers} but holds {n_layer} blocks")
        self._n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model)))
        self._n_batch = cfg.n_batch
        self._tail = layers.is_tail
        self._token_input = layers.is_head and self._embed is None
        self._apply_family(family(self._meta("general.architecture")), layers, cfg.n_batch)
        self._n_outputs = self._max_outputs(cfg)
        self._ctx = self._create_context(cfg, n_layer - 1)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        by_token = self._token_input or self._token_seam
        self._batch = llama_cpp.llama_batch_init(cfg.n_batch, 0 if by_token else self._width, 1)
        self._views = _BatchViews.of(self._batch, cfg.n_batch, by_token)
        # A heap: a new session takes the lowest free sequence id, so concurrent sessions hold
        # runs of consecutive ids, which llama.cpp batches as one micro-batch (_forward_many).
        self._free_seqs = list(range(cfg.max_sessions))
        self.info = self._describe(model_id or shard_path.name.removesuffix(".gguf"), layers, cfg)
        # Load-time measurements run on scratch sequences, after a short history and after one
        # past KV_PAD cells, where llama.cpp's attention of a lone row changes its summation order.
        # Exact below KV_PAD only (None: everywhere) where the short history agrees and the long
        # one does not (or cannot be measured: a context too small for it).
        checks = self._load_checks(cfg)
        if checks.verify is not None:
            short_ok, long_ok = checks.verify
            below = None if long_ok else KV_PAD
            self.info = dataclasses.replace(self.info, verify_batched=short_ok, verify_batched_below=below)
        if checks.decode is not None and checks.decode[0]:
            below = None if checks.decode[1] else KV_PAD
            self.info = dataclasses.replace(
                self.info, decode_batch=self._max_decode_batch(cfg), decode_batch_below=below
            )
        self._init_store(
            StoreLimits(
                bytes_per_token=self.info.kv.bytes_per_token,
                budget_bytes=max(1, self.info.kv.bytes_per_token * cfg.n_ctx),
                max_sessions=cfg.max_sessions,
                max_positions=cfg.positions_per_session,
                idle_ttl_s=cfg.idle_ttl_s,
            )
        )

    def _load_checks(self, cfg: LlamaShardConfig) -> BatchChecks:
        """Which batched computations keep this shard's bits: measured here, or read from
        ``cfg.checks_cache`` where this shard, build, thread count and shapes were measured before."""
        most = self._max_decode_batch(cfg)
        long = min(KV_PAD + 4, cfg.positions_per_session - MAX_VERIFY - 2)
        long_history = long if long > KV_PAD else None
        cache = CheckCache(cfg.checks_cache) if cfg.checks_cache is not None else None
        key = ""
        if cache is not None:
            threads = cfg.n_threads or os.cpu_count() or 1
            build = f"{self._ll.__version__}:{self._ll.llama_print_system_info().decode(errors='replace')}"
            build += offload_numerics(cfg.gpu_layers)  # GPU and CPU kernels keep different batched bits
            shapes: dict[str, object] = {
                "verify": self.info.max_verify,
                "decode": most,
                "long": long_history,
                "n_batch": cfg.n_batch,
                "sidecar_rows": self._embed.n_vocab if self._embed else 0,
            }
            key = check_key(self._path, build=build, threads=threads, shapes=shapes)
            cached = cache.get(key)
            if cached is not None:
                return cached
        verify = self._batch_matches_steps(self.info.max_verify + 1, long_history) if self.info.max_verify else None
        decode = self._batch_matches_solo(most, long_history) if most > 1 else None
        found = BatchChecks(verify=verify, decode=decode)
        if cache is not None:
            cache.put(key, found)
        return found

    def _apply_family(self, seams: Family, layers: LayerRange, n_batch: int) -> None:
        """The family's seam handling (``models.families``) for this shard's place in the route."""
        # What crosses a seam per position: [streams, n_embd] (DeepSeek-V4's hyper-connections), else [n_embd].
        self._streams = self._int_meta(f"{seams.arch}.{seams.streams}", 1) if seams.streams else 1
        self._seam_shape = (self._streams, self._n_embd) if self._streams > 1 else (self._n_embd,)
        self._width = self._streams * self._n_embd
        self._out = np.empty((n_batch, self._width), dtype=np.float32)
        self._capture: Capture | None = None  # the eval callback's state (_create_context), if it needs one
        self._layer_output = seams.layer_output
        self._one_output_row = seams.rows_after_layers
        # Past the head, the graph's own input scale is undone by overwriting its product with the
        # inbound hidden state; a head that looks its embeddings up itself applies a scale llama.cpp
        # gives token inputs only.
        self._token_seam = seams.token_seam and not self._token_input
        past_head = layers.start > 0
        rescaled = seams.rescaled_input if past_head else None
        rescaled = rescaled or (seams.input_name if self._token_seam else None)  # at the head: before any scale
        self._overwrite = rescaled.encode() + b"\0" if rescaled else None
        self._pending: np.ndarray[Any, Any] | None = None  # the rows of the running chunk
        self._recurrent = seams.recurrent
        self._rollback = seams.rollback
        self._checkpoints: dict[int, tuple[int, bytes]] = {}  # seq -> (position, recurrent state there)
        self._head_scale: np.float32 | None = None
        if seams.head_scale == "sqrt_n_embd" and self._embed is not None:
            self._head_scale = np.sqrt(np.float32(self._n_embd))  # sqrtf(n_embd), as llama.cpp computes it

    def _load_model(self, path: Path, gpu_layers: int) -> Any:
        from llama_cpp._utils import suppress_stdout_stderr

        require_offload(self._ll, gpu_layers)  # a CPU build refuses a GPU configuration before loading
        params = self._ll.llama_model_default_params()
        params.n_gpu_layers = gpu_layers  # explicit: llama.cpp's default (-1) offloads every layer on a GPU build
        # Read the weights, do not map them: on CPU llama.cpp repacks most quantized weights into
        # buffers of its own (its "extra buffer types"), reading them through the mapping, whose
        # touched pages then stay resident beside the copy — a node held its weights twice
        # (1.5B model, layers 0:14: 891 MiB for 383 MiB of weights). Read into buffers, each weight
        # is held once; the bits are the same (same tensors, same buffer types and kernels).
        params.load_mode = self._ll.LLAMA_LOAD_MODE_NONE
        # The tokenizer is the gateway's (and a tail's grammar's, loaded on demand): computing
        # layers needs only the vocabulary's size. llama.cpp's parsed tokenizer of a 152K
        # vocabulary (token maps, BPE merges, piece cache) is ~46 MiB of a tail's memory.
        overrides = _no_tokenizer(self._ll, path)
        if overrides is not None:
            params.kv_overrides = overrides
        with suppress_stdout_stderr(disable=False):
            model = self._ll.llama_model_load_from_file(str(path).encode(), params)
        if model is None:
            raise InvalidRequest(f"llama.cpp could not load {path}")
        return model

    def _create_context(self, cfg: LlamaShardConfig, last_layer: int) -> Any:
        from llama_cpp._utils import suppress_stdout_stderr

        ll = self._ll
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = cfg.n_ctx
        cparams.n_batch = cfg.n_batch
        cparams.n_ubatch = cfg.n_batch  # rows keep batch order only if one ubatch holds the batch
        cparams.n_seq_max = cfg.max_sessions
        # llama.cpp sizes its compute buffer for n_outputs_max rows of logits (default: n_batch);
        # a tail needs a row per verified position or batched session, never a whole chunk's, and
        # 512 rows of a 152K vocabulary are 300 MiB of buffer (_max_outputs).
        cparams.n_outputs_max = self._n_outputs
        # One KV stream per session: a session's cells never interleave with another's, so its
        # attention sums run in the same order as when it runs alone (greedy parity across
        # concurrent sessions). Each session gets n_ctx / max_sessions cells.
        cparams.kv_unified = False
        threads = cfg.n_threads or os.cpu_count() or 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.embeddings = False
        # Explicit, and the same as the single-node engine: greedy parity needs identical kernels.
        cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        # Sliding-window layers keep every cell: a rewind (repair, rollback) needs the window
        # before the new end, which a pruned window cache may already have dropped.
        cparams.swa_full = True
        # Compressor states (DeepSeek-V4) roll back from per-position snapshots kept this deep.
        cparams.n_rs_seq = self._rollback
        if not self._tail or self._overwrite is not None:
            target = f"{self._layer_output}-{last_layer}".encode() + b"\0" if not self._tail else None
            self._capture = make_capture(
                ll, cfg.eval_callback, target=target, overwrite=self._overwrite, out=self._out, n_embd=self._n_embd,
                row=self._width,
            )  # fmt: skip
            cparams.cb_eval = self._capture.callback
            cparams.cb_eval_user_data = self._capture.user_data
        with suppress_stdout_stderr(disable=False):
            ctx = ll.llama_init_from_model(self._model, cparams)
        if ctx is None:
            ll.llama_model_free(self._model)
            raise EngineError("llama.cpp could not create a context (out of memory?)")
        return ctx

    def _describe(self, model_id: str, layers: LayerRange, cfg: LlamaShardConfig) -> ShardInfo:
        kv = self._kv_format(len(layers))
        weight_bytes = int(self._ll.llama_model_size(self._model))
        if self._embed is not None:
            weight_bytes += self._embed.nbytes
        return ShardInfo(
            model_id=model_id,
            architecture=self._meta("general.architecture"),
            backend="llama.cpp",
            layers=layers,
            seam=SeamSpec(self._seam_shape),
            n_vocab=self._embed.n_vocab if self._embed is not None else self._n_vocab,
            max_positions=cfg.positions_per_session,
            weight_bytes=weight_bytes,
            kv=kv,
            numerics=(
                f"llama.cpp {getattr(self._ll, '__version__', '?')} cpu {platform.machine()} {_cpu_model()}; "
                f"threads {cfg.n_threads or os.cpu_count() or 1}; n_batch {cfg.n_batch}; flash-attn; kv f16"
                f"{offload_numerics(cfg.gpu_layers)}"
            ),
            max_verify=self._max_verify(cfg),
        )

    def _max_verify(self, cfg: LlamaShardConfig) -> int:
        """Drafted positions a verify chunk may add here: plain KV drops any suffix (a rejected
        draft). A recurrent or compressor state rolls back only to chunk starts or a few snapshots,
        and a graph that outputs one row after its layers cannot give every row: no verify there."""
        if self._recurrent or self._rollback or self._one_output_row:
            return 0
        return max(0, min(MAX_VERIFY, cfg.n_batch - 1))

    def _batch_matches_steps(self, most: int, long: int | None) -> tuple[bool, bool]:
        """Measure whether a chunk of 2..``most`` positions computes every row (and the KV after it)
        to the same bits as one-position steps — then a verify chunk may run as one compute call:
        (after a short history, after a ``long`` one).

        Whether it does depends on the weights' types and the kernels llama.cpp picks for them
        (measured: Q4_1 weights agree up to 63 rows; f32 and f16 weights differ in the low bits from
        2 rows on), and on the history: past ``KV_PAD`` cells a one-row step's attention splits the
        KV across threads, a chunk's does not (measured: equal with one thread, not with two). So it
        is measured here, on this shard's own weights and threads, on a scratch sequence before any
        session exists. Kernels are chosen by shape and type, not by values."""
        rng, seq = np.random.default_rng(0), 0

        def part(hidden: F32 | None, a: int, b: int) -> F32 | None:
            return None if hidden is None else hidden[a:b]

        def agrees(warm: int, sizes: Sequence[int]) -> bool:
            self._ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._history(seq, *self._scratch_inputs(rng, warm))
            for n in sizes:
                tokens, hidden = self._scratch_inputs(rng, n + 1)
                steps = [
                    self._rows(self._forward(seq, warm + i, tokens[i : i + 1], part(hidden, i, i + 1)))
                    for i in range(n + 1)
                ]
                self._truncate_state(seq, warm)
                chunk = self._rows(self._forward(seq, warm, tokens[:n], part(hidden, 0, n), True))
                after = self._rows(self._forward(seq, warm + n, tokens[n:], part(hidden, n, n + 1)))
                self._truncate_state(seq, warm)
                if not (np.array_equal(chunk, np.concatenate(steps[:n])) and np.array_equal(after, steps[n])):
                    return False
            return True

        try:
            with self._compute:
                if not agrees(8, range(2, most + 1)):  # every size once
                    return False, False
                # after a long history only the attention can differ: 2 rows and the most
                return True, long is not None and agrees(long, sorted({2, most}))
        finally:
            self._ll.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def _history(self, seq: int, tokens: I32, hidden: F32 | None) -> None:
        """A scratch sequence's history for the load-time measurements, computed in calls of at most
        ``HISTORY_CHUNK`` rows: a chunk of ``n_batch`` rows would touch all of llama.cpp's compute
        buffer (sized for ``n_batch`` rows), which a node serving the gateway's chunks never does."""
        for at in range(0, len(tokens), HISTORY_CHUNK):
            rows = slice(at, at + HISTORY_CHUNK)
            self._forward(seq, at, tokens[rows], None if hidden is None else hidden[rows])

    def _scratch_inputs(self, rng: np.random.Generator, n: int) -> tuple[I32, F32 | None]:
        """Random inputs of ``n`` positions for the load-time measurements."""
        n_in = self._n_vocab if self._embed is None else self._embed.n_vocab
        tokens = rng.integers(0, max(1, n_in), n).astype(np.int32)
        hidden = None if self.info.layers.is_head else rng.standard_normal((n, *self._seam_shape), dtype=np.float32)
        return tokens, hidden

    def _rows(self, out: ShardOutput) -> F32:
        """An output's rows, ``[n, width]``: logits at the tail, else hidden states."""
        got = out.logits if self._tail else out.hidden
        assert got is not None
        return got.reshape(-1, got.shape[-1]) if self._tail else got.reshape(got.shape[0], -1)

    def _max_outputs(self, cfg: LlamaShardConfig) -> int:
        """Rows of output one compute call may ask for: every row of a chunk past the tail (its
        vocabulary is one token, and llama.cpp keeps only output rows in the last layer); at the
        tail one per verified position or batched session (llama.cpp reserves at least one per
        sequence) — ``_forward`` refuses more, where llama.cpp would abort the process."""
        if not self._tail:
            return cfg.n_batch
        verify = self._max_verify(cfg) + 1
        return min(cfg.n_batch, max(verify, self._max_decode_batch(cfg), cfg.max_sessions))

    def _max_decode_batch(self, cfg: LlamaShardConfig) -> int:
        """Sessions one decode batch may hold: a recurrent or compressor state checkpoints per
        sequence around every compute call, and a graph that outputs one row after its layers
        gives one row per batch; those run their sessions one at a time."""
        if self._recurrent or self._rollback or self._one_output_row:
            return 1
        return max(1, min(MAX_DECODE_BATCH, cfg.decode_batch, cfg.max_sessions, cfg.n_batch))

    def _batch_matches_solo(self, most: int, long: int | None) -> tuple[bool, bool]:
        """Measure whether one batch of several sessions' decode steps computes every session's
        row (and the KV after it) to the bits of that session's own step: (with short histories,
        with one ``long`` history in the batch — past ``KV_PAD`` cells a lone step's attention
        splits the KV across threads, a batch's does not). Checked on scratch sequences before any
        session exists: all ``most`` sessions at once, every other sequence id (one micro-batch
        each) and a mix of runs, each handed to the batch in reverse order."""
        patterns = [list(range(most)), list(range(0, most, 2))]
        if most >= 4:
            patterns.append([0, 1, 3])
        short = self._batches_agree({seq: 3 + 2 * seq for seq in range(most)}, patterns)
        return short, short and long is not None and self._batches_agree({0: long, 1: 5}, [[0, 1]])

    def _batches_agree(self, history: dict[int, int], patterns: Sequence[list[int]]) -> bool:
        """Scratch sequences with these histories: each pattern's batch against its lone steps."""
        rng = np.random.default_rng(1)
        try:
            with self._compute:
                for seq, n in history.items():
                    self._history(seq, *self._scratch_inputs(rng, n))
                for pattern in (p for p in patterns if len(p) > 1):
                    step = {seq: self._scratch_inputs(rng, 1) for seq in pattern}
                    after = {seq: self._scratch_inputs(rng, 1) for seq in pattern}
                    solo: dict[int, tuple[F32, F32]] = {}
                    for seq in pattern:
                        first = self._rows(self._forward(seq, history[seq], *step[seq]))
                        solo[seq] = (first, self._rows(self._forward(seq, history[seq] + 1, *after[seq])))
                        self._truncate_state(seq, history[seq])
                    order = pattern[::-1]
                    batched = self._forward_many([(seq, history[seq], *step[seq]) for seq in order])
                    for seq, out in zip(order, batched, strict=True):
                        then = self._rows(self._forward(seq, history[seq] + 1, *after[seq]))
                        self._truncate_state(seq, history[seq])
                        if not (np.array_equal(self._rows(out), solo[seq][0]) and np.array_equal(then, solo[seq][1])):
                            return False
                return True
        finally:
            for seq in history:
                self._ll.llama_memory_seq_rm(self._mem, seq, -1, -1)

    @classmethod
    def from_model(cls, gguf: Path, layers: LayerRange | str, *, cache_dir: Path, **kwargs: Any) -> LlamaShard:
        """Cut ``layers`` out of a full GGUF or split set (cached by the identity of every part) and load it."""
        stamps = []
        for part in split_parts(gguf):
            stat = part.stat()
            stamps.append(f"{part.resolve()}:{stat.st_size}:{stat.st_mtime_ns}")
        key = hashlib.sha256("|".join(stamps).encode()).hexdigest()[:16]
        text = str(layers) if isinstance(layers, LayerRange) else layers
        path = cache_dir / f"{model_stem(gguf)}.{key}.{text.replace(':', '-')}.gguf"
        if not path.is_file():
            write_shard(gguf, layers, path)
        kwargs.setdefault("model_id", model_stem(gguf))
        return cls(path, **kwargs)

    # -- compute -----------------------------------------------------------------------------
    def _forward(
        self, state: int, start: int, tokens: I32 | None, hidden: F32 | None, all_logits: bool = False
    ) -> ShardOutput:
        n = tokens.shape[0] if tokens is not None else hidden.shape[0]  # type: ignore[union-attr]
        if self._tail and all_logits and n > self._n_outputs:
            raise InvalidRequest(
                f"a chunk asks for {n} positions' logits; this tail gives at most {self._n_outputs} per call"
            )
        if self._recurrent:
            # A recurrence cannot be truncated: keep its state as it was before this chunk, so a
            # rewind to ``start`` (a failed chunk, a repair resending a step) can restore it.
            self._checkpoints[state] = (start, self._partial_state(state))
        outputs: list[F32] = []
        logits: F32 | None = None
        last_only = (self._tail and not all_logits) or self._one_output_row
        for begin in range(0, n, self._n_batch):
            end = min(n, begin + self._n_batch)
            self._fill(
                [state] * (end - begin),
                np.arange(start + begin, start + end, dtype=np.int32),
                tokens=None if tokens is None else tokens[begin:end],
                hidden=None if hidden is None else hidden[begin:end],
                last_only=last_only,
            )
            self._decode(end - begin)
            if self._tail and all_logits:
                rows = [self._row_logits(i) for i in range(end - begin)]
                logits = np.stack(rows) if logits is None else np.concatenate([logits, np.stack(rows)])
            elif self._tail:
                logits = self._row_logits(-1)
            else:
                outputs.append(self._out[: end - begin].reshape(end - begin, *self._seam_shape).copy())
        if self._tail:
            return ShardOutput(logits=logits)
        return ShardOutput(hidden=outputs[0] if len(outputs) == 1 else np.concatenate(outputs))

    def _forward_many(self, rows: Sequence[tuple[int, int, I32 | None, F32 | None]]) -> list[ShardOutput]:
        """One position of each of several sequences in one ``llama_decode``. The rows go in by
        sequence id: with one KV stream per session llama.cpp computes each run of consecutive ids
        as one micro-batch, in batch order, so the captured rows come out in that order too."""
        order = sorted(range(len(rows)), key=lambda i: rows[i][0])
        tokens = [t for i in order if (t := rows[i][2]) is not None]
        hidden = [h for i in order if (h := rows[i][3]) is not None]
        ids: I32 | None = np.concatenate(tokens) if tokens else None
        states: F32 | None = np.concatenate(hidden) if hidden else None
        n = len(rows)
        positions = np.asarray([rows[i][1] for i in order], dtype=np.int32)
        self._fill([rows[i][0] for i in order], positions, tokens=ids, hidden=states, last_only=False)
        self._decode(n)
        outs: list[ShardOutput] = [ShardOutput()] * n
        for at, i in enumerate(order):
            if self._tail:
                outs[i] = ShardOutput(logits=self._row_logits(at))
            else:
                outs[i] = ShardOutput(hidden=self._out[at : at + 1].reshape(1, *self._seam_shape).copy())
        return outs

    def _decode(self, n: int) -> None:
        """``llama_decode`` of the filled batch of ``n`` rows, checked: the family's seam fix
        overwrote every row once, and a non-tail shard captured every row's hidden state."""
        capture = self._capture
        if capture is not None:
            capture.begin(self._pending)
        rc = int(self._ll.llama_decode(self._ctx, self._batch))
        pending, self._pending = self._pending, None
        captured = capture.captured if capture is not None else 0
        overwritten = capture.overwritten if capture is not None else 0
        if self._overwrite is not None and rc == 0 and (pending is None or overwritten != pending.size):
            raise EngineError(
                f"the family's seam fix found no graph tensor {self._overwrite[:-1].decode()!r} "
                "(another llama.cpp version?); refusing to compute a wrong seam"
            )
        if rc == 1:
            raise StoreFull("llama.cpp found no KV slot for this chunk; retry later", retry_after_s=5)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc}")
        if not self._tail and captured != n:
            raise EngineError(f"captured {captured} hidden rows, expected {n}")

    def _row_logits(self, row: int) -> F32:
        ptr = self._ll.llama_get_logits_ith(self._ctx, row)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).copy()

    def _fill(
        self, seqs: Sequence[int], positions: I32, *, tokens: I32 | None, hidden: F32 | None, last_only: bool
    ) -> None:
        """Fill the batch with one row per position: row ``i`` is ``positions[i]`` of sequence ``seqs[i]``."""
        batch, views = self._batch, self._views
        n = len(seqs)
        batch.n_tokens = n
        if self._token_input:
            assert tokens is not None and views.token is not None
            views.token[:n] = tokens
        else:
            if hidden is None:  # a head that looks its embeddings up itself (row by row: any slicing agrees)
                assert tokens is not None and self._embed is not None
                hidden = self._embed(tokens)
                if self._head_scale is not None:
                    hidden = hidden * self._head_scale  # a new array: F32 rows are the read buffer itself
            block = np.ascontiguousarray(hidden, dtype=np.float32)
            self._pending = block
            if self._token_seam:  # any valid id: the callback overwrites the looked-up rows
                assert views.token is not None
                views.token[:n] = 0
            else:
                ctypes.memmove(batch.embd, block.ctypes.data, block.nbytes)
        views.pos[:n] = positions
        views.n_seq_id[:n] = 1
        for i, seq in enumerate(seqs):
            batch.seq_id[i][0] = seq
        flags = views.logits[:n]
        if last_only:
            flags[:] = 0
            flags[n - 1] = 1
        else:
            flags[:] = 1  # every row is an output, or llama.cpp drops rows in the last layer

    # -- session state -----------------------------------------------------------------------
    def _new_state(self, sid: SessionId) -> int:
        if not self._free_seqs:
            raise StoreFull("no free llama.cpp sequence on this shard", retry_after_s=5)
        return heapq.heappop(self._free_seqs)

    def _free_state(self, state: int) -> None:
        self._ll.llama_memory_seq_rm(self._mem, state, -1, -1)
        self._checkpoints.pop(state, None)
        heapq.heappush(self._free_seqs, state)

    def _truncate_state(self, state: int, position: int) -> None:
        ll = self._ll
        if self._recurrent and position > 0:
            saved = self._checkpoints.get(state)
            if saved is None or saved[0] != position:
                there = "none" if saved is None else f"position {saved[0]}"
                raise EngineError(
                    f"this shard's layers keep a recurrent state, which can be rewound only to the start of the "
                    f"session's last chunk ({there}), not to position {position}; start a new session"
                )
            buf = (ctypes.c_uint8 * len(saved[1])).from_buffer_copy(saved[1])
            flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
            if int(ll.llama_state_seq_set_data_ext(self._ctx, buf, len(saved[1]), state, flags)) == 0:
                raise EngineError("llama.cpp rejected the recurrent-state checkpoint")
        if not ll.llama_memory_seq_rm(self._mem, state, position, -1):
            if self._rollback:
                raise EngineError(
                    f"this shard's layers keep compressor states that llama.cpp rolls back at most {self._rollback} "
                    f"positions, once per step; cannot rewind to position {position}. Start a new session"
                )
            raise EngineError(f"llama.cpp could not drop positions >= {position} of sequence {state}")

    def _partial_state(self, state: int) -> bytes:
        """The recurrent (and sliding-window) part of a sequence's state."""
        ll, flags = self._ll, self._ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(ll.llama_state_seq_get_size_ext(self._ctx, state, flags))
        buf = (ctypes.c_uint8 * size)()
        written = int(ll.llama_state_seq_get_data_ext(self._ctx, buf, size, state, flags))
        return bytes(buf)[:written]

    def _dump_state(self, state: int, position: int) -> bytes:
        size = int(self._ll.llama_state_seq_get_size(self._ctx, state))
        buf = (ctypes.c_uint8 * size)()
        written = int(self._ll.llama_state_seq_get_data(self._ctx, buf, size, state))
        return bytes(buf)[:written]

    def _load_state(self, sid: SessionId, body: bytes, position: int) -> int:
        seq = self._new_state(sid)
        buf = (ctypes.c_uint8 * len(body)).from_buffer_copy(body)
        if int(self._ll.llama_state_seq_set_data(self._ctx, buf, len(body), seq)) == 0:
            self._free_state(seq)
            raise InvalidRequest("llama.cpp rejected the KV snapshot (corrupt, or from another model/context)")
        return seq

    def _load_into(self, state: int, body: bytes, position: int) -> bool:
        """Into the session's own sequence: llama.cpp clears it first, and again if the data is refused."""
        buf = (ctypes.c_uint8 * len(body)).from_buffer_copy(body)
        if int(self._ll.llama_state_seq_set_data(self._ctx, buf, len(body), state)) == 0:
            self._ll.llama_memory_seq_rm(self._mem, state, -1, -1)
            raise InvalidRequest("llama.cpp rejected the KV snapshot (corrupt, or from another model/context)")
        return True

    def kv_state_bytes(self, sid: SessionId) -> int:
        """Bytes llama.cpp serializes for a session (KV data plus a small header)."""
        state = self._store.get(sid).state  # the store's lock is never taken under the compute lock
        with self._compute:
            return int(self._ll.llama_state_seq_get_size(self._ctx, state))

    # -- helpers -----------------------------------------------------------------------------
    def _meta(self, key: str) -> str:
        return model_meta(self._ll, self._model, key)

    def _int_meta(self, key: str, default: int = 0) -> int:
        value = self._meta(key)
        return int(value) if value.lstrip("-").isdigit() else default

    def _kv_format(self, n_layer: int) -> KVFormat:
        """What a session costs here, by layer type, as llama.cpp stores it (f16 K/V cells; f32
        recurrent states): GQA layers hold K and V per token; MLA layers one compressed latent plus
        the rope key (V is a view of it); linear-attention layers a fixed-size state per session."""
        arch = self._meta("general.architecture")
        if family(arch).range_kinds is not None:
            return self._compressed_kv_format(arch, n_layer)
        n_head = self._int_meta(f"{arch}.attention.head_count")
        n_head_kv = self._int_meta(f"{arch}.attention.head_count_kv", n_head)
        head_k = self._int_meta(f"{arch}.attention.key_length", self._n_embd // max(n_head, 1))
        head_v = self._int_meta(f"{arch}.attention.value_length", head_k)
        lora = self._int_meta(f"{arch}.attention.kv_lora_rank")
        recurrent, attention = self._hybrid_layers(arch, n_layer)
        if lora:
            per_token = (lora + self._int_meta(f"{arch}.rope.dimension_count")) * _KV_CACHE_BYTES
            kind, formula = "mla", "per layer: (kv_lora_rank + rope dims) * 2 bytes (f16 latent; V is a view of it)"
            indexer = [0] * n_layer
            index_dim = self._int_meta(f"{arch}.attention.indexer.key_length")
            if index_dim:  # DSA: the lightning indexer's key, on layers that compute their own top-k
                flags = layer_flags(self._path, f"{arch}.attention.indexer.types", n_layer, default=True)
                indexer = [index_dim * _KV_CACHE_BYTES if f else 0 for f in flags]
                formula += "; + indexer key_length * 2 bytes on layers computing their own top-k"
            per_layer = [per_token + extra if a else 0 for a, extra in zip(attention, indexer, strict=True)]
        else:
            kind, formula = "kv", "per layer: (n_embd_k_gqa + n_embd_v_gqa) * 2 bytes (f16 K and V)"
            # hybrid families count KV heads per layer (0 on recurrent ones): read from the file, as their
            # layer kinds are; the others' one count is llama.cpp's to give (no header parse at load)
            heads = [n_head_kv] * n_layer
            if family(arch).recurrent:
                heads = layer_values(self._path, f"{arch}.attention.head_count_kv", n_layer, default=n_head_kv)
            per_layer = [(h * head_k + h * head_v) * _KV_CACHE_BYTES if a else 0
                         for h, a in zip(heads, attention, strict=True)]  # fmt: skip
        fixed = 0
        if any(recurrent):  # kept twice: live, and the checkpoint a rewind restores
            fixed = 2 * self._recurrent_state_bytes(arch) * sum(recurrent)
            kind = "hybrid" if any(attention) else "recurrent"
            formula += (
                "; recurrent layers: ((conv_kernel - 1) * (inner + 2 * groups * state) + state * inner) * 4 bytes "
                "(LFM2's short convolutions: n_embd * (l_cache - 1) * 4) per session (f32), kept twice (live, and "
                "the checkpoint a rewind restores)"
            )
        return KVFormat(
            kind=kind,
            dtype="f16",
            bytes_per_token=sum(per_layer),
            fixed_bytes=fixed,
            per_layer_bytes_per_token=tuple(per_layer),
            formula=formula,
        )

    def _compressed_kv_format(self, arch: str, n_layer: int) -> KVFormat:
        """DeepSeek-V4 as llama.cpp stores it: every layer keeps raw K (= V) per token; CSA layers
        (ratio 4) add one compressed K and one indexer key per 4 tokens, HCA layers (ratio 128) one
        compressed K per 128; each compressing layer keeps f32 compressor states (K and score) per
        session, with ``rollback`` snapshots of them."""
        head = self._int_meta(f"{arch}.attention.key_length")
        index = self._int_meta(f"{arch}.attention.indexer.key_length")
        ratios = layer_values(self._path, f"{arch}.attention.compress_ratios", n_layer, default=0)
        planes = 1 + self._rollback
        per_layer, fixed = [], 0
        for ratio in ratios:
            raw = head * _KV_CACHE_BYTES
            if ratio == 4:  # overlapping windows: states of 2 x ratio rows, twice as wide
                per_layer.append(raw + -(-(head + index) * _KV_CACHE_BYTES // ratio))
                fixed += 2 * (2 * ratio) * (2 * head + 2 * index) * _STATE_BYTES * planes
            elif ratio:
                per_layer.append(raw + -(-head * _KV_CACHE_BYTES // ratio))
                fixed += 2 * ratio * head * _STATE_BYTES * planes
            else:
                per_layer.append(raw)
        return KVFormat(
            kind="compressed",
            dtype="f16",
            bytes_per_token=sum(per_layer),
            fixed_bytes=fixed,
            per_layer_bytes_per_token=tuple(per_layer),
            formula=(
                "per layer: key_length * 2 bytes (raw f16 K, V = K); CSA layers (ratio 4) + (key_length + "
                "indexer key_length) * 2 / 4; HCA layers (ratio 128) + key_length * 2 / 128 (rounded up). Per "
                "session: f32 compressor K and score states, CSA 8 x 2(key_length + indexer key_length), HCA "
                f"128 x key_length, each with {self._rollback} rollback snapshots"
            ),
        )

    def grammar(self, text: str) -> TokenGrammar:
        if not self._tail:
            return super().grammar(text)  # only the tail holds the vocabulary
        with self._grammar_lock:
            if self._tokenizer is None:  # the first grammar: the file's tokenizer, kept from now on
                tokenizer = LlamaVocab(self._path)
                if tokenizer.info.n_vocab != self._n_vocab:
                    tokenizer.close()
                    raise EngineError(f"{self._path}'s tokenizer has {tokenizer.info.n_vocab} tokens, "
                                      f"its output {self._n_vocab}")  # fmt: skip
                self._tokenizer = tokenizer
        return self._tokenizer.grammar(text)

    def _hybrid_layers(self, arch: str, n_layer: int) -> tuple[list[bool], list[bool]]:
        """``(recurrent, attention)`` per layer; a family without recurrent layers attends on every layer."""
        if not family(arch).recurrent:
            return [False] * n_layer, [True] * n_layer
        return hybrid_layers(self._path, arch, n_layer)

    def _recurrent_state_bytes(self, arch: str) -> int:
        """One recurrent layer's state per session (f32), as llama.cpp sizes it (``n_embd_r`` +
        ``n_embd_s``): a Mamba-style convolution and SSM state, or LFM2's short-convolution cache."""
        l_cache = self._int_meta(f"{arch}.shortconv.l_cache")
        if l_cache:
            return self._n_embd * (l_cache - 1) * _STATE_BYTES
        d_conv = self._int_meta(f"{arch}.ssm.conv_kernel")
        d_inner = self._int_meta(f"{arch}.ssm.inner_size")
        d_state = self._int_meta(f"{arch}.ssm.state_size")
        groups = self._int_meta(f"{arch}.ssm.group_count")
        return ((d_conv - 1) * (d_inner + 2 * groups * d_state) + d_state * d_inner) * _STATE_BYTES

    @property
    def eval_callback(self) -> str | None:
        """Which eval callback this shard's graph runs through: "compiled", "python", or None (a tail
        that needs none)."""
        return self._capture.kind if self._capture is not None else None

    def close(self) -> None:
        super().close()
        ll = self._ll
        if self._tokenizer is not None:
            self._tokenizer.close()
        if self._ctx is not None:
            ll.llama_batch_free(self._batch)
            ll.llama_free(self._ctx)
            ll.llama_model_free(self._model)
            self._ctx = None


def _no_tokenizer(ll: Any, path: Path) -> Any:
    """llama.cpp metadata overrides that load ``path`` with its vocabulary as that many dummy
    tokens (``no_vocab``, as a cut-vocabulary shard is written): the same tensors, graphs and
    logits, no tokenizer. None where the file has no tokenizer to drop."""
    header = read_header(path)
    tokens = header.fields.get("tokenizer.ggml.tokens")
    kind = header.fields.get("tokenizer.ggml.model")
    arch = header.fields.get("general.architecture")
    if tokens is None or kind is None or arch is None or kind.contents() in ("no_vocab", "none"):
        return None
    overrides = (ll.llama_model_kv_override * 3)()  # the last one, all zero, ends the list
    overrides[0].key = b"tokenizer.ggml.model"
    overrides[0].tag = ll.LLAMA_KV_OVERRIDE_TYPE_STR
    overrides[0].value.val_str = b"no_vocab"
    overrides[1].key = f"{arch.contents()}.vocab_size".encode()
    overrides[1].tag = ll.LLAMA_KV_OVERRIDE_TYPE_INT
    overrides[1].value.val_i64 = tokens.count
    return overrides


@functools.cache
def _cpu_model() -> str:
    """The processor's model name: llama.cpp picks its kernels (and so the low bits) by it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
