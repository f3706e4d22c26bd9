"""The hop protocol's messages as typed records, independent of any transport.

A gateway or an upstream node sends a *hop request* to the next hop of a session's route:

- ``HopRequest`` with ``verb`` ``prefill`` (a chunk of positions), ``decode-step`` (one
  position) or ``verify`` (a step and the drafted tokens after it). Its flags ``replay`` (route
  repair: rebuild KV on this many hops, answer no token) and ``rewind`` (a repair's resent step:
  a hop already past it drops it first) cover the repair traffic; ``guess`` marks a pipelined
  speculation round, sent before the verdict on the round before it: its own token is a draft too,
  and the tail keeps the round only if it sampled that token there (else it answers ``Voided``);
- ``RerouteRequest``: point a session at new next hops, optionally replaying its seam log into them;
- ``PrefixRequest``: a session's first request when its prompt starts with blocks the route may
  hold in its prefix caches: every hop adopts the cached KV of as many leading blocks as it and
  every hop after it hold (``node.prefix_cache``), and the prefill starts after them;
- a delete names only the session.

Every answer is one record per kind, each with exactly its own fields (``HopAnswer`` is their
union): the positions taken (``Accepted``: a pipelined chunk, ``Replayed``, ``Cached``: a prefix
request, ``Restored``: a restore), the next token (``TokenAnswer``) or a verify chunk's kept tokens
(``VerifyAnswer``; both are ``Sampled``), a pipelined round the tail dropped unseen (``Voided``),
or a reroute's outcome (``Rerouted``) — with one
``HopEntry`` per hop that computed it, nearest first; each record's ``kind`` (an ``AnswerKind``)
names it in logs and signatures, and ``answer_from_json`` reads back what its ``to_json`` wrote.
A failure is a ``MeshnetError`` (``meshnet.errors``): what it means to the sender is
``remote_error``, the one error map every transport uses.

Transports: ``protocol.http_binding`` (the HTTP binding of docs/protocol.md, byte for byte) and the
in-process transport of ``protocol.hops``. Records check their own invariants when built, so a
malformed request is refused the same way whichever transport brought it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Self, TypeAlias

import numpy as np

from meshnet.errors import InvalidRequest, MeshnetError, hop_error
from meshnet.ids import SessionId
from meshnet.protocol import headers as H
from meshnet.protocol.prefix import MAX_PREFIX_BLOCKS
from meshnet.protocol.wire import TensorFrame, encode_tensor
from meshnet.sampling import Alternatives, Draw

__all__ = [
    "Accepted",
    "AnswerKind",
    "Cached",
    "HopAnswer",
    "HopEntry",
    "HopRequest",
    "Payload",
    "PrefixClaim",
    "PrefixRequest",
    "Replayed",
    "RerouteRequest",
    "Rerouted",
    "RestoreRequest",
    "Restored",
    "Sampled",
    "TokenAnswer",
    "Verb",
    "VerifyAnswer",
    "Voided",
    "answer_from_json",
    "ids_payload",
    "remote_error",
]

_SIGNATURE_CHARS = 128  # an Ed25519 signature in base64url is 86


class Verb(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode-step"
    VERIFY = "verify"


@dataclass(frozen=True, slots=True)
class Payload:
    """What crosses a seam: token ids at the head, activations past it (``frame``, not yet read:
    the receiving shard knows what shape they must have), and beside activations, when the
    model or the session needs them, the chunk's token ids (int32 little-endian, one per position)."""

    frame: TensorFrame
    token_ids: bytes | None = None


def ids_payload(tokens: Sequence[int]) -> Payload:
    """What the head takes: ``tokens`` as a ``[1, n]`` int32 tensor."""
    return Payload(encode_tensor(np.asarray([list(tokens)], dtype=np.int32), "int32"))


@dataclass(frozen=True, slots=True)
class PrefixClaim:
    """A session's prompt as blocks (``protocol.prefix``): ``block`` tokens each, by chained hash.
    Each hop keeps it with the session, and when the session ends puts the KV of those of its
    blocks it computed in canonical chunks into its prefix cache under these hashes."""

    block: int
    hashes: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.block <= 1 << 16 or len(self.hashes) > MAX_PREFIX_BLOCKS:
            raise InvalidRequest(f"{H.PREFIX} names blocks of 1..65536 tokens, at most {MAX_PREFIX_BLOCKS} of them")


@dataclass(frozen=True, slots=True)
class HopRequest:
    """One prefill chunk, decode step or verify chunk for the positions ``start..start + n - 1``."""

    verb: Verb
    session: SessionId
    start: int
    n: int
    payload: Payload
    model: str | None = None
    route_id: str | None = None
    # a session's first request: the hops after the receiver (in order) and the tail's sampling (JSON)
    next_hops: tuple[str, ...] | None = None
    sampling: str | None = None
    chunks: tuple[int, ...] | None = None  # prefill: sizes of its compute calls (None: one call)
    sample: bool = False  # prefill: the last chunk of the prompt, the tail answers a token
    drafts: tuple[int, ...] = ()  # verify: the drafted token ids after the step's own
    replay: int = 0  # route repair: hops (from the receiver on) that rebuild KV and answer no token
    rewind: bool = False  # a repair's resent step: a hop already holding it drops it first
    # pipelined speculation: the step's own token id, itself a draft (the tail keeps the round only if
    # it sampled this token at ``start``; it voids the round otherwise)
    guess: int | None = None
    # in a private swarm, a session's first request: the tracker-signed ticket of its route (protocol.tickets)
    ticket: str | None = None
    prefix: PrefixClaim | None = None  # a session's first request: its prompt's blocks (prefix caching)

    def __post_init__(self) -> None:
        if self.start < 0 or self.n < 1:
            raise InvalidRequest(f"a hop request covers positions from 0 on, at least one; got {self.start}+{self.n}")
        if self.verb is Verb.VERIFY:
            if not self.drafts:
                raise InvalidRequest(f"a verify chunk needs drafted token ids ({H.DRAFT})")
            if self.replay:
                raise InvalidRequest(f"a verify chunk is never replayed: drop {H.REPLAY}")
        elif self.drafts:
            raise InvalidRequest(f"only a verify chunk carries drafted tokens: drop {H.DRAFT}")
        if self.verb is not Verb.PREFILL and self.n != 1 + len(self.drafts):
            raise InvalidRequest(f"a {self.verb} covers its position and its drafts, not {self.n} positions")
        if self.replay < 0:
            raise InvalidRequest(f"header {H.REPLAY} must be the number of hops to rebuild (>= 1)")
        if self.replay and self.sample:
            raise InvalidRequest(f"a replayed chunk answers no token: drop {H.SAMPLE}")
        if self.guess is not None and (self.verb is Verb.PREFILL or self.replay or self.guess < 0):
            raise InvalidRequest(f"{H.GUESS} is a token id on a decode step or verify chunk, never replayed")
        if self.chunks is not None and (self.verb is not Verb.PREFILL or sum(self.chunks) != self.n):
            raise InvalidRequest(f"{H.CHUNKS} must split a prefill chunk's {self.n} positions")

    @property
    def sizes(self) -> tuple[int, ...]:
        """The compute calls that cover the request: a step's positions one by one."""
        if self.verb is not Verb.PREFILL:
            return (1,) * self.n
        return self.chunks or (self.n,)

    @property
    def decode(self) -> bool:
        return self.verb is not Verb.PREFILL

    @property
    def final(self) -> bool:
        """Whether the tail answers a token: every step, and a prompt's last prefill chunk."""
        return self.decode or self.sample

    def onward(self, payload: Payload, next_hops: tuple[str, ...], *, model: str, route_id: str) -> HopRequest:
        """What a hop passes on to the next one: the same request with its own output, one hop
        fewer to replay, and the hops after the next one (on a session's first request). Built
        field by field: ``dataclasses.replace`` costs every decode step's hop tens of microseconds
        when its caches are cold after the compute."""
        onward = next_hops[1:] if self.next_hops is not None or self.verb is Verb.PREFILL else None
        return HopRequest(
            self.verb, self.session, self.start, self.n, payload, model, route_id, onward, self.sampling, self.chunks,
            self.sample, self.drafts, max(self.replay - 1, 0), self.rewind, self.guess, self.ticket, self.prefix,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class PrefixRequest:
    """Open a session whose prompt starts with ``prefix``, reusing at most ``reuse`` of its blocks
    from the hops' prefix caches; the answer (``CACHED``) says how many positions every hop holds.
    It carries what a session's first request carries (route, next hops, sampling, ticket)."""

    session: SessionId
    prefix: PrefixClaim
    reuse: int
    route_id: str
    model: str | None = None
    next_hops: tuple[str, ...] = ()
    sampling: str | None = None
    ticket: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.reuse <= len(self.prefix.hashes):
            most = len(self.prefix.hashes)
            raise InvalidRequest(
                f"header {H.REUSE} must be 0..{most} (blocks of {H.PREFIX} to reuse), got {self.reuse}"
            )

    def onward(self, reuse: int, next_hops: tuple[str, ...], *, model: str) -> PrefixRequest:
        """What a hop passes on: the blocks it adopted as the most the next may reuse."""
        return dataclasses.replace(self, reuse=reuse, next_hops=next_hops[1:], model=model)


@dataclass(frozen=True, slots=True)
class RestoreRequest:
    """Open a session on a route repair's replacement from the KV snapshot it holds as the failed
    hop's standby (``node.snapshots``); the answer (``RESTORED``) says how many positions it holds.
    It carries what a session's first request carries (route, sampling, the repair ticket)."""

    session: SessionId
    route_id: str
    model: str | None = None
    sampling: str | None = None
    ticket: str | None = None


@dataclass(frozen=True, slots=True)
class RerouteRequest:
    """Point a session at new next hops; ``replay`` > 0 rebuilds them from the seam log and resends
    the interrupted step at ``step`` (route repair, docs/protocol.md), or, without ``resend``,
    leaves the step to the gateway."""

    session: SessionId
    next_hops: tuple[str, ...]
    route_id: str | None
    model: str | None = None
    replay: int = 0
    sampling: str | None = None
    step: int | None = None
    ticket: str | None = None  # in a private swarm: the tracker's repair ticket
    # the replacement restored a KV snapshot of this many positions: replay only the positions after it
    replay_from: int = 0
    # False: drop the step's own position too, replay only what came before it and answer ``Replayed``;
    # the gateway resends the step through the whole route (this hop's copy of it may be stale)
    resend: bool = True

    def __post_init__(self) -> None:
        if self.replay_from < 0 or (self.replay_from and self.replay != 1):
            raise InvalidRequest(
                f"header {H.REPLAY_FROM} names the positions one restored hop holds: it needs {H.REPLAY}: 1"
            )
        if not 0 <= self.replay <= len(self.next_hops):
            raise InvalidRequest(
                f"header {H.REPLAY} must be 0..{len(self.next_hops)} (hops to rebuild), got {self.replay!r}"
            )


@dataclass(frozen=True, slots=True)
class HopEntry:
    """One hop's part of an answer: who computed what, how long it took, and its ledger (the
    positions it holds and the digests of what it computed from and sent on, protocol.ledger)."""

    node: str
    layers: str
    compute_ms: float
    held: int
    input_digest: str
    output_digest: str | None = None
    positions: int | None = None
    signature: str | None = None  # the hop's, over the entry (protocol.signing)

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"node": self.node, "layers": self.layers}
        if self.positions is not None:
            entry["positions"] = self.positions
        entry["compute_ms"] = self.compute_ms
        entry["held"] = self.held
        entry["input_digest"] = self.input_digest
        if self.output_digest is not None:
            entry["output_digest"] = self.output_digest
        if self.signature is not None:
            entry["sig"] = self.signature
        return entry

    def signed(self, signature: str) -> HopEntry:
        """This entry with ``signature`` (built directly: ``dataclasses.replace`` costs a decode step's
        hop tens of microseconds when its caches are cold after the compute)."""
        return HopEntry(self.node, self.layers, self.compute_ms, self.held, self.input_digest, self.output_digest,
                        self.positions, signature)  # fmt: skip

    @classmethod
    def from_json(cls, raw: object) -> HopEntry:
        """Raises ``ValueError`` on anything but an entry ``to_json`` could have written."""
        if not isinstance(raw, Mapping):
            raise ValueError("a hop entry is an object")
        node, layers, held = raw.get("node"), raw.get("layers"), raw.get("held")
        digest, out, positions = raw.get("input_digest"), raw.get("output_digest"), raw.get("positions")
        compute, signature = raw.get("compute_ms", 0.0), raw.get("sig")
        if not (isinstance(node, str) and isinstance(layers, str) and isinstance(digest, str)):
            raise ValueError('a hop entry names its "node", "layers" and "input_digest" as strings')
        if not _count(held) or not (positions is None or _count(positions)):
            raise ValueError('a hop entry\'s "held" and "positions" are counts')
        if not (out is None or isinstance(out, str)):
            raise ValueError('a hop entry\'s "output_digest" is a string')
        if not (signature is None or (isinstance(signature, str) and len(signature) <= _SIGNATURE_CHARS)):
            raise ValueError(f'a hop entry\'s "sig" is a string of at most {_SIGNATURE_CHARS} characters')
        if not (isinstance(compute, int | float) and not isinstance(compute, bool) and math.isfinite(compute)):
            raise ValueError('a hop entry\'s "compute_ms" is a finite number')
        return cls(node, layers, float(compute), held, digest, out, positions, signature)  # type: ignore[arg-type]


class AnswerKind(StrEnum):
    ACCEPTED = "accepted"  # a pipelined prefill chunk was computed here and is on its way (202)
    REPLAYED = "replayed"  # a replayed chunk rebuilt KV; no token
    TOKEN = "token"  # the next token
    TOKENS = "tokens"  # a verify chunk: the drafts kept and one token of the tail's own
    REROUTED = "rerouted"  # a reroute without replay
    CACHED = "cached"  # a prefix request: the positions every hop took from its prefix cache
    RESTORED = "restored"  # a restore: the positions a replacement took from a KV snapshot
    VOIDED = "voided"  # a pipelined round (``guess``) the tail dropped: the round before it ended elsewhere


@dataclass(frozen=True, slots=True)
class _Answer:
    """What every answer has: one ``HopEntry`` per hop that computed it, nearest first."""

    hops: tuple[HopEntry, ...]
    kind: ClassVar[AnswerKind]

    @property
    def status(self) -> int:
        return 200

    def after(self, *entries: HopEntry) -> Self:
        """The answer with ``entries`` (hops nearer the sender) before its own."""
        return dataclasses.replace(self, hops=(*entries, *self.hops))

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class _Counted(_Answer):
    """An answer that brings no token, only a count of positions."""

    count: int

    def to_json(self) -> dict[str, Any]:
        return {self.kind.value: self.count, "hops": [h.to_json() for h in self.hops]}


@dataclass(frozen=True, slots=True)
class Accepted(_Counted):
    """A pipelined prefill chunk's positions, computed here and on their way (202)."""

    kind: ClassVar[AnswerKind] = AnswerKind.ACCEPTED

    @property
    def status(self) -> int:
        return 202


@dataclass(frozen=True, slots=True)
class Replayed(_Counted):
    """A replayed chunk's positions: KV rebuilt, no token."""

    kind: ClassVar[AnswerKind] = AnswerKind.REPLAYED


@dataclass(frozen=True, slots=True)
class Cached(_Counted):
    """A prefix request's answer: the positions every hop took from its prefix cache."""

    kind: ClassVar[AnswerKind] = AnswerKind.CACHED


@dataclass(frozen=True, slots=True)
class Restored(_Counted):
    """A restore's answer: the positions a replacement took from a KV snapshot."""

    kind: ClassVar[AnswerKind] = AnswerKind.RESTORED


@dataclass(frozen=True, slots=True)
class Voided(_Counted):
    """A pipelined round the tail did not compute: its guessed token is not the one the tail sampled
    there (or the round before it was cut short). ``count``: the positions the tail holds."""

    kind: ClassVar[AnswerKind] = AnswerKind.VOIDED


@dataclass(frozen=True, slots=True)
class Rerouted(_Answer):
    """A reroute without replay: the session, now pointed at ``next_hops``, at ``position``."""

    position: int
    session: SessionId
    next_hops: tuple[str, ...]
    kind: ClassVar[AnswerKind] = AnswerKind.REROUTED

    def to_json(self) -> dict[str, Any]:
        return {
            "rerouted": self.session,
            "position": self.position,
            "next_hops": list(self.next_hops),
            "hops": [h.to_json() for h in self.hops],
        }


@dataclass(frozen=True, slots=True)
class TokenAnswer(_Answer):
    """The next token, at ``position - 1``, with its logprob, the most likely alternatives (when
    asked) and the distribution the tail drew it from (``sampling.Draw``, when it commits to one)."""

    position: int  # the position after the token
    token: int
    logprob: float
    top: Alternatives | None = None
    draw: Draw | None = None
    kind: ClassVar[AnswerKind] = AnswerKind.TOKEN

    def to_json(self) -> dict[str, Any]:
        top = {"top": _pairs(self.top)} if self.top is not None else {}
        draw = {"draw": self.draw.to_json()} if self.draw is not None else {}
        return {"token": self.token, "logprob": self.logprob, **top, **draw, "position": self.position,
                "hops": [h.to_json() for h in self.hops]}  # fmt: skip


@dataclass(frozen=True, slots=True)
class VerifyAnswer(_Answer):
    """A verify chunk's answer: the ``accepted`` of its ``drafted`` tokens kept and one token of the
    tail's own, each with its logprob (and, when asked, the most likely alternatives)."""

    position: int  # the position after the last token
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    tops: tuple[Alternatives, ...] | None = None
    drafted: int = 0
    accepted: int = 0  # the drafts kept
    kind: ClassVar[AnswerKind] = AnswerKind.TOKENS

    def to_json(self) -> dict[str, Any]:
        tops = {"tops": [_pairs(t) for t in self.tops]} if self.tops is not None else {}
        return {
            "tokens": list(self.tokens),
            "logprobs": list(self.logprobs),
            **tops,
            "position": self.position,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "hops": [h.to_json() for h in self.hops],
        }


HopAnswer: TypeAlias = Accepted | Replayed | Cached | Restored | Voided | Rerouted | TokenAnswer | VerifyAnswer
Sampled: TypeAlias = TokenAnswer | VerifyAnswer  # the answers that bring tokens


def answer_from_json(status: int, raw: object) -> HopAnswer:
    """The answer ``to_json`` wrote, sent with HTTP ``status``. Raises ``ValueError`` on anything
    else. Token ids and logprobs are checked for their types here; their range is the gateway's
    to check."""
    if not isinstance(raw, Mapping):
        raise ValueError("a hop answer is a JSON object")
    hops = raw.get("hops")
    if not isinstance(hops, list):
        raise ValueError('a hop answer lists its "hops"')
    entries = tuple(HopEntry.from_json(h) for h in hops)
    if status == 202:
        return Accepted(entries, count=_need_count(raw, "accepted"))
    if "replayed" in raw:
        return Replayed(entries, count=_need_count(raw, "replayed"))
    if "cached" in raw:
        return Cached(entries, count=_need_count(raw, "cached"))
    if "restored" in raw:
        return Restored(entries, count=_need_count(raw, "restored"))
    if "voided" in raw:
        return Voided(entries, count=_need_count(raw, "voided"))
    position = _need_count(raw, "position")
    if "rerouted" in raw:
        nxt = raw.get("next_hops")
        if (
            not isinstance(raw["rerouted"], str)
            or not isinstance(nxt, list)
            or not all(isinstance(h, str) for h in nxt)
        ):
            raise ValueError('a reroute answer names the session and its "next_hops"')
        return Rerouted(entries, position=position, session=SessionId(raw["rerouted"]), next_hops=tuple(nxt))
    if "tokens" in raw:
        tokens, logprobs = raw.get("tokens"), raw.get("logprobs")
        if not isinstance(tokens, list) or not all(_integer(t) for t in tokens) or not tokens:
            raise ValueError('a verify answer lists its "tokens"')
        if not isinstance(logprobs, list) or len(logprobs) != len(tokens) or not all(map(_number, logprobs)):
            raise ValueError('a verify answer has one logprob per token ("logprobs")')
        tops = raw.get("tops")
        if tops is not None and (not isinstance(tops, list) or len(tops) != len(tokens)):
            raise ValueError('a verify answer\'s "tops" has one list per token')
        return VerifyAnswer(
            entries, position=position, tokens=tuple(tokens), logprobs=tuple(map(float, logprobs)),
            tops=None if tops is None else tuple(_alternatives(t) for t in tops),
            drafted=_need_count(raw, "drafted"), accepted=_need_count(raw, "accepted"),
        )  # fmt: skip
    token, logprob = raw.get("token"), raw.get("logprob")
    if not _integer(token) or not _number(logprob):
        raise ValueError('a hop answer carries "token" (an integer) and "logprob" (a number)')
    top, draw = raw.get("top"), raw.get("draw")
    return TokenAnswer(entries, position=position, token=int(token), logprob=float(logprob),  # type: ignore[arg-type]
                       top=None if top is None else _alternatives(top),
                       draw=None if draw is None else Draw.from_json(draw))  # fmt: skip


def remote_error(error: MeshnetError, *, sender: str, sender_is_head: bool) -> MeshnetError:
    """What an error answer from the hop at ``sender`` means to whoever sent it the request: the
    one error map of every transport (``errors.hop_error``)."""
    message = f"next hop {sender} answered {error.status}: {error.message}"
    return hop_error(message, status=error.status, failed_hop=error.failed_hop, sender=sender,
                     sender_is_head=sender_is_head, code=error.code)  # fmt: skip


def _count(value: object) -> bool:
    return _integer(value) and int(value) >= 0  # type: ignore[call-overload]


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _need_count(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key)
    if not _count(value):
        raise ValueError(f'a hop answer\'s "{key}" is a count')
    return int(value)  # type: ignore[arg-type]


def _alternatives(raw: object) -> Alternatives:
    if not isinstance(raw, list):
        raise ValueError("alternatives are a list of [token, logprob] pairs")
    pairs = []
    for pair in raw:
        if not (isinstance(pair, Sequence) and len(pair) == 2 and _integer(pair[0]) and _number(pair[1])):
            raise ValueError("alternatives are a list of [token, logprob] pairs")
        pairs.append((int(pair[0]), float(pair[1])))
    return tuple(pairs)


def _pairs(alternatives: Alternatives) -> list[list[int | float]]:
    return [[token, logprob] for token, logprob in alternatives]
