"""The tail's part of ``NodeService``: the answer to a final chunk.

The tail samples the next token (``meshnet.sampling``; under a grammar off the event loop, under a
per-token deadline: ``node.sampling_lane``, a costly grammar fails its generation, never the node's
loop), and signs its answer with its draw (protocol.signing). After a verify chunk (speculative decoding)
it keeps the drafts its sampler agrees with plus one token of its own, and every hop drops the
rejected positions as the answer passes it back (``_drop_rejected``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshnet.errors import HopFailed, MeshnetError
from meshnet.node.sampling_lane import SamplingTooSlow
from meshnet.node.service_base import Recorded
from meshnet.node.service_repair import RepairParts
from meshnet.node.session import NodeSession
from meshnet.protocol.channel import Direct
from meshnet.protocol.messages import (
    HopAnswer,
    HopRequest,
    Sampled,
    TokenAnswer,
    Verb,
    VerifyAnswer,
    ids_payload,
)
from meshnet.routes import hop_timeout_s
from meshnet.sampling import Alternatives, Committed, Sampler

__all__ = ["TailParts"]

log = logging.getLogger("meshnet.node")


class TailParts(RepairParts):
    """The tail's answer to a final chunk."""

    async def _sampled(
        self, s: NodeSession, request: HopRequest, logits: np.ndarray, entry: Recorded, compute_ms: float, *,
        direct: Direct | None, began: float,
    ) -> Sampled:  # fmt: skip
        """The tail's answer: the token after the chunk; for a verify chunk, the drafts it keeps and one
        token of its own (``Sampler.verify``), with the rejected drafts' positions dropped first. Its
        entry (``entry``: the chunk recorded, on the first call) says what it held before: after a
        ``direct`` verify chunk, the hops before it drop the rejected drafts only when the next step
        tells them (``rewind``), so every entry of the answer describes the whole chunk. After a
        ``direct`` plain step the step after its token leaves for the head (``_relay_next``) before
        the step is recorded and the answer worked out: the step's time on this hop (``began``: its
        arrival) ends there, and the rest is the next token's time beside the head's compute."""
        assert s.sampler is not None
        sampler, start, n, drafts = s.sampler, request.start, request.n, request.drafts
        history = s.ids_seen[sampler.params.generated_from : start + n - len(drafts)] if s.carry_ids else None
        try:  # a grammar's off the event loop, under a deadline: a costly one fails this generation, not the node
            grammar = sampler.grammar
            chosen = await self.sampling.run(
                lambda: _choose(sampler, logits, history, drafts, at=start + n if not drafts else start + 1),
                tokens=1 + len(drafts), grammar=grammar is not None,
                cancel=grammar.cancel if grammar is not None else None,
                progress=(lambda: grammar.accepted_at) if grammar is not None else None,
            )  # fmt: skip
        except SamplingTooSlow as exc:
            s.break_with(exc)  # its sampler is still busy on a worker thread: nothing may use it again
            raise
        if isinstance(chosen, Committed):
            token, position = chosen.token, start + n
            s.sampled = (position, token)
            relayed = direct is not None and await self._relay_next(s, direct, position, token)
            if relayed:
                self._handed_on(request, began, compute_ms)
            me = entry()
            logprob, draw = chosen.finish()
            top = sampler.alternatives(logits) if sampler.params.top_logprobs else None
            answer = TokenAnswer((me,), position=position, token=token, logprob=logprob, top=top, draw=draw)
            if not relayed:
                self._handed_on(request, began, compute_ms)
            return self.config.hop_key.sign_answer(s.session, answer)  # the tail vouches for its token and draw
        me = entry()
        tokens, logprobs, tops = list(chosen.tokens), list(chosen.logprobs), chosen.tops
        kept = start + len(tokens)
        await self.rewind(s, kept)
        if direct is None:
            me = self._entry(s, me.compute_ms, positions=me.positions, sign=False)
        verified = VerifyAnswer(
            (me,), position=kept, tokens=tuple(tokens), logprobs=tuple(logprobs), tops=tops,
            drafted=len(drafts), accepted=len(tokens) - 1,
        )  # fmt: skip
        s.sampled = (kept, tokens[-1])
        self._handed_on(request, began, compute_ms)
        return self.config.hop_key.sign_answer(s.session, verified)

    async def _relay_next(self, s: NodeSession, direct: Direct, position: int, token: int) -> bool:
        """Send the step after this one — ``token`` at ``position`` — to the route's head, when a
        ``CREDIT`` gave leave for the step after this one (``direct.seq``) and the token is not one
        the generation ends with; ``NodeService.relay`` reports what it did. Any answered step uses up
        the session's credit, so a credit never outlives the step it follows (a repair, a rewind or a
        late credit leaves none behind). A failed send is only logged: the answer says nothing was
        relayed, and the gateway sends the step itself. Whether it sent the step."""
        credit, s.credit = s.credit, None
        relayed = None
        if (
            credit is not None
            and credit.after == direct.seq
            and self.channel_send is not None
            and (token not in credit.stop)
        ):
            request = HopRequest(Verb.DECODE, s.session, position, 1, ids_payload([token]), model=credit.model,
                                 route_id=credit.route_id, guess=token)  # fmt: skip
            try:
                timeout = hop_timeout_s(self.config.hop_timeout_s, len(credit.returns))
                await self.channel_send(credit.head, request, Direct(credit.seq, credit.returns), timeout)
            except MeshnetError as exc:
                log.warning("session %s: relaying step %d to %s failed (the gateway sends it): %s", s.session,
                            credit.seq, credit.head, exc.message)  # fmt: skip
            else:
                self.metrics.relayed.inc()
                relayed = credit.seq
        s.relayed = (direct.seq, relayed)
        return relayed is not None

    async def _drop_rejected(self, s: NodeSession, answer: HopAnswer, *, start: int, n: int) -> None:
        """Keep what the verify ``answer`` kept (up to its ``position``) of the chunk of ``n`` at ``start``."""
        hop = s.next_hops[0]
        if not isinstance(answer, VerifyAnswer) or not start < answer.position <= start + n:
            what = f"position {answer.position}" if isinstance(answer, VerifyAnswer) else f"a {answer.kind} answer"
            error = HopFailed(f"next hop {hop} answered a verify chunk at {start} with {what}", failed_hop=hop)
            s.break_with(error)
            raise error
        await self.rewind(s, answer.position)


@dataclass(frozen=True, slots=True)
class _Chosen:
    """What the tail's sampler decided for a verify chunk: its tokens, their logprobs and alternatives."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    tops: tuple[Alternatives, ...] | None


def _choose(
    sampler: Sampler, logits: np.ndarray, history: Sequence[int] | None, drafts: Sequence[int], *, at: int
) -> _Chosen | Committed:
    """The sampler's work for one answer, on a worker thread under a grammar: bring it up to ``history``
    (the generated tokens before this answer), then the token at ``at`` (its commitment and
    alternatives follow when asked) — or, after ``drafts``, the drafts it keeps and one token of its
    own from ``at`` on."""
    if history is not None:
        sampler.set_history(history)
    if not drafts:
        return sampler.choose_committed(logits, position=at)
    tokens, logprobs = sampler.verify(logits, drafts, position=at)
    tops = tuple(sampler.alternatives(row) for row in logits[: len(tokens)]) if sampler.params.top_logprobs else None
    return _Chosen(tuple(tokens), tuple(logprobs), tops)
