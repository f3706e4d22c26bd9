"""The shard-backend interface: execute a contiguous layer range with per-session local KV.

A shard takes what crosses its inbound seam (token ids at the head, the residual stream
elsewhere), runs its blocks for a chunk of *absolute* positions, appends to the session's
KV/state, and hands out what crosses its outbound seam (the residual stream; logits of the last
position at the tail). The seam is architecture-defined and declared in ``ShardInfo.seam``:
``[n, hidden]`` for llama, ``[n, hc_mult, hidden]`` for DeepSeek-V4's hyper-connection streams.
Architectures that read token ids inside their layers (DeepSeek-V4's hash-routed layers) set
``seam.carries_token_ids``; every shard then also receives the chunk's token ids.

Ownership and concurrency: the session table is a ``SessionStore`` (sessions' state lives there
and nowhere else). ``ShardBase`` validates every input and reserves positions in the store
*before* any compute, so a bad call raises a named error and changes nothing. A backend
serializes its own compute; calls on one session never interleave (``SessionBusy``).

In memory, hidden states are float32 numpy arrays; the wire format (route issue) may carry
bfloat16/float16 and converts at the node boundary.
"""

from __future__ import annotations

import abc
import contextlib
import json
import struct
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from meshnet.errors import InvalidRequest, MeshnetError, SeamMismatch
from meshnet.ids import SessionId
from meshnet.layers import LayerRange
from meshnet.session.store import Parked, SessionStore, StoreLimits

if TYPE_CHECKING:
    from meshnet.backends.grammar import TokenGrammar

__all__ = [
    "DecodeStep",
    "KVFormat",
    "SeamSpec",
    "ShardBackend",
    "ShardBase",
    "ShardInfo",
    "ShardOutput",
    "compute_chunks",
    "verify_chunk",
]

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]

_SNAPSHOT_MAGIC = b"MNKV"
_SNAPSHOT_VERSION = 1


@dataclass(frozen=True, slots=True)
class SeamSpec:
    """One position's slice of the residual stream that crosses a seam."""

    shape: tuple[int, ...]
    carries_token_ids: bool = False

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True, slots=True)
class KVFormat:
    """What a session costs on this shard, in bytes.

    ``bytes_per_token`` sums the per-layer figures in ``per_layer_bytes_per_token`` (0 for a layer
    with only a fixed-size recurrent state); ``fixed_bytes`` is the length-independent part
    (linear-attention / SSM states). ``formula`` says how the numbers were derived.
    """

    kind: str
    dtype: str
    bytes_per_token: int
    fixed_bytes: int
    per_layer_bytes_per_token: tuple[int, ...]
    formula: str


@dataclass(frozen=True, slots=True)
class ShardInfo:
    model_id: str
    architecture: str
    backend: str
    layers: LayerRange
    seam: SeamSpec
    n_vocab: int
    max_positions: int
    weight_bytes: int
    kv: KVFormat
    # What decides the low bits of this shard's results: library and version, processor, threads,
    # batch size. Two shards with the same layers and the same ``numerics`` compute identical KV and
    # activations; route repair replaces a hop only with one whose numerics equal its own
    # (tracker.repair), so a repaired route computes what the old one would have.
    numerics: str = ""
    # Speculative decoding: the most drafted positions one verify chunk may add (0: this shard
    # cannot verify: it cannot drop any suffix of a chunk, a rejected draft). A verify chunk must
    # compute every position to the bits of a one-position decode step, so the KV it keeps is what
    # plain decoding would have kept: it runs as one compute call only where ``verify_batched``
    # (measured by the backend on its own weights), else as one call per position.
    max_verify: int = 0
    verify_batched: bool = False
    # Batched decode: the most sessions' one-position steps one compute call may hold
    # (``decode_many``). Above 1 only where the backend measured, on its own weights, that a
    # batch gives every session the bits of its own step, so batching never changes any text.
    decode_batch: int = 1
    # Where a chunk or a batch keeps those bits only for positions below a bound (llama.cpp with
    # several threads: past 256 cells a lone row's attention is summed in per-thread parts), the
    # bound; None: at every position. Positions at or past it compute one at a time.
    verify_batched_below: int | None = None
    decode_batch_below: int | None = None


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One session's one-position decode step, as ``decode_many`` takes it."""

    sid: SessionId
    position: int
    token: int | None = None
    hidden: F32 | None = None


@dataclass(frozen=True, slots=True)
class ShardOutput:
    """``hidden``: ``[n, *seam.shape]`` float32 (non-tail); ``logits`` (tail): ``[vocab]`` of the last
    position, or ``[n, vocab]`` of every position when the call asked for ``all_logits``."""

    hidden: F32 | None = None
    logits: F32 | None = None


class ShardBackend(Protocol):
    info: ShardInfo

    @property
    def store(self) -> SessionStore[Any]: ...

    def open_session(self, sid: SessionId) -> None: ...

    def prefill(
        self,
        sid: SessionId,
        start: int,
        *,
        tokens: I32 | None = None,
        hidden: F32 | None = None,
        all_logits: bool = False,
    ) -> ShardOutput: ...

    def decode_step(
        self, sid: SessionId, position: int, *, token: int | None = None, hidden: F32 | None = None
    ) -> ShardOutput: ...

    def decode_many(self, steps: Sequence[DecodeStep]) -> list[ShardOutput | MeshnetError]: ...

    @property
    def shares_cores(self) -> bool: ...

    def rewind(self, sid: SessionId, position: int) -> None: ...

    def snapshot(self, sid: SessionId) -> bytes: ...

    def restore(self, sid: SessionId, blob: bytes) -> None: ...

    def adopt(self, sid: SessionId, blob: bytes, position: int) -> None: ...

    def park(self, sid: SessionId, position: int) -> Parked[Any]: ...

    def adopt_parked(self, sid: SessionId, parked: Parked[Any], position: int) -> None: ...

    def release(self, parked: Parked[Any]) -> None: ...

    def park_snapshot(self, blob: bytes) -> Parked[Any]: ...

    def restore_parked(self, sid: SessionId, parked: Parked[Any]) -> None: ...

    def close_session(self, sid: SessionId) -> None: ...

    def grammar(self, text: str) -> TokenGrammar:
        """Compile a GBNF grammar against the model's vocabulary (a tail that samples under it)."""
        ...

    def close(self) -> None: ...


S = TypeVar("S")


class ShardBase(abc.ABC, Generic[S]):
    """Validation, position bookkeeping and snapshot framing shared by every backend.

    Subclasses implement ``_forward`` (compute one chunk on ``state``), the state hooks
    (``_new_state``, ``_free_state``, ``_truncate_state``) and ``_dump_state`` / ``_load_state``
    for snapshots, then call ``_init_store``. Every hook runs under the shard's compute lock.
    """

    info: ShardInfo
    _store: SessionStore[S]

    def __init__(self) -> None:
        self._compute = threading.Lock()  # one forward (or state mutation) at a time per shard
        # Held around every forward (not around state bookkeeping): a machine-wide core lease
        # (meshnet.cores) when co-located shards share the cores, else nothing.
        self.core_lease: contextlib.AbstractContextManager[object] = contextlib.nullcontext()

    def _init_store(self, limits: StoreLimits) -> None:
        def free(state: S) -> None:
            with self._compute:
                self._free_state(state)

        def truncate(state: S, position: int) -> None:
            with self._compute:
                self._truncate_state(state, position)

        def demote(state: S, position: int) -> bytes:
            with self._compute:
                body = self._dump_state(state, position)
            return self._framed(body, position)

        self._store = SessionStore(limits, new_state=self._new_state_locked, free_state=free, truncate_state=truncate)
        self._store.demote = demote

    @property
    def shares_cores(self) -> bool:
        """Whether every forward takes a machine-wide core lease, which may wait for another process's compute."""
        return not isinstance(self.core_lease, contextlib.nullcontext)

    def _new_state_locked(self, sid: SessionId) -> S:
        with self._compute:
            return self._new_state(sid)

    @property
    def store(self) -> SessionStore[S]:
        return self._store

    # -- the interface -----------------------------------------------------------------------
    def open_session(self, sid: SessionId) -> None:
        self._store.open(sid)

    def close_session(self, sid: SessionId) -> None:
        self._store.close(sid)

    def prefill(
        self,
        sid: SessionId,
        start: int,
        *,
        tokens: I32 | None = None,
        hidden: F32 | None = None,
        all_logits: bool = False,
    ) -> ShardOutput:
        tokens, hidden, n = self._check_inputs(tokens, hidden)
        with self._store.use(sid, start, n) as session, self._compute, self.core_lease:
            return self._forward(session.state, start, tokens, hidden, all_logits)

    def decode_step(
        self, sid: SessionId, position: int, *, token: int | None = None, hidden: F32 | None = None
    ) -> ShardOutput:
        tokens = None if token is None else np.asarray([token], dtype=np.int32)
        if hidden is not None and hidden.shape[:1] != (1,):
            raise SeamMismatch(f"a decode step carries one position, got hidden of shape {hidden.shape}")
        return self.prefill(sid, position, tokens=tokens, hidden=hidden)

    def decode_many(self, steps: Sequence[DecodeStep]) -> list[ShardOutput | MeshnetError]:
        """Several sessions' decode steps, each one's output or its own error, in ``steps`` order.

        Up to ``info.decode_batch`` steps run as one compute call (several sequences in one
        batch); a step that is refused (bad input, wrong position, busy or unknown session) gets
        its error and changes nothing, and the others still run. If the batch itself fails, every
        session in it is back where it was and each step runs alone, so each gets its own outcome."""
        results: list[ShardOutput | MeshnetError | None] = [None] * len(steps)
        limit, below = max(1, self.info.decode_batch), self.info.decode_batch_below
        together = [i for i, step in enumerate(steps) if below is None or step.position < below]
        for i in sorted(set(range(len(steps))) - set(together)):
            results[i] = self._decode_one(steps[i])
        for begin in range(0, len(together), limit):
            part = together[begin : begin + limit]
            if len(part) == 1:
                results[part[0]] = self._decode_one(steps[part[0]])
            else:
                self._decode_batch(steps, part, results)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _decode_one(self, step: DecodeStep) -> ShardOutput | MeshnetError:
        try:
            return self.decode_step(step.sid, step.position, token=step.token, hidden=step.hidden)
        except MeshnetError as exc:
            return exc

    def _decode_batch(
        self, steps: Sequence[DecodeStep], part: Sequence[int], results: list[ShardOutput | MeshnetError | None]
    ) -> None:
        ready: list[int] = []
        try:
            with contextlib.ExitStack() as reserved:
                rows: list[tuple[S, int, I32 | None, F32 | None]] = []
                for i in part:
                    step = steps[i]
                    try:
                        tokens = None if step.token is None else np.asarray([step.token], dtype=np.int32)
                        tokens, hidden, n = self._check_inputs(tokens, step.hidden)
                        if n != 1:
                            raise SeamMismatch(f"a decode step carries one position, got {n}")
                        session = reserved.enter_context(self._store.use(step.sid, step.position, 1))
                    except MeshnetError as exc:
                        results[i] = exc
                        continue
                    ready.append(i)
                    rows.append((session.state, step.position, tokens, hidden))
                if not rows:
                    return
                with self._compute, self.core_lease:
                    outs = self._forward_many(rows) if len(rows) > 1 else [self._forward(*rows[0])]
                for i, out in zip(ready, outs, strict=True):
                    results[i] = out
        except MeshnetError:
            # every reservation was undone as the error left it: each session is where it was
            for i in ready:
                results[i] = self._decode_one(steps[i])

    def rewind(self, sid: SessionId, position: int) -> None:
        """Forget positions ``>= position``; a backend that cannot (``EngineError``) leaves the session as it was."""
        self._store.rewind(sid, position)

    def snapshot(self, sid: SessionId) -> bytes:
        session = self._store.get(sid)
        with self._compute:
            body = self._dump_state(session.state, session.position)
        return self._framed(body, session.position)

    def _framed(self, body: bytes, position: int) -> bytes:
        header = json.dumps(
            {
                "model_id": self.info.model_id,
                "architecture": self.info.architecture,
                "backend": self.info.backend,
                "layers": [self.info.layers.start, self.info.layers.stop, self.info.layers.total],
                "position": position,
                "kv": asdict(self.info.kv),
            },
            sort_keys=True,
        ).encode()
        return _SNAPSHOT_MAGIC + struct.pack("<HI", _SNAPSHOT_VERSION, len(header)) + header + body

    def park(self, sid: SessionId, position: int) -> Parked[S]:
        """End ``sid`` but keep its first ``position`` positions in the shard's own memory, for
        later sessions to adopt (``adopt_parked``) until a live session needs the room
        (``SessionStore.park``). A backend that cannot cut the session back raises ``EngineError``
        and the session is as it was."""
        return self._store.park(sid, position)

    def release(self, parked: Parked[S]) -> None:
        self._store.release(parked)

    def park_snapshot(self, blob: bytes) -> Parked[S]:
        """Load a ``snapshot`` into a parked state of its own (a standby's copy of another hop's KV):
        it takes room parked states yield, never a live session's (``StoreFull``), and a refused
        snapshot is an ``InvalidRequest`` now rather than at the repair."""
        header, body = self._parse_snapshot(blob)
        position = int(header["position"])

        def create() -> S:
            with self._compute:
                return self._load_state(SessionId("parked-snapshot"), body, position)

        return self._store.park_new(create, position)

    def restore_parked(self, sid: SessionId, parked: Parked[S]) -> None:
        """``restore`` from a parked snapshot: the session opens on its state, with nothing copied."""
        self._store.open_parked(sid, parked)

    def restore(self, sid: SessionId, blob: bytes) -> None:
        header, body = self._parse_snapshot(blob)
        position = int(header["position"])
        self._store.make_room(1, self._store.limits.bytes_at(position))
        with self._compute:
            state = self._load_state(sid, body, position)
        try:
            self._store.open(sid, state=state, position=position)
        except Exception:
            with self._compute:
                self._free_state(state)
            raise

    def adopt(self, sid: SessionId, blob: bytes, position: int) -> None:
        """Give the fresh session ``sid`` the first ``position`` positions of the ``snapshot`` ``blob``
        (a prefix cache hit, ``node.prefix_cache``). A backend that cannot drop the snapshot's later
        positions raises ``EngineError``; any failure leaves the session fresh."""
        header, body = self._parse_snapshot(blob)
        self._adopt_body(sid, body, int(header["position"]), position)

    def adopt_parked(self, sid: SessionId, parked: Parked[S], position: int) -> None:
        """``adopt`` from a parked state: its first ``position`` positions are copied into the fresh
        session ``sid``, and it stays parked for others. ``SessionGone`` if it was evicted."""
        with self._store.pinned(parked) as state:
            with self._compute:
                body = self._dump_state(state, parked.position)
            self._adopt_body(sid, body, parked.position, position)

    def _adopt_body(self, sid: SessionId, body: bytes, held: int, position: int) -> None:
        if not 0 < position <= held:
            raise InvalidRequest(f"a snapshot of {held} positions cannot give a session {position}")

        def swap(old: S) -> S:
            with self._compute:
                if self._load_into(old, body, held):
                    if position < held:
                        try:
                            self._truncate_state(old, position)
                        except BaseException:
                            self._truncate_state(old, 0)  # fresh again
                            raise
                    return old
                new = self._load_state(sid, body, held)
                try:
                    if position < held:
                        self._truncate_state(new, position)
                except BaseException:
                    self._free_state(new)
                    raise
                self._free_state(old)
                return new

        self._store.adopt(sid, position, swap)

    def grammar(self, text: str) -> TokenGrammar:
        raise InvalidRequest(
            f"this node's {self.info.backend} shard has no tokenizer to apply a grammar (response_format, "
            "tools) with; serve the tail from a GGUF",
            param="grammar",
        )

    def close(self) -> None:
        self._store.close_all()

    # -- for subclasses ----------------------------------------------------------------------
    @abc.abstractmethod
    def _forward(
        self, state: S, start: int, tokens: I32 | None, hidden: F32 | None, all_logits: bool = False
    ) -> ShardOutput: ...

    def _forward_many(self, rows: Sequence[tuple[S, int, I32 | None, F32 | None]]) -> list[ShardOutput]:
        """One position of each of several sessions (``(state, position, tokens, hidden)``); a
        backend that sets ``info.decode_batch`` above 1 computes them as one batch."""
        return [self._forward(*row) for row in rows]

    @abc.abstractmethod
    def _new_state(self, sid: SessionId) -> S: ...

    @abc.abstractmethod
    def _free_state(self, state: S) -> None: ...

    @abc.abstractmethod
    def _truncate_state(self, state: S, position: int) -> None:
        """Drop everything at positions >= ``position`` (undo a failed chunk)."""

    @abc.abstractmethod
    def _dump_state(self, state: S, position: int) -> bytes: ...

    @abc.abstractmethod
    def _load_state(self, sid: SessionId, body: bytes, position: int) -> S: ...

    def _load_into(self, state: S, body: bytes, position: int) -> bool:
        """Load a snapshot body into a fresh session's own ``state`` where the backend can, leaving it
        fresh if that fails; False where it cannot, and ``adopt`` loads a new state beside it (which
        needs room for one more)."""
        return False

    # -- validation --------------------------------------------------------------------------
    def _check_inputs(self, tokens: I32 | None, hidden: F32 | None) -> tuple[I32 | None, F32 | None, int]:
        info = self.info
        needs_tokens = info.layers.is_head or info.seam.carries_token_ids
        if needs_tokens and tokens is None:
            raise SeamMismatch(f"shard {info.layers} needs the chunk's token ids")
        if info.layers.is_head and hidden is not None:
            raise SeamMismatch("the head shard takes token ids, not hidden states")
        if not info.layers.is_head and hidden is None:
            raise SeamMismatch(f"shard {info.layers} takes the hidden states of the previous shard")
        n = -1
        if tokens is not None:
            tokens = np.asarray(tokens)
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise SeamMismatch(f"token ids must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
            if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= info.n_vocab):
                raise InvalidRequest(f"token ids must be within [0, {info.n_vocab})")
            tokens = tokens.astype(np.int32, copy=False)
            n = tokens.shape[0]
        if hidden is not None:
            if hidden.dtype != np.float32:
                raise SeamMismatch(f"hidden states must be float32 in memory, got {hidden.dtype}")
            want = info.seam.shape
            if hidden.ndim != 1 + len(want) or tuple(hidden.shape[1:]) != want:
                dims = ", ".join(map(str, want))
                raise SeamMismatch(f"hidden states must have shape [n, {dims}], got {list(hidden.shape)}")
            if n >= 0 and hidden.shape[0] != n:
                raise SeamMismatch(f"{n} token ids but {hidden.shape[0]} hidden rows")
            if not np.isfinite(hidden).all():
                raise SeamMismatch("hidden states contain NaN or Inf")
            n = hidden.shape[0]
        if n <= 0:
            raise InvalidRequest("a chunk holds at least one position")
        return tokens, hidden, n

    def _parse_snapshot(self, blob: bytes) -> tuple[dict[str, Any], bytes]:
        if len(blob) < 10 or blob[:4] != _SNAPSHOT_MAGIC:
            raise InvalidRequest("not a Meshnet KV snapshot (bad magic)")
        version, size = struct.unpack_from("<HI", blob, 4)
        if version != _SNAPSHOT_VERSION:
            raise InvalidRequest(f"snapshot version {version} is not supported (expected {_SNAPSHOT_VERSION})")
        try:
            header = json.loads(blob[10 : 10 + size])
        except ValueError:
            raise InvalidRequest("snapshot header is corrupt") from None
        mine = self.info
        layers = [mine.layers.start, mine.layers.stop, mine.layers.total]
        for key, want in (("model_id", mine.model_id), ("backend", mine.backend), ("layers", layers)):
            if header.get(key) != want:
                raise InvalidRequest(f"snapshot {key} {header.get(key)!r} does not match this shard's {want!r}")
        return header, blob[10 + size :]


def compute_chunks(
    shard: ShardBackend,
    sid: SessionId,
    start: int,
    sizes: Sequence[int],
    *,
    tokens: I32 | None = None,
    hidden: F32 | None = None,
    all_logits: bool = False,
) -> ShardOutput:
    """One compute call per chunk of ``sizes`` (a position's KV depends on the chunk it was computed
    in, protocol.ledger). A failure undoes the chunks before it too, so a refused request changes
    nothing. The tail returns the last position's logits, or every chunk's with ``all_logits``."""
    if len(sizes) == 1:
        return shard.prefill(sid, start, tokens=tokens, hidden=hidden, all_logits=all_logits)
    outs: list[ShardOutput] = []
    at = 0
    try:
        for size in sizes:
            part_tokens = None if tokens is None else tokens[at : at + size]
            part_hidden = None if hidden is None else hidden[at : at + size]
            outs.append(shard.prefill(sid, start + at, tokens=part_tokens, hidden=part_hidden, all_logits=all_logits))
            at += size
    except BaseException:
        if at:
            shard.rewind(sid, start)
        raise
    states = [o.hidden for o in outs if o.hidden is not None]
    rows = [o.logits for o in outs if o.logits is not None]
    logits = (np.concatenate(rows) if rows else None) if all_logits else outs[-1].logits
    return ShardOutput(hidden=np.concatenate(states) if states else None, logits=logits)


def verify_chunk(
    shard: ShardBackend, sid: SessionId, start: int, *, tokens: I32 | None = None, hidden: F32 | None = None
) -> ShardOutput:
    """A speculative verify chunk on one shard: every position computed to the bits of a
    one-position step — in one call where the shard measured that a chunk gives those bits
    (``ShardInfo.verify_batched``, for positions below ``verify_batched_below``), else one call
    per position. The tail returns every position's logits (``[n, vocab]``). A failure undoes the
    positions before it, so a refused chunk changes nothing."""
    n = len(tokens) if tokens is not None else len(hidden)  # type: ignore[arg-type]
    below = shard.info.verify_batched_below
    one_call = shard.info.verify_batched and (below is None or start + n <= below)
    sizes = (n,) if one_call else (1,) * n
    return compute_chunks(shard, sid, start, sizes, tokens=tokens, hidden=hidden, all_logits=True)
