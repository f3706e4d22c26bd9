"""An auditor node's re-execution of another hop's work (``POST /v1/audit``, protocol.audits).

A node started with ``--auditor`` registers as one (a private swarm takes auditors from trusted
members only) and is never put on a route; gateways send it a hop's inputs of an audited session
(``AuditRequest``) and it computes them on its own shard, of the same layers and numerics, in a
scratch session: chunk by chunk, as the hop's ledger says they were computed (a position's bits
depend on its chunk, protocol.ledger), keeping the same running digests a hop keeps of what it
computed from and sent on. At the tail it draws, at every position the tail answered with a
committed draw, with the session's sampler and seed (``Sampler.sample_committed``). The answer is
an ``AuditStatement`` signed with the node's hop key; the gateway and the tracker judge it.

Concurrency: one audit at a time per node (``AuditLane``), its compute off the event loop; the
scratch session is closed whatever happens, so an audit leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Callable

import numpy as np

from meshnet.backends.shard import ShardBackend
from meshnet.errors import InvalidRequest, Overloaded, SeamMismatch
from meshnet.ids import SessionId
from meshnet.protocol.audits import (
    PROBABILITY_TOLERANCE,
    RESIDUAL_TOLERANCE,
    AuditRequest,
    AuditStatement,
    AuditStep,
    sign_statement,
)
from meshnet.protocol.ledger import EMPTY_DIGEST, ChunkLedger, extend_digest
from meshnet.protocol.signing import HopKey
from meshnet.protocol.wire import TensorFrame, checked_values, encode_tensor, frame_values
from meshnet.sampling import Sampler, SamplingParams, TokenGrammar

__all__ = ["AuditLane", "reexecute"]

GrammarOf = Callable[[str], TokenGrammar]


class AuditLane:
    """One audit at a time on this node; another waiting past ``wait_s`` is a 503 to retry."""

    def __init__(self, wait_s: float = 60.0) -> None:
        self._lock = asyncio.Lock()
        self.wait_s = wait_s

    async def run(self, work: Callable[[], AuditStatement]) -> AuditStatement:
        try:
            await asyncio.wait_for(self._lock.acquire(), self.wait_s)
        except TimeoutError:
            raise Overloaded("this auditor is busy with another audit; retry later", retry_after_s=10) from None
        try:
            return await asyncio.get_running_loop().run_in_executor(None, work)
        finally:
            self._lock.release()


def reexecute(
    shard: ShardBackend, key: HopKey, auditor: str, request: AuditRequest, grammar_of: GrammarOf | None = None
) -> AuditStatement:
    """Compute ``request``'s positions on ``shard`` in a scratch session; the signed statement."""
    info = shard.info
    if request.layers != str(info.layers):
        raise InvalidRequest(f"this auditor computes layers {info.layers}; the audit is of layers {request.layers}")
    held, tail = request.held, info.layers.is_tail
    tokens, hidden = _inputs(shard, request)
    sampler = _sampler(request, grammar_of) if tail else None
    answered = set(request.positions)
    ledger = ChunkLedger(sends=not tail)
    steps: list[AuditStep] = []
    computed: list[np.ndarray] = []  # across numerics classes: what these layers give, to compare
    sid = SessionId(f"audit-{secrets.token_hex(12)}")
    shard.open_session(sid)
    try:
        at = 0
        for size in request.chunks:
            part_tokens = None if tokens is None else tokens[at : at + size]
            part_hidden = None if hidden is None else hidden[at : at + size]
            out = shard.prefill(sid, at, tokens=part_tokens, hidden=part_hidden)
            data = part_hidden if part_hidden is not None else np.ascontiguousarray(part_tokens, dtype="<i4")
            sent = b""
            if not tail:
                assert out.hidden is not None
                frame = encode_tensor(out.hidden.reshape(1, *out.hidden.shape), request.wire_dtype)
                sent = frame_values(frame).reshape(size, -1).tobytes()
                if request.cross:
                    computed.append(out.hidden.reshape(size, -1))
            ledger.record(size, np.ascontiguousarray(data).tobytes(), sent)
            at += size
            if sampler is not None and at in answered:
                assert out.logits is not None
                steps.append(_step(sampler, request, out.logits, at, ledger.inputs[-1].hex()))
    finally:
        shard.close_session(sid)
    described = ledger.describe()
    statement = AuditStatement(
        request.session, request.node, request.layers, auditor, held, str(described["input_digest"]),
        None if tail else str(described["output_digest"]), tuple(steps),
    )  # fmt: skip
    if request.cross:
        statement = _across(statement, request, shard, hidden, computed)
    return sign_statement(key, statement)


def _across(
    statement: AuditStatement, request: AuditRequest, shard: ShardBackend, hidden: np.ndarray | None,
    computed: list[np.ndarray],
) -> AuditStatement:  # fmt: skip
    """Another numerics class than the hop's: how far what the hop sent on (``request.outputs``) is from
    what these layers give, as the largest share of a position's residual update (its output less its
    input; at the head, its output) by which they differ. The tail's draws are compared by the judge."""
    if shard.info.layers.is_tail:
        return dataclasses.replace(statement, tolerance=PROBABILITY_TOLERANCE, deviation=0.0)
    held = request.held
    try:
        frame = TensorFrame((1, held, *shard.info.seam.shape), request.wire_dtype, request.outputs)
        claimed = checked_values(frame).reshape(held, -1).astype(np.float64)
    except ValueError as exc:
        raise SeamMismatch(
            f"the hop's outputs are not {held} positions of shape {shard.info.seam.shape}: {exc}"
        ) from None
    digest, at = EMPTY_DIGEST, 0
    for size in request.chunks:
        digest = extend_digest(digest, at, size, claimed[at : at + size].astype(np.float32).tobytes())
        at += size
    own = np.concatenate(computed).astype(np.float64)
    update = own - (hidden.reshape(held, -1) if hidden is not None else 0.0)
    scale = np.maximum(np.linalg.norm(update, axis=-1), np.finfo(np.float32).tiny)
    deviation = float(np.max(np.linalg.norm(claimed - own, axis=-1) / scale))
    return dataclasses.replace(
        statement, tolerance=RESIDUAL_TOLERANCE, deviation=deviation, compared_digest=digest.hex()
    )


def _inputs(shard: ShardBackend, request: AuditRequest) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(token ids the shard reads, activations) of every audited position, shapes checked."""
    info, held = shard.info, request.held
    ids = np.frombuffer(request.ids, dtype="<i4").astype(np.int32) if request.ids else None
    used = info.seam.carries_token_ids or info.layers.is_head or info.layers.is_tail  # a middle may hold no vocabulary
    if used and ids is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= info.n_vocab):
        raise SeamMismatch(f"token ids must lie in 0..{info.n_vocab - 1}")
    if info.layers.is_head:
        if request.dtype != "int32" or len(request.inputs) != 4 * held:
            raise SeamMismatch(f"the head's inputs are {held} int32 token ids")
        return checked_values(TensorFrame((1, held), "int32", request.inputs)).reshape(held), None
    if request.dtype == "int32":
        raise SeamMismatch("past the head an audit's inputs are activations (the seam log of the hop before)")
    shape = (1, held, *info.seam.shape)
    frame = TensorFrame(shape, request.dtype, request.inputs)
    try:
        hidden = checked_values(frame).reshape(shape[1:])
    except ValueError as exc:
        raise SeamMismatch(f"the audit's inputs are not {held} positions of shape {info.seam.shape}: {exc}") from None
    if info.seam.carries_token_ids and ids is None:
        raise SeamMismatch("this model's layers read the token ids at every hop: send the session's ids")
    return (ids if info.seam.carries_token_ids else None), hidden


def _sampler(request: AuditRequest, grammar_of: GrammarOf | None) -> Sampler:
    try:
        params = SamplingParams(**(request.sampling or {}))
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"the audit's sampling parameters: {exc}") from None
    if params.needs_history and not request.ids:
        raise InvalidRequest("the tail's sampler counts the generated tokens here: send the session's ids")
    grammar = None
    if params.grammar:
        if grammar_of is None:
            raise InvalidRequest("this auditor has no vocabulary to compile the session's grammar with")
        grammar = grammar_of(params.grammar)
    return Sampler(params, grammar)


def _step(sampler: Sampler, request: AuditRequest, logits: np.ndarray, at: int, digest: str) -> AuditStep:
    """What the tail should have answered at ``at``: its sampler brought up to the tokens before it."""
    if sampler.params.needs_history:
        ids = np.frombuffer(request.ids, dtype="<i4")
        sampler.set_history([int(t) for t in ids[sampler.params.generated_from : at]])
    token, _, draw = sampler.sample_committed(logits, position=at)
    return AuditStep(at, digest, token, draw)
