"""A ``TextEngine`` that generates over a route of shard nodes instead of a local model.

The gateway keeps the tokenizer; the tracker pins a route per generation; the head node gets
token ids and every later hop gets only activations. Prefill goes chunk by chunk — a node answers
a non-final chunk as soon as it has computed it and queued the forward, so the head works on
chunk k+1 while the next hop works on chunk k — and the tail answers the last chunk and each
decode step with the sampled token. Only a one-token step crosses each seam in decode.

Failures (docs/tracker.md, "Failure handling"): every hop answer that names a failed hop
(``failed_hop``) is recovered from, at most ``max_retries`` times per generation —

- during prefill: the failed node is reported, a fresh route without it is pinned, and prefill
  starts again from scratch (``RouteChange`` kind ``reroute``);
- during decode: **route repair** — the tracker picks numerically equivalent replacement hops for
  the failed segment, the node upstream of it replays its seam log (the activations it already
  sent) into them in the chunks they were first computed in, the interrupted step is resent, and
  generation continues with the same session and the same tokens (kind ``repair``). When the head
  itself failed, the gateway is the upstream and replays the token ids. A repair that cannot work
  (no seam log, a backend that cannot rewind) falls back to a fresh route like the old one,
  prefilled with everything so far in its original chunks.

Speculative decoding (``speculative="ngram"``, gateway.speculative): when the text so far repeats,
a step carries drafted tokens as one verify chunk (``POST .../verify``) and its answer brings back
every draft the tail kept plus one token of its own; every hop has already dropped the rejected
positions. A verify chunk that fails is repaired like the plain step it started with: every hop
drops the drafts and the step is resent without them.

Decode channel (``decode_channel=True``, protocol.channel_client): decode steps go to the head as frames
on a kept-open WebSocket, pass every hop without waiting, and the tail's answer comes straight
back; a route with a node that takes no channel gets HTTP steps. Failures name the hop as over
HTTP, so repair is the same.

Every answer is checked before its token goes out (``protocol.ledger.verify_hops``): each hop must
hold the positions the gateway sent and have computed them from what the hop before it sent —
from the gateway's own token ids, in the gateway's chunks, at the head — and every entry must be
signed by its own hop's key as the tracker pinned it, the tail's over its token too
(``protocol.signing``: no hop answers for another). A route that disagrees ends the generation
with ``RouteInconsistent`` instead of streaming text from it.

Every call is bounded in time, so a dead hop ends in a retry or a stated failure, never a hang.

Concurrency: the engine is async and runs on the gateway's event loop, every generation a task of
its own (``generate``; its steps go to the caller's ``emit``). It reaches the hops through one
``protocol.hops.HopTransport`` — the nodes' own hop client: HTTP over one kept-alive connection pool
with decode-channel steps, or the in-process ``LocalTransport`` the route-engine tests drive a swarm
of real node services with — and the tracker through one ``httpx.AsyncClient``. Only a draft
model's drafting and the billing outbox's spooling leave the loop, for a thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import ssl
import time
from collections.abc import Generator, Sequence
from typing import Any, Protocol

import httpx
import numpy as np

from meshnet.backends.base import Emit, ModelInfo, PrefillProgress, RouteChange, Stop, TokenStep
from meshnet.backends.grammar import TokenGrammar
from meshnet.errors import (
    REQUEST_CODES,
    BadGateway,
    ContextOverflow,
    EngineError,
    HopFailed,
    HopFull,
    InvalidRequest,
    MeshnetError,
    Overloaded,
    RouteInconsistent,
)
from meshnet.gateway.audits import AuditJob, Audits, collect
from meshnet.gateway.billing_outbox import BillingOutbox, Usage
from meshnet.gateway.speculative import (
    SPECULATIVE_MODES,
    DraftCost,
    Drafter,
    DraftSource,
    ModelDraft,
    PromptLookup,
    WalkCosts,
)
from meshnet.httputil import CLIENT_KEEP_ALIVE_S, error_field, error_message
from meshnet.ids import RouteId, SessionId
from meshnet.layers import LayerRange
from meshnet.protocol.channel_client import Channels, StepSlot
from meshnet.protocol.closer import SessionCloser
from meshnet.protocol.hops import HopTransport, HttpTransport, Sendable, acknowledged
from meshnet.protocol.ledger import ChunkLedger, pack_chunks, verify_hops
from meshnet.protocol.messages import (
    Cached,
    HopAnswer,
    HopEntry,
    HopRequest,
    PrefixClaim,
    PrefixRequest,
    Replayed,
    RerouteRequest,
    Restored,
    RestoreRequest,
    Sampled,
    TokenAnswer,
    Verb,
    VerifyAnswer,
    ids_payload,
)
from meshnet.protocol.prefix import block_hashes
from meshnet.protocol.signing import CLAIMED_KINDS, check_signatures, claim_of
from meshnet.routes import Hop, RoutePlan, hop_timeout_s
from meshnet.sampling import Alternatives, Sampler, SamplingParams, check_draw

__all__ = ["RouteEngine", "Tokenizer"]

_log = logging.getLogger("meshnet.gateway")
_ROUTES_COSTED = 256  # routes whose walk times the drafter remembers
# A context shorter than this is not snapshotted: replaying it costs less than moving its KV; after
# the first snapshot (right after the prompt's prefill), a fresh one every SNAPSHOT_EVERY positions.
SNAPSHOT_MIN_POSITIONS = 256
SNAPSHOT_EVERY = 1024
# How long a finished generation waits for its route to free the session (and keep its prompt
# blocks) before the stream ends: milliseconds on a healthy route.
CLOSE_WAIT_S = 2.0
# A hop without room for a session (HopFull) before its first token: wait for room this long in all,
# in waits doubling from the first, each at most the step.
ROOM_WAIT_S = 60.0
ROOM_WAIT_FIRST_S = 0.25
ROOM_WAIT_MAX_STEP_S = 4.0
# Pipelined speculation: verify rounds in flight at most, each sent before the verdict on the one
# before it while the measured acceptance makes that pay (WalkCosts.chain_pays)
PIPELINE_ROUNDS = 4
# leaves to relay the tail left unused in a row before a generation pauses giving them (an older tail
# that takes no CREDIT, one that cannot reach the head, a leave that came after its step on a loaded
# machine: each miss costs a frame each way, nothing more); the pause is this many tokens, doubled at
# each pause after it, so a tail that relays again soon gets leaves again
_UNUSED_LEAVES = 3
_LEAVE_PAUSE_TOKENS = 8
AUDIT_MAX_POSITIONS = 16384  # a longer session is not audited: every hop's seam log would cross the network
_LOGPROB_SLACK = 1e-3  # a logprob is <= 0; float32 rounding may put the top one a hair above


class Tokenizer(Protocol):
    info: ModelInfo

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def is_end_of_generation(self, token: int) -> bool: ...

    def grammar(self, text: str, *, param: str = "grammar") -> TokenGrammar: ...


@dataclasses.dataclass(slots=True)
class _Round:
    """A decode step or verify round in flight on the decode channel: ``chunk`` at ``start``. A
    pipelined round (``guess``) was sent before the verdict on the one before it, so its first token
    is a draft too."""

    start: int
    chunk: list[int]
    guess: bool
    task: asyncio.Future[HopAnswer]
    sent: float  # when (time.monotonic)
    alone: bool  # nothing was in flight before it: its walk time is the route's (WalkCosts)
    ahead: bool = False  # sent before the answer it continues was checked, with that answer's token (_step_ahead)
    seq: int | None = None  # its decode-channel step number, when the gateway knows it (a credit can follow it)

    @property
    def end(self) -> int:
        return self.start + len(self.chunk)


@dataclasses.dataclass
class _Run:
    """One generation's mutable route state: the current plan, what each node computed, retries,
    and the chunks its positions were computed in (``ledger``: the head's inputs, as the gateway
    sent them — every hop's ledger must agree with it, protocol.ledger)."""

    plan: RoutePlan
    params: SamplingParams  # the tail samples with them; the gateway re-derives its draws (sampling.check_draw)
    usage: Usage
    ledger: ChunkLedger
    grammar: bool = False  # the tail samples under a grammar: a hop's grammar_too_costly is the request's 400
    retries: int = 0
    failed_nodes: set[str] = dataclasses.field(default_factory=set)
    streamed: bool = False  # a token went out: any new route must compute exactly what this one did
    # a verify chunk over the decode channel left rejected drafts on the hops before the tail: the
    # next step tells them to drop them (X-Meshnet-Rewind)
    surplus: bool = False
    # the token id of every position sent, those a rewind dropped cut off at the next chunk (so a
    # last verify chunk's rejected drafts are still there: an audit re-executes them on those hops)
    ids: list[int] = dataclasses.field(default_factory=list)
    prefix: PrefixClaim | None = None  # the prompt's blocks, for the hops' prefix caches
    cached: int = 0  # prompt positions the route took from its prefix caches (not computed)
    cold: bool = False  # reuse was refused once (the cached KV did not match the prompt): prefill everything
    room_since: float | None = None  # when a hop first had no room for the session (HopFull): the wait began
    room_waits: int = 0
    # KV snapshots (node.snapshots): hop node id -> (its standby's node id, the positions snapshotted)
    standbys: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    snapshot_at: int = 0  # the positions the hops' latest snapshots hold (0: none taken)
    # Audit sampling (gateway.audits): the generation was picked; the tail's signed answers by the
    # position of each token they re-derive (_keep_answer), on the session they came from (a fresh
    # route starts over)
    audited: bool = False
    answers: dict[int, tuple[HopEntry, dict[str, Any]]] = dataclasses.field(default_factory=dict)
    answers_of: str = ""
    emit: Emit = dataclasses.field(default=None, repr=False)  # type: ignore[assignment]  # set by generate
    # decode-channel rounds in flight, oldest first (pipelined speculation keeps several)
    rounds: collections.deque[_Round] = dataclasses.field(default_factory=collections.deque)
    answered_at: float = 0.0  # when the newest round's answer came
    pipelined: bool = False  # a round went before the verdict on the one before it (a repair resends the step)
    void: list[asyncio.Future[HopAnswer]] = dataclasses.field(default_factory=list)  # voided rounds still out
    budget: int = 0  # the most tokens the consumer takes (the plan's max_tokens; 0: not said)
    generated: int = 0  # tokens handed to the consumer
    # the tail's leave to relay the step after the round in flight (_grant): its slot, and that round's seq
    credit: tuple[StepSlot, int] | None = None
    unused: int = 0  # leaves in a row the tail did not use (it takes no CREDIT, or cannot reach the head)
    pauses: int = 0  # times leaves were paused since the tail last used one (_leave_unused)
    leave_at: int = 0  # no leave until the consumer has taken this many tokens (generated)

    @functools.cached_property
    def sampling(self) -> str:
        """``params`` as the route's first request carries them (``X-Meshnet-Sampling``)."""
        return json.dumps(dataclasses.asdict(self.params))

    def add(self, tokens: Sequence[int]) -> None:
        """``tokens`` become the route's next chunk (a prompt chunk, or one decode step)."""
        del self.ids[self.ledger.position :]  # positions a rewind dropped
        self.ledger.record(len(tokens), np.asarray(tokens, dtype="<i4").tobytes())
        self.ids.extend(tokens)


class RouteEngine:
    """The gateway's ``AsyncTextEngine`` over a swarm (module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        tracker_url: str,
        *,
        n_ctx: int,
        max_concurrency: int = 4,
        prefill_chunk: int = 128,
        prefix_cache: bool = True,
        kv_snapshots: bool = True,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        outbox: BillingOutbox | None = None,
        speculative: str = "ngram",
        draft_tokens: int = 12,
        draft_min: int = 0,
        pipeline_rounds: int = PIPELINE_ROUNDS,
        draft_model: DraftSource | None = None,
        decode_channel: bool = True,
        relay: bool = True,
        client_tls: ssl.SSLContext | None = None,
        trusted_only: bool = False,
        room_wait_s: float = ROOM_WAIT_S,
        audits: Audits | None = None,
        hops: HopTransport | None = None,
        tracker: httpx.AsyncClient | None = None,
    ) -> None:
        """``hops``: how the engine reaches the hops (default: HTTP with decode-channel steps when
        ``decode_channel``, member TLS ``client_tls``); ``tracker``: its client for ``tracker_url``
        (default: its own). Both are made on first use, on the loop that runs the engine."""
        if speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {speculative!r}")
        if (speculative == "draft") != (draft_model is not None):
            raise ValueError("speculative='draft' drafts with a draft model, and only it does")
        self.draft_model = draft_model
        self._draft_cost = DraftCost()  # what the draft model's drafts cost, shared by every generation
        if draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
        if not 0 <= draft_min <= draft_tokens:
            raise ValueError(f"draft_min must be within 0..draft_tokens ({draft_tokens}), got {draft_min}")
        if pipeline_rounds < 1:
            raise ValueError(f"pipeline_rounds must be >= 1, got {pipeline_rounds}")
        self.speculative = speculative
        self.draft_tokens = draft_tokens
        self.draft_min = draft_min  # drafts every step sends when it has them, paying or not
        self.pipeline_rounds = pipeline_rounds  # speculation rounds in flight at most (1: one at a time)
        self._costs: dict[tuple[str, ...], WalkCosts] = {}  # per route (its nodes): walk seconds by size
        self.tokenizer = tokenizer
        self.info = tokenizer.info
        self.tracker_url = tracker_url.rstrip("/")
        self.n_ctx = n_ctx
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = prefix_cache  # reuse (and leave) prompt blocks in the hops' prefix caches
        self.kv_snapshots = kv_snapshots  # hops snapshot their KV to standbys after a long prompt's prefill
        self.max_retries = max_retries
        self.timeout_s = timeout_s  # the innermost hop's wait for its next hop; outer waits nest above it
        self._timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.client_tls = client_tls  # a private swarm's member TLS, for every outgoing connection
        self.trusted_only = trusted_only  # every route (and the tracker's repairs of it) on trusted nodes only
        self.outbox = outbox if outbox is not None else BillingOutbox(self.tracker_url, tls=client_tls)
        self.decode_channel = decode_channel
        self.relay = relay  # the tail sends a plain step's next step to the head itself (_grant)
        self._stop_ids: asyncio.Future[frozenset[int]] | None = None  # the tokens a generation ends with (_find_stops)
        self._hops_client, self._tracker_client = hops, tracker
        self.closer = SessionCloser()  # every close retried until acknowledged
        self.room_wait_s = room_wait_s  # how long a generation waits for a hop with room (HopFull)
        self.audits = audits  # audit sampling (--audit-rate); None: no audits

    # -- tokenizer ---------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.token_bytes(token)

    def is_end_of_generation(self, token: int) -> bool:
        return self.tokenizer.is_end_of_generation(token)

    def grammar(self, text: str, *, param: str = "grammar") -> TokenGrammar:
        """Compiled here to refuse a bad grammar before any route work; the tail compiles its own and samples."""
        return self.tokenizer.grammar(text, param=param)

    # -- routes ------------------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            timeout=self._timeout,
            limits=httpx.Limits(keepalive_expiry=CLIENT_KEEP_ALIVE_S),
            verify=self.client_tls or True,
        )

    @property
    def hops(self) -> HopTransport:
        if self._hops_client is None:
            channels = Channels(self.client_tls) if self.decode_channel else None
            self._hops_client = HttpTransport(self._http(), channels)
        return self._hops_client

    async def _tracker(self, method: str, path: str, *, timeout_s: float = 30.0, **kwargs: Any) -> httpx.Response:
        if self._tracker_client is None:
            self._tracker_client = self._http()
        try:
            return await self._tracker_client.request(method, f"{self.tracker_url}{path}", timeout=timeout_s,
                                                      **kwargs)  # fmt: skip
        except httpx.HTTPError as exc:
            raise Overloaded(f"the tracker at {self.tracker_url} is unreachable: {exc}", retry_after_s=5) from None

    async def plan(
        self,
        *,
        exclude: Sequence[str] = (),
        prompt_tokens: int = 0,
        max_tokens: int = 0,
        like_session: SessionId | None = None,
        trusted_only: bool = False,
        prompt: Sequence[int] = (),
        namespace: bytes = b"",
    ) -> RoutePlan:
        """Pin a fresh route; ``like_session``: only one that computes bit-identically to that session's;
        ``trusted_only`` (or the gateway's ``--trusted-only``): over trusted nodes only; ``prompt``:
        its blocks let the tracker prefer a route whose prefix caches hold them, hashed in ``namespace``
        (the API key's: protocol.prefix), which the generation on the route hashes its blocks in too."""
        trusted_only = trusted_only or self.trusted_only
        body: dict[str, Any] = {"model": self.info.model_id, "total_layers": self.info.n_layers}
        body["gateway_key"] = self.outbox.key.public  # pinned: the session's billing is countersigned with it
        hashes = block_hashes(prompt, self.prefill_chunk, namespace=namespace) if self.prefix_cache else []
        if hashes:
            body["prefix"] = {"block": self.prefill_chunk, "hashes": [h.hex() for h in hashes]}
        if exclude:
            body["exclude"] = list(exclude)
        if like_session is not None:
            body["like_session"] = like_session
        if trusted_only:
            body["trusted_only"] = True
        if prompt_tokens:
            body["prefill_tokens"] = prompt_tokens
        if max_tokens:
            body["max_tokens"] = max_tokens
        response = await self._tracker("POST", "/v1/sessions", json=body)
        if response.status_code == 503:
            raise Overloaded(f"no route: {error_message(response)}", retry_after_s=5)
        if response.status_code == 400 and error_field(response, "code") == ContextOverflow.code:
            raise ContextOverflow(error_message(response), param="max_tokens")  # past the model's or product's cap
        if response.status_code >= 400:
            raise EngineError(f"the tracker refused a route: {error_message(response)}")
        data = response.json()
        ticket, cached = data.get("ticket"), data.get("cached_tokens")
        return RoutePlan(SessionId(data["session_id"]), RouteId(data["route_id"]), self._hops(data["hops"]),
                         ticket=ticket if isinstance(ticket, str) else None, trusted_only=trusted_only,
                         cached_tokens=cached if isinstance(cached, int) and cached > 0 else 0,
                         prefix_namespace=namespace, max_tokens=max_tokens)  # fmt: skip

    def _hops(self, hops: Sequence[dict[str, Any]]) -> tuple[Hop, ...]:
        total = self.info.n_layers
        return tuple(
            Hop(
                h["node_id"],
                h["url"],
                LayerRange.parse(h["layers"], total),
                int(h.get("max_verify") or 0),
                identity=_text_or_none(h.get("identity")),
                quantization=_text_or_none(h.get("quantization")),
                max_positions=int(h.get("max_positions") or 0),
                key=_text_or_none(h.get("hop_key")),
            )
            for h in hops
        )

    def _context(self, plan: RoutePlan) -> int:
        """Positions this generation may reach: the gateway's cap, or the route's smaller one."""
        return min(self.n_ctx, plan.max_positions) if plan.max_positions else self.n_ctx

    async def release(self, plan: RoutePlan) -> None:
        """Free the session on the tracker: retried until it is acknowledged (protocol.closer)."""
        path = f"/v1/sessions/{plan.session_id}"

        async def attempt() -> bool | None:
            try:
                return acknowledged((await self._tracker("DELETE", path, timeout_s=CLOSE_WAIT_S)).status_code)
            except Overloaded:  # unreachable now
                return False

        await self.closer.close(attempt, f"{self.tracker_url}{path}", timeout_s=CLOSE_WAIT_S)

    # -- generation --------------------------------------------------------------------------
    async def generate(
        self, prompt: Sequence[int], sampler: Sampler, cancel: asyncio.Event, plan: RoutePlan | None, emit: Emit
    ) -> None:
        """Generate on ``plan``'s route, every step to ``emit``, until the text or the context ends,
        ``cancel`` is set or ``emit`` raises ``Stop``; the route is closed and billed either way."""
        if plan is None:
            raise InvalidRequest("a route engine generates only on a planned route")
        if not prompt:
            raise InvalidRequest("the prompt is empty after tokenization")
        run = self._new_run(plan, sampler, emit)
        tokens = list(prompt)  # everything the route has seen, for a fresh re-prefill
        hashes = block_hashes(tokens, self.prefill_chunk, namespace=plan.prefix_namespace) if self.prefix_cache else []
        run.prefix = PrefixClaim(self.prefill_chunk, tuple(hashes)) if hashes else None
        for begin in range(0, len(tokens), self.prefill_chunk):
            run.add(tokens[begin : begin + self.prefill_chunk])
        drafter = self._drafter(plan)
        if drafter is not None:
            drafter.extend(tokens)
        outcome = "failed"
        try:
            answer = await self._prefill_with_retries(run, tokens, cancel)
            while answer is not None and not cancel.is_set():
                steps = _tokens_of(answer)
                drafted, accepted = (answer.drafted, answer.accepted) if isinstance(answer, VerifyAnswer) else (0, 0)
                if drafter is not None and drafted:
                    drafter.record(drafted, accepted)
                run.streamed = True
                full = False
                for i, (token, logprob, top) in enumerate(steps):
                    first = i == 0
                    hop_ms = _hop_ms(answer) if first else ()
                    run.generated += 1
                    await run.emit(TokenStep(token, logprob, hop_ms, drafted * first, accepted * first, top))
                    if len(tokens) + 1 > self._context(run.plan):
                        full = True
                        break
                    tokens.append(token)
                    if drafter is not None and drafter.seen < len(tokens):  # (a step ahead told it already)
                        drafter.extend(tokens[drafter.seen :])
                if full:
                    break
                await self._taken(run, len(tokens) - 1, drafter)
                answer = await self._next_answer(run, tokens, drafter, cancel)
            outcome = "completed"
        except Stop:
            outcome = "completed"  # the consumer stopped: a stop sequence, max_tokens or a disconnect
        except RouteInconsistent:
            run.usage.void()  # a forged answer: which relaying hop forged it is unknown, so none is paid
            raise
        finally:
            await self._drain(run)  # rounds still in flight end first: the route frees the session at once
            await self._finish(run, outcome)

    def _new_run(self, plan: RoutePlan, sampler: Sampler, emit: Emit) -> _Run:
        """A generation's state on ``plan``; audited when the audit sampling picks it. A generation
        that may relay starts finding the end-of-generation ids beside its prefill (``_find_stops``)."""
        audited = self.audits is not None and self.audits.chosen()
        if self.relay and self.decode_channel:
            self._find_stops()
        return _Run(plan, sampler.params, Usage(), ChunkLedger(sends=False), grammar=bool(sampler.params.grammar),
                    budget=plan.max_tokens, audited=audited, emit=emit)  # fmt: skip

    async def _finish(self, run: _Run, outcome: str) -> None:
        """A generation ended: take what its audit needs (if it is audited) while its route still
        holds the session, close the route, bill it, then audit it. The hops' latest entries are
        checked first (their signatures: ``Usage.check_receipts``); one that is not its hop's voids
        the session's pay."""
        forged = run.usage.check_receipts()
        if forged:
            _log.warning("session %s: the latest entries of %s do not carry their own signatures (another hop made "
                        "them up or changed them): no node of the session is paid", run.plan.session_id,
                        ", ".join(forged))  # fmt: skip
        job = await self._audit_job(run) if run.audited and outcome == "completed" else None
        await self._close(run.plan)
        await asyncio.to_thread(self.outbox.submit, run.plan, run.usage, outcome)  # it spools to disk
        if self.audits is not None and run.audited:
            self.audits.submit(job)

    async def _audit_job(self, run: _Run) -> AuditJob | None:
        """What auditing this generation needs, taken from its route before it closes (gateway.audits)."""
        held = run.ledger.position
        if held > AUDIT_MAX_POSITIONS:
            return None  # its seam logs would be too much to move for an audit
        plan = run.plan
        answers = run.answers if run.answers_of == plan.session_id else {}
        receipts = {node: entry for node, (entry, _) in run.usage.receipts.items()}
        signed = {node: r for node in receipts if (r := run.usage.receipt(node)) is not None}
        return await collect(
            self.hops, session=plan.session_id, model=self.info.model_id, hops=plan.hops, chunks=run.ledger.sizes(),
            tokens=run.ids[:held], sampling=dataclasses.asdict(run.params), receipts=receipts, signed=signed,
            answers=answers, rejected=run.ids[held:] if run.surplus else (), timeout_s=CLOSE_WAIT_S * 5,
        )  # fmt: skip

    async def _prefill_with_retries(self, run: _Run, tokens: list[int], cancel: asyncio.Event) -> Sampled | None:
        """Prefill ``tokens``; a failed hop means a fresh route without it, from scratch; a hop without
        room for the session means waiting for room, on a route around it if there is one (``_wait``)."""
        while True:
            try:
                answer = await self._prefill(run, tokens, cancel)
            except HopFull as exc:
                if not (await self._wait(run, tokens, exc, cancel)):
                    return None
                continue
            except (HopFailed, InvalidRequest) as raised:
                failure = _hop_failure(run, raised)
                began = time.monotonic()
                failed = self._failed_hop(run, failure)
                await self._report_failure(run.plan, failed, failure.message)
                await self._fresh_route(run, tokens)
                change = RouteChange("reroute", failure.message, failed.node, run.plan, run.retries, 0, _since(began))
                await run.emit(change)
                continue
            if answer is not None:
                _verified(run, answer)
                run.usage.add(run.plan.hops, prefill=len(tokens) - run.cached)
            return answer

    async def _wait(self, run: _Run, tokens: list[int], full: HopFull, cancel: asyncio.Event) -> bool:
        """A hop had no room to open the session (its sessions taken: by zombies, by another member's
        parked sessions, or by this gateway's own; or this gateway's quota there spent). Nothing
        failed, so nothing is reported: free what the attempt opened, wait a while (doubling from
        ``ROOM_WAIT_FIRST_S``; the telemetry says so), then plan again, around that hop if the
        tracker can. After ``ROOM_WAIT_S`` the generation is refused with a 503 and ``Retry-After``,
        never a 502. False: the client left meanwhile."""
        now = time.monotonic()
        if run.room_since is None:
            run.room_since = now
        waited = now - run.room_since
        if waited >= self.room_wait_s:
            raise Overloaded(f"{full.message}; no room on a route after waiting {waited:.0f} s: retry later",
                             retry_after_s=5)  # fmt: skip
        run.room_waits += 1
        delay = min(ROOM_WAIT_MAX_STEP_S, ROOM_WAIT_FIRST_S * 2 ** (run.room_waits - 1), self.room_wait_s - waited)
        hop = next((h for h in run.plan.hops if h.url == full.failed_hop), None)
        node = hop.node if hop is not None else str(full.failed_hop)
        await self._close(run.plan)
        reason = f"{full.message}; waiting {delay:.2f} s for room"
        await run.emit(RouteChange("wait", reason, node, run.plan, run.retries, 0, 0.0))
        try:
            await asyncio.wait_for(cancel.wait(), delay)
            return False
        except TimeoutError:
            pass
        like = run.plan.session_id if run.streamed else None
        ask: dict[str, Any] = {
            "prompt_tokens": len(tokens), "like_session": like, "trusted_only": run.plan.trusted_only,
            "prompt": tokens if run.prefix is not None else (), "namespace": run.plan.prefix_namespace,
        }  # fmt: skip
        try:  # around the full hop if the swarm has another for its layers
            run.plan = await self.plan(exclude=sorted(run.failed_nodes | {node}), **ask)
        except (Overloaded, EngineError):  # it has not: wait for that one
            run.plan = await self.plan(exclude=sorted(run.failed_nodes), **ask)
        run.usage, run.cached = Usage(), 0
        run.standbys, run.snapshot_at = {}, 0
        # the new session: the telemetry moves to it (a wait on the old one only said "waiting")
        moved = RouteChange("wait", f"{full.message}; waited for room", node, run.plan, run.retries, 0, _since(now))
        await run.emit(moved)
        return True

    def _drafter(self, plan: RoutePlan) -> Drafter | None:
        """This generation's drafter (``--speculative``), sharing the route's measured walk costs."""
        if self.speculative == "ngram":
            return PromptLookup(self.draft_tokens, self._walk_costs(plan), minimum=self.draft_min)
        if self.draft_model is not None:
            model, costs = self.draft_model, self._walk_costs(plan)
            return ModelDraft(model, self.draft_tokens, costs, minimum=self.draft_min, spent=self._draft_cost)
        return None

    def _walk_costs(self, plan: RoutePlan) -> WalkCosts:
        """The measured walk times of ``plan``'s route (the most recently used routes are kept)."""
        key = tuple(h.node for h in plan.hops)
        costs = self._costs.pop(key, None) or WalkCosts()
        self._costs[key] = costs  # most recent last
        while len(self._costs) > _ROUTES_COSTED:
            del self._costs[next(iter(self._costs))]
        return costs

    async def _drafts(self, drafter: Drafter | None, plan: RoutePlan, length: int) -> list[int]:
        """Tokens to verify after ``length`` tokens: within every hop's limit and the context."""
        if drafter is None:
            return []
        drafter.costs = self._walk_costs(plan)  # a repaired route has costs of its own
        limit = self._draft_limit(plan, length)
        if limit <= 0:
            return []
        if isinstance(drafter, ModelDraft):  # a model computes the drafts: off the loop
            return await asyncio.to_thread(drafter.propose, limit)
        return drafter.propose(limit)

    async def _next_answer(
        self, run: _Run, tokens: list[int], drafter: Drafter | None, cancel: asyncio.Event
    ) -> Sampled | None:
        """The answer to the step for ``tokens[-1]`` at position ``len(tokens) - 1`` (with drafts after
        it), repairing the route if a hop fails. Over the decode channel the step may already be in
        flight as a pipelined round, and more rounds are sent after it while they pay (``_chain``)."""
        try:
            if not run.rounds:
                drafts = await self._drafts(drafter, run.plan, len(tokens))
                if not await self._start_round(run, len(tokens) - 1, [tokens[-1], *drafts], guess=False):
                    return await self._http_step(run, tokens, drafts, cancel)  # a hop takes no channel
            if drafter is not None:
                await self._chain(run, tokens, drafter)
            return await self._take_round(run, drafter)
        except (HopFailed, InvalidRequest) as raised:
            failure = _hop_failure(run, raised)
            await self._drain(run)  # every hop has handled what it got before the repair talks to it
            run.ledger.rewind(len(tokens))  # the repair resends the step without its drafts
            if drafter is not None:
                drafter.forget(len(tokens))  # a step ahead told it a token the repair may not give
            return await self._recover(run, tokens, failure, cancel)

    async def _start_round(self, run: _Run, start: int, chunk: list[int], *, guess: bool, ahead: bool = False) -> bool:
        """Send ``chunk`` at ``start`` over the decode channel; False: a hop takes no channel (nothing sent)."""
        request = self._step_request(run, start, chunk, guess=guess)
        urls = [h.url for h in run.plan.hops]
        # a plain step's number, so that the tail may be given leave to relay the step after it (_grant)
        plain = self.relay and len(chunk) == 1 and len(urls) > 1
        slot = await self.hops.reserve_step(urls, run.plan.session_id, timeout_s=self.timeout_s) if plain else None
        # no hop waits for another on the channel, so no nesting: one hop timeout bounds the walk
        task = await self.hops.start_step(urls, request, timeout_s=self.timeout_s, slot=slot)
        if task is None:
            return False
        self._add_round(run, start, chunk, task, guess=guess, ahead=ahead, seq=None if slot is None else slot.seq)
        return True

    def _add_round(
        self, run: _Run, start: int, chunk: list[int], task: asyncio.Future[HopAnswer], *, guess: bool, ahead: bool,
        seq: int | None, timed: bool = True,
    ) -> None:  # fmt: skip
        """A round in flight; ``timed``: it went from here, so its walk is the route's when it went alone."""
        _sent(run, chunk)
        run.pipelined = run.pipelined or guess
        alone = timed and not run.rounds
        run.rounds.append(_Round(start, chunk, guess, task, time.monotonic(), alone=alone, ahead=ahead, seq=seq))

    def _step_request(self, run: _Run, start: int, chunk: list[int], *, guess: bool = False) -> HopRequest:
        """A decode step for ``chunk[0]`` at ``start`` (a verify chunk with the drafts after it; ``guess``:
        a pipelined round, its first token a draft too), telling the hops to drop what they hold past
        ``start`` when the route holds rejected drafts (``run.surplus``)."""
        plan = run.plan
        return HopRequest(
            Verb.VERIFY if len(chunk) > 1 else Verb.DECODE, plan.session_id, start, len(chunk), ids_payload(chunk),
            model=self.info.model_id, route_id=plan.route_id, drafts=tuple(chunk[1:]), rewind=run.surplus,
            guess=chunk[0] if guess else None,
        )  # fmt: skip

    async def _chain(self, run: _Run, tokens: list[int], drafter: Drafter) -> None:
        """Pipelined speculation: send more rounds, each continuing the drafts of the rounds in flight
        as if they were all kept, while one more pays on this route (``WalkCosts.chain_pays``: the
        chance that every draft before it is kept, by the generation's measured acceptance, against
        what it saves, a walk less one hop's share of the compute, and wastes when void, that share).
        Each is cut to the drafts that pay, as a first round is. A rejection voids the rounds after
        it (``_take_round``)."""
        plan = run.plan
        if self.pipeline_rounds < 2 or run.audited or run.grammar or len(run.rounds[0].chunk) < 2:
            return  # (a first round without drafts: drafting does not pay on this route now)
        costs = self._walk_costs(plan)
        per_round = min(self.draft_tokens, *(h.max_verify for h in plan.hops)) + 1
        while len(run.rounds) < self.pipeline_rounds:
            last = run.rounds[-1]
            limit = min(per_round, self._context(plan) - last.end)
            # it is of use only if every draft in flight before it is kept, and its own guess is right
            guessed = 1 + sum(len(r.chunk) - (not r.guess) for r in run.rounds)
            kept = drafter.acceptance**guessed
            if limit < 1 or not costs.chain_pays(limit, kept, len(plan.hops), draft_s=drafter.draft_s):
                return
            text = [*tokens[: run.rounds[0].start], *(t for r in run.rounds for t in r.chunk)]
            if isinstance(drafter, ModelDraft):  # a model computes the drafts: off the loop
                chunk = await asyncio.to_thread(drafter.chained, text, limit)
            else:
                chunk = drafter.chained(text, limit)  # the guess, the drafts that pay
            if not chunk or not await self._start_round(run, last.end, chunk, guess=True):
                return

    async def _take_round(self, run: _Run, drafter: Drafter | None) -> Sampled:
        """The oldest round's answer, checked and accounted; when it ends before the next round in
        flight starts, or with another token than that round guessed, the rounds after it are void."""
        round_ = run.rounds.popleft()
        raw = await round_.task
        if not run.rounds:
            await self._step_ahead(run, raw, round_.end, drafter, round_.seq)
        answer = self._check_tokens(raw, run)
        now = time.monotonic()
        took = now - max(round_.sent, run.answered_at)
        run.answered_at = now
        costs = self._walk_costs(run.plan)
        costs.observe(len(round_.chunk), sum(_hop_ms(answer)) / 1000, now - round_.sent if round_.alone else None)
        run.usage.decoded(took)  # the tracker checks the route's advertised speeds by it
        kept = _kept(answer, round_.start, len(round_.chunk))
        expected = run.ledger.at(round_.end)  # every entry describes the whole round: the hops drop drafts lazily
        _verified(run, answer, expected)
        run.usage.add(run.plan.hops, decode=kept - round_.start)
        if run.rounds:
            following = run.rounds[0]
            right = kept == following.start and _tokens_of(answer)[-1][0] == following.chunk[0]
            if drafter is not None and kept == following.start and not following.ahead:
                drafter.record(1, int(right))  # its guess was a draft too
            if not right:
                self._void(run)
        if kept < round_.end or run.surplus:
            run.ledger.rewind(kept)
            run.surplus = True  # the hops before the tail hold what was dropped: the next round says so
        return answer

    async def _step_ahead(self, run: _Run, raw: HopAnswer, end: int, drafter: Drafter | None, seq: int | None) -> None:
        """Send the next step as soon as a plain step's answer is in, before that answer is checked and
        its token handed on: the checks, the telemetry and the consumer then run while the route
        computes (0.4 ms of every token of the bundled 3-node route on a 2-core machine). The
        step continues the tail's own token (``guess``: the tail computes it only if it sampled that
        token there). If the checks then fail, the generation repairs or stops as it would have, and
        the step in flight is drained like a void round (``_drain``). Not when the generation ends with
        this token (its end of text, the context, the consumer's ``max_tokens``), when the hops are
        due to snapshot their KV, and not for an audited or grammar-bound generation (as ``_chain``).

        Where the tail had leave to relay that step (``_grant``) and did, the step is already out: it
        becomes the round in flight, and nothing is sent. ``seq``: the answered step's number."""
        relayed = self._relayed(run, seq)
        if not isinstance(raw, TokenAnswer) or raw.position != end or run.audited or run.grammar:
            return self._void_slot(run, relayed)
        token = raw.token
        if not 0 <= token < self.info.n_vocab or self.is_end_of_generation(token):
            return self._void_slot(run, relayed)
        if end + 1 > self._context(run.plan) or (run.budget and run.generated + 1 >= run.budget):
            return self._void_slot(run, relayed)
        if self._snapshot_due(run, end):
            return self._void_slot(run, relayed)
        if drafter is not None:
            drafter.extend([token])
        if relayed is not None:  # (its walk began at the tail: not one the gateway can time, WalkCosts)
            self._add_round(run, end, [token], relayed.answer, guess=True, ahead=True, seq=relayed.seq, timed=False)
            return None
        drafts: list[int] = []
        if drafter is not None:
            drafts = await self._drafts(drafter, run.plan, end + 1)
        await self._start_round(run, end, [token, *drafts], guess=True, ahead=True)
        return None

    def _relayed(self, run: _Run, seq: int | None) -> StepSlot | None:
        """The step the tail relayed after the answered step ``seq``, if it had leave to and did; a
        leave it did not use is withdrawn (its slot cancelled), one for another step is drained."""
        if run.credit is None:
            return None
        (slot, after), run.credit = run.credit, None
        if after == seq and slot.launched:
            run.unused = run.pauses = 0
            return slot
        _leave_unused(run)
        self._void_slot(run, slot)
        return None

    def _void_slot(self, run: _Run, slot: StepSlot | None) -> None:
        """A step the tail relayed that the generation has no use for is drained like a void round
        (the hops then hold a position too many: the next round drops it); one it did not relay is
        withdrawn."""
        if slot is None:
            return
        if not slot.launched:
            slot.answer.cancel()
            return
        slot.answer.add_done_callback(_consume)
        run.void.append(slot.answer)
        run.surplus = True

    async def _grant(self, run: _Run, drafter: Drafter | None) -> None:
        """Give the tail leave to send the step after the one in flight to the head itself (a
        ``CREDIT``): the token then goes round the route without the gateway — one link and the
        gateway's own work less per token, which over a WAN is a whole one-way trip. Only for a
        plain step after a plain step, where ``_step_ahead`` would send it: no drafts paying on
        the text now (the gateway drafts only on steps it sends), the generation's end not at the
        step (its ``max_tokens``, the context; the end of text the tail itself sees: ``stop``), no KV
        snapshot due, nothing to rewind, no grammar or audit. The leave is for that one step, given
        once the answer before it is checked and its tokens taken by the consumer: a consumer that
        stops (a stop string, a client gone) leaves no more steps computed than without relaying."""
        if not self.relay or run.credit is not None or len(run.rounds) != 1 or run.surplus:
            return
        if run.generated < run.leave_at:  # the tail left leaves unused in a row: paused (_leave_unused)
            return
        flight = run.rounds[0]
        if flight.seq is None or len(flight.chunk) != 1 or run.audited or run.grammar:
            return
        at = flight.end  # where the relayed step would start
        if at + 1 > self._context(run.plan) or (run.budget and run.generated + 1 >= run.budget):
            return
        # explore: the step would go without the gateway, so this is the decision a re-probe rides on
        if self._snapshot_due(run, at) or self._would_draft(drafter, run.plan, at + 1, explore=True):
            return
        urls = [h.url for h in run.plan.hops]
        slot = await self.hops.reserve_step(urls, run.plan.session_id, timeout_s=self.timeout_s)
        if slot is None:
            return
        given = await self.hops.credit(slot, after=flight.seq, model=self.info.model_id, route_id=run.plan.route_id,
                                       stop=await asyncio.shield(self._find_stops()))  # fmt: skip
        if not given:
            _leave_unused(run)
            slot.answer.cancel()
            return
        run.credit = (slot, flight.seq)

    def _would_draft(self, drafter: Drafter | None, plan: RoutePlan, length: int, *, explore: bool = False) -> bool:
        """Whether the step after ``length`` tokens may carry drafts that pay (then the gateway sends
        it): prompt lookup where the text repeats and drafts pay; a draft model where drafts pay at
        what its drafts cost (``Drafter.would_draft``)."""
        if drafter is None:
            return False
        return drafter.would_draft(self._draft_limit(plan, length), explore=explore)

    def _draft_limit(self, plan: RoutePlan, length: int) -> int:
        """How many drafts may follow the step after ``length`` tokens: every hop's limit, the context."""
        return min(*(h.max_verify for h in plan.hops), self._context(plan) - length)

    def _find_stops(self) -> asyncio.Future[frozenset[int]]:
        """The tokens a generation ends with (the vocabulary's end-of-generation ids), found once on a
        worker thread. A generation that may relay starts it, so its first leave does not wait for it
        and come after the step it follows."""
        found = self._stop_ids
        if found is None or (found.done() and (found.cancelled() or found.exception() is not None)):
            n, eog = self.info.n_vocab, self.is_end_of_generation
            found = asyncio.ensure_future(asyncio.to_thread(lambda: frozenset(t for t in range(n) if eog(t))))
            self._stop_ids = found
            found.add_done_callback(_consume)  # a failure is raised where it is awaited
        return found

    def _void(self, run: _Run) -> None:
        """The rounds in flight are void: their answers are of no use (the tail voids them, every
        other hop drops them when the next round says ``rewind``), but are still awaited before a
        repair or the close (``_drain``)."""
        if not run.rounds:
            return
        run.void = [t for t in run.void if not t.done()]
        for round_ in run.rounds:
            round_.task.add_done_callback(_consume)
            run.void.append(round_.task)
        run.rounds.clear()
        run.surplus = True

    async def _drain(self, run: _Run) -> None:
        """Wait (bounded) until every round in flight, void ones too, has an outcome, so no hop still
        computes one when a repair or the session's close reaches it; their outcomes are of no use."""
        tasks = [*run.void, *(r.task for r in run.rounds)]
        run.rounds.clear()
        run.void = []
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.timeout_s)
            for task in pending:
                task.cancel()
            for task in tasks:
                task.add_done_callback(_consume)
        if run.credit is not None:  # the answers above said whether the tail relayed the step it had leave for
            (slot, _), run.credit = run.credit, None
            self._void_slot(run, slot)
            await self._drain(run)

    async def _http_step(
        self, run: _Run, tokens: list[int], drafts: Sequence[int], cancel: asyncio.Event
    ) -> Sampled | None:
        """One decode step for ``tokens[-1]`` at position ``len(tokens) - 1`` (a verify chunk with
        ``drafts`` after it) over HTTP, hop by hop (a hop of the route takes no decode channel)."""
        position = len(tokens) - 1
        chunk = [tokens[-1], *drafts]
        request = self._step_request(run, position, chunk)
        _sent(run, chunk)
        began = time.monotonic()
        try:
            answer = self._check_tokens(await self._send(run.plan, request), run)
        except (HopFailed, InvalidRequest) as raised:
            failure = _hop_failure(run, raised)
            run.ledger.rewind(position + 1)  # the repair resends the step without its drafts
            return await self._recover(run, tokens, failure, cancel)
        took = _since(began)
        costs = self._walk_costs(run.plan)
        costs.observe(len(chunk), sum(_hop_ms(answer)) / 1000, took)
        run.usage.decoded(took)  # the tracker checks the route's advertised speeds by it
        kept = _kept(answer, position, len(chunk))
        run.ledger.rewind(kept)
        _verified(run, answer)
        run.usage.add(run.plan.hops, decode=kept - position)
        return answer

    async def _recover(self, run: _Run, tokens: list[int], error: HopFailed, cancel: asyncio.Event) -> Sampled | None:
        """Repair the route after ``error`` (retrying while repairs fail), else re-prefill on a fresh route."""
        while True:
            began = time.monotonic()
            failed = self._failed_hop(run, error)
            try:
                answer, replayed = await self._repair(run, failed, error, tokens)
            except HopFailed as again:  # a replacement (or the upstream) failed too: repair that
                error = again
                continue
            except (Overloaded, BadGateway):
                raise
            except MeshnetError as exc:  # no seam log, no rewind on this backend...: start over
                if exc.code in REQUEST_CODES:  # the replay's tail refused the request itself
                    error = _hop_failure(run, exc)  # (the client's 400 when the request has a grammar)
                    continue
                reason = f"{error.message}; route repair impossible ({exc.message})"
                await self._fresh_route(run, tokens)
                change = RouteChange("reroute", reason, failed.node, run.plan, run.retries, len(tokens), _since(began))
                await run.emit(change)
                return await self._prefill_with_retries(run, tokens, cancel)
            change = RouteChange("repair", error.message, failed.node, run.plan, run.retries, replayed, _since(began))
            await run.emit(change)
            return answer

    async def _taken(self, run: _Run, held: int, drafter: Drafter | None) -> None:
        """The consumer took an answer's tokens and the route holds every token but the newest (``held``
        positions): the hops snapshot their KV when due, and the tail may get leave to relay (``_grant``)."""
        await self._snapshot_when_due(run, held)
        await self._grant(run, drafter)

    def _snapshot_due(self, run: _Run, held: int) -> bool:
        """Whether the hops snapshot their KV (``_snapshot``) once the route holds ``held`` positions."""
        if not self.kv_snapshots or run.plan.ticket is None:
            return False
        return held - run.snapshot_at >= (SNAPSHOT_EVERY if run.snapshot_at else SNAPSHOT_MIN_POSITIONS)

    async def _snapshot_when_due(self, run: _Run, held: int) -> None:
        if not self._snapshot_due(run, held) or run.surplus or run.rounds:  # (hops holding drafts would too)
            return
        run.snapshot_at = held
        try:
            await self._snapshot(run, held)
        except MeshnetError as exc:  # a tracker that cannot answer now: repair replays everything
            _log.info("no KV snapshots for session %s: %s", run.plan.session_id, exc.message)

    async def _snapshot(self, run: _Run, held: int) -> None:
        """After a long prompt's prefill (and every ``SNAPSHOT_EVERY`` positions after), every hop
        that has a standby (a trusted node of the same layers the tracker names, only in a private
        swarm) snapshots its KV to it, replacing the one before; a repair then restores there and
        replays only the positions after ``held``. Best effort: a hop without a standby, or a
        snapshot that fails, leaves repair by replay."""
        plan = run.plan
        if not self.kv_snapshots or plan.ticket is None:
            return
        response = await self._tracker("POST", f"/v1/sessions/{plan.session_id}/standbys", json={})
        if response.status_code >= 400:
            _log.info("no KV snapshots for session %s: %s", plan.session_id, error_message(response))
            return
        by_index = dict(enumerate(plan.hops))
        for standby in response.json().get("standbys", []):
            hop = by_index.get(standby.get("index"))
            ticket = standby.get("ticket")
            if hop is None or not isinstance(ticket, str):
                continue
            try:
                answer = await self.hops.take_snapshot(hop.url, plan.session_id, ticket, timeout_s=self.timeout_s)
            except MeshnetError as exc:
                _log.info("hop %s took no KV snapshot: %s", hop.node, exc.message)
                continue
            if answer.get("snapshot") == held:
                run.standbys[hop.node] = (str(standby.get("node_id")), held)
            else:
                _log.info("hop %s took no KV snapshot of the %d positions: %s", hop.node, held, answer)

    async def _restore(self, run: _Run, hop: Hop) -> int:
        """Open the session on a repair's replacement from the KV snapshot it holds as a standby;
        the positions it took (0: it holds none, and the replay starts from the beginning)."""
        plan = run.plan
        restore = RestoreRequest(plan.session_id, plan.route_id, model=self.info.model_id, sampling=run.sampling,
                                 ticket=plan.ticket)  # fmt: skip
        try:
            answer = await self._post(plan, hop.url, restore, below=1)
        except MeshnetError as exc:
            _log.info("standby %s restored no snapshot (%s): replaying everything", hop.node, exc.message)
            return 0
        return answer.count if isinstance(answer, Restored) else 0

    async def _repair(self, run: _Run, failed: Hop, error: HopFailed, tokens: list[int]) -> tuple[Sampled, int]:
        """Ask the tracker for replacement hops, rebuild them from the upstream's seam log (after the
        positions a standby's KV snapshot gives the replacement), resend the step."""
        position = len(tokens) - 1
        body: dict[str, Any] = {"failed_node": failed.node, "reason": error.message, "position": position}
        standby = run.standbys.pop(failed.node, None)
        if standby is not None:
            body["prefer"] = standby[0]
        response = await self._tracker("POST", f"/v1/sessions/{run.plan.session_id}/repair", json=body)
        if response.status_code >= 400:
            raise BadGateway(f"{error.message}; no route repair: {error_message(response)}")
        data = response.json()
        old = run.plan
        ticket = data.get("ticket")  # a private swarm's repair ticket: the reroutes need it
        run.plan = dataclasses.replace(
            old, hops=self._hops(data["hops"]), ticket=ticket if isinstance(ticket, str) else None
        )
        first, count = int(data["replaced"]["first"]), int(data["replaced"]["count"])
        new_hops = run.plan.hops
        sid = run.plan.session_id
        restored = await self._restore(run, new_hops[first]) if data.get("preferred") is True and count == 1 else 0
        answer: HopAnswer
        # after pipelined rounds, a hop's own copy of the step may be a voided round's or a rejected
        # draft's (it broke on one before the round that would have rewound it came): the step is then
        # resent by the gateway through the whole route, every hop recomputing it (``resend``)
        resend = not run.pipelined
        if first == 0:  # the head failed: the gateway is the upstream and replays token ids
            answer = await self._replay_tokens(run, tokens, count, start=restored)
        else:
            upstream = new_hops[first - 1]
            below = len(new_hops) - first + 1
            chunks = 1 + (position - restored) // 256  # the upstream replays its log in requests of up to 256
            reroute = self._reroute(run, first - 1, count, position, resend=resend)
            reroute = dataclasses.replace(reroute, replay_from=restored)
            answer = await self._post(run.plan, upstream.url, reroute, below=below, scale=chunks)
            above: list[HopEntry] = []
            for i in range(first - 2, -1, -1):  # the hops above it broke the session too: clear them
                reroute = self._reroute(run, i, 0, position, resend=resend)
                cleared = await self._post(run.plan, new_hops[i].url, reroute, below=len(new_hops) - i)
                above[:0] = cleared.hops[:1]
            answer = answer.after(*above)
            if not resend:
                if not isinstance(answer, Replayed):
                    raise HopFailed(f"the upstream {upstream.node} answered a replay with {answer.kind}",
                                    failed_hop=upstream.url)  # fmt: skip
                answer = await self._send(run.plan, self._resent_step(run, tokens))
        sampled = self._check_tokens(answer, run)
        _verified(run, sampled)  # the repaired route holds what the old one did
        run.usage.add(new_hops[first : first + count], prefill=position - restored)
        run.usage.add(new_hops, decode=1)
        kept = {h.url for h in new_hops}
        for hop in old.hops:  # hops cut out of the route (but alive) free the session now, not at TTL
            if hop.url not in kept and hop.node != failed.node:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.hops.delete(hop.url, sid, old.ticket), CLOSE_WAIT_S)
        return sampled, position - restored

    def _reroute(self, run: _Run, index: int, replay: int, step: int, *, resend: bool = True) -> RerouteRequest:
        """A reroute for the step at position ``step``: the hop drops anything past it (drafts) first
        (and the step too, without ``resend``)."""
        plan = run.plan
        hops = tuple(h.url for h in plan.hops[index + 1 :])
        return RerouteRequest(plan.session_id, hops, plan.route_id, model=self.info.model_id, replay=replay,
                              sampling=run.sampling, step=step, ticket=plan.ticket, resend=resend)  # fmt: skip

    def _resent_step(self, run: _Run, tokens: list[int]) -> HopRequest:
        """The step for ``tokens[-1]`` again, every hop that holds it dropping it first."""
        plan, position = run.plan, len(tokens) - 1
        return HopRequest(Verb.DECODE, plan.session_id, position, 1, ids_payload(tokens[position:]),
                          model=self.info.model_id, route_id=plan.route_id, rewind=True)  # fmt: skip

    async def _replay_tokens(self, run: _Run, tokens: list[int], count: int, *, start: int = 0) -> HopAnswer:
        """Rebuild a new head (and ``count - 1`` hops after it) from the token ids after ``start`` (the
        positions a restored snapshot gave it), then resend the step."""
        plan, position = run.plan, len(tokens) - 1
        for _, request in self._chunk_requests(run, tokens[:position], start=start):
            await self._send(plan, dataclasses.replace(request, replay=count))
        return await self._send(plan, self._resent_step(run, tokens))

    async def _fresh_route(self, run: _Run, tokens: list[int]) -> None:
        """Abandon the current route (work on it is not billed) for a new one without the failed nodes."""
        await self._close(run.plan)
        like = run.plan.session_id if run.streamed else None
        run.plan = await self.plan(
            exclude=sorted(run.failed_nodes), prompt_tokens=len(tokens), like_session=like,
            trusted_only=run.plan.trusted_only, prompt=tokens if run.prefix is not None else (),
            namespace=run.plan.prefix_namespace,
        )  # fmt: skip
        run.usage = Usage()
        run.cached = 0
        run.standbys, run.snapshot_at = {}, 0  # the old session's snapshots are of no use to the new one

    def _failed_hop(self, run: _Run, error: HopFailed) -> Hop:
        """The hop ``error`` names, counted against the retry budget."""
        run.retries += 1
        hop = next((h for h in run.plan.hops if h.url == error.failed_hop), None)
        if hop is None:
            raise BadGateway(f"{error.message} (the failed hop {error.failed_hop} is not on this route)")
        if run.retries > self.max_retries:
            raise BadGateway(f"{error.message}; gave up after {self.max_retries} route retries")
        run.failed_nodes.add(hop.node)
        return hop

    def _check_tokens(self, answer: HopAnswer, run: _Run) -> Sampled:
        """``answer`` to a step, as the answer with tokens it must be. Its tokens must be ids of this
        vocabulary with finite logprobs, and a sampled one what the distribution the tail committed to
        gives with the gateway's seed (``sampling.check_draw``): anything else (another kind of answer
        too) is a failed tail, repaired like one — never a token id handed to the detokenizer, which
        aborts on one it lacks. The entries' signatures are checked first: a token a hop changed on its
        way back stops the generation instead (``RouteInconsistent``), and a tail is blamed only for
        what it signed."""
        plan = run.plan
        check_signatures(plan.session_id, plan.hops, answer, tail_only=True)  # the others: at the end (_verified)
        tail, n_vocab = plan.hops[-1], self.info.n_vocab
        if not isinstance(answer, TokenAnswer | VerifyAnswer):
            raise HopFailed(f"the tail {tail.node} answered a step with {answer.kind}", failed_hop=tail.url)
        for token, logprob, top in _tokens_of(answer):
            for t, lp in ((token, logprob), *top):
                if not 0 <= t < n_vocab or not math.isfinite(lp) or lp > _LOGPROB_SLACK:
                    if tail.key is not None:
                        run.usage.unpaid.add(tail.node)  # it signed the answer (checked above)
                    raise HopFailed(
                        f"the tail {tail.node} answered token {t} with logprob {lp}: not a token of this model's "
                        f"vocabulary [0, {n_vocab}) with a logprob <= 0",
                        failed_hop=tail.url,
                    )
        if isinstance(answer, TokenAnswer) and tail.key is not None:  # a signing tail commits to its draw
            why = check_draw(run.params, answer.draw, answer.token, answer.position)
            if why is not None:
                run.usage.unpaid.add(tail.node)  # it signed a token its own commitment does not give
                raise HopFailed(f"the tail {tail.node} answered token {answer.token} at {answer.position}: {why}",
                                failed_hop=tail.url)  # fmt: skip
        return answer

    async def _report_failure(self, plan: RoutePlan, hop: Hop, reason: str) -> None:
        with contextlib.suppress(MeshnetError):  # reliability bookkeeping only; a new route is what matters
            body = {"reason": reason, "session_id": plan.session_id}
            await self._tracker("POST", f"/v1/nodes/{hop.node}/failures", json=body)

    # -- the wire ----------------------------------------------------------------------------
    async def _prefill(self, run: _Run, tokens: Sequence[int], cancel: asyncio.Event) -> Sampled | None:
        """Prefill ``tokens`` on ``run.plan`` in the chunks of ``run.ledger``, after the positions the
        route's prefix caches give it (``_reuse``); the last chunk's answer samples."""
        answer: HopAnswer | None = None
        total = len(tokens)
        run.cached = 0
        if run.prefix is not None and run.plan.cached_tokens > 0 and not run.cold:
            run.cached = await self._reuse(run, tokens)
        for end, chunk in self._chunk_requests(run, tokens, start=run.cached):
            if cancel.is_set():
                return None
            request = dataclasses.replace(chunk, sample=True) if end == total else chunk
            answer = await self._send(run.plan, request)
            await run.emit(PrefillProgress(done=end, total=total, cached=run.cached))
        return None if answer is None else self._check_tokens(answer, run)

    async def _reuse(self, run: _Run, tokens: Sequence[int]) -> int:
        """Open the session with a prefix request: every hop adopts the KV of as many leading prompt
        blocks as the whole route holds. The answer's digests must show every hop holding exactly
        what a cold prefill of these tokens computes (protocol.ledger); if they do not (a poisoned
        or colliding cache entry), the session is dropped and the prompt prefilled cold on a fresh
        route, and that session's blocks replace the bad entry. How many positions were reused."""
        plan, claim, block = run.plan, run.prefix, self.prefill_chunk
        assert claim is not None
        limit = min(len(claim.hashes), (len(tokens) - 1) // block)  # the last token is always computed
        if limit < 1:
            return 0
        request = PrefixRequest(plan.session_id, claim, limit, plan.route_id, model=self.info.model_id,
                                next_hops=tuple(h.url for h in plan.hops[1:]), sampling=run.sampling,
                                ticket=plan.ticket)  # fmt: skip
        answer = await self._post(plan, plan.hops[0].url, request, below=len(plan.hops))
        if not isinstance(answer, Cached) or answer.count % block or answer.count > limit * block:
            head = plan.hops[0]
            what = f"{answer.kind} {answer.count}" if isinstance(answer, Cached) else answer.kind
            raise HopFailed(f"the head {head.node} answered a prefix request with {what}", failed_hop=head.url)
        held = answer.count
        expected = ChunkLedger(False, list(run.ledger.ends), list(run.ledger.inputs))
        expected.rewind(held)
        try:
            _verified(run, answer, expected)
        except RouteInconsistent as exc:
            _log.warning("prefix cache: route %s holds other KV for this prompt's blocks (%s); prefilling cold",
                         plan.route_id, exc.message)  # fmt: skip
            run.cold = True
            await self._fresh_route(run, list(tokens))
            return 0
        if held:
            await run.emit(PrefillProgress(done=held, total=len(tokens), cached=held))
        return held

    def _chunk_requests(
        self, run: _Run, tokens: Sequence[int], *, start: int = 0
    ) -> Generator[tuple[int, HopRequest], None, None]:
        """``(end, request)`` of the prefill requests for ``tokens`` from ``start``, in exactly the
        chunks the route computed them in first (several chunks to a request, each its own compute call)."""
        plan = run.plan
        ends = run.ledger.ends
        if len(tokens) not in ends or (start and start not in ends):
            raise EngineError(f"positions {start}..{len(tokens)} do not end on chunks of this generation")
        sizes = run.ledger.sizes()[: ends.index(len(tokens)) + 1]
        skip = ends.index(start) + 1 if start else 0
        for offset, chunks in pack_chunks(sizes[skip:], self.prefill_chunk):
            begin = start + offset
            end = begin + sum(chunks)
            first = begin == 0  # the first request names the route and the tail's sampling
            yield end, HopRequest(
                Verb.PREFILL, plan.session_id, begin, end - begin, ids_payload(tokens[begin:end]),
                model=self.info.model_id, route_id=plan.route_id, chunks=tuple(chunks) if len(chunks) > 1 else None,
                next_hops=tuple(h.url for h in plan.hops[1:]) if first else None,
                sampling=run.sampling if first else None, ticket=plan.ticket if first else None,
                prefix=run.prefix if first else None,
            )  # fmt: skip

    async def _send(self, plan: RoutePlan, request: HopRequest) -> HopAnswer:
        """Send ``request`` to the head of ``plan``'s route; its answer."""
        return await self._post(plan, plan.hops[0].url, request, below=len(plan.hops))

    async def _post(self, plan: RoutePlan, hop_url: str, request: Sendable, *, below: int, scale: int = 1) -> HopAnswer:
        """``request`` to a hop with ``below`` hops from it to the tail (itself included); a failure
        that names a hop (or is this hop's own) raises ``HopFailed``. The wait nests one margin above
        the hop's own wait for its next hop (``hop_timeout_s``): a stopped head is named after 14 s on
        a 2-hop route with the 4 s default, not 24."""
        downstream = [hop_url, *(h.url for h in plan.hops[len(plan.hops) - below :] if h.url != hop_url)]
        timeout_s = scale * hop_timeout_s(self.timeout_s, below)
        return await self.hops.send(hop_url, request, timeout_s=timeout_s, downstream=downstream)

    async def _close(self, plan: RoutePlan) -> None:
        """Free the session's KV on every hop (the head forwards the delete; each hop keeps its prompt
        blocks first) and on the tracker. The stream ends only after the first attempt
        (``run_worker``), so its wait is short (``CLOSE_WAIT_S``); one that is not acknowledged (a hop
        still computing for the session, or unreachable for a moment) is retried by the closer until
        it is (protocol.closer): no zombie holds a slot of the route until its TTL."""
        head, sid, ticket = plan.hops[0].url, plan.session_id, plan.ticket

        async def attempt() -> bool | None:
            return await self.hops.delete(head, sid, ticket)

        await self.closer.close(attempt, f"{head}/v1/sessions/{sid}", timeout_s=CLOSE_WAIT_S)
        await self.release(plan)

    async def aclose(self) -> None:
        """Close the engine's connections, giving pending closes a moment first (on the engine's loop)."""
        await self.closer.shutdown()
        if self._hops_client is not None:
            await self._hops_client.aclose()
        if self._tracker_client is not None:
            await self._tracker_client.aclose()

    def close(self) -> None:
        """What does not need the loop: the billing outbox's thread."""
        self.outbox.close()


def _tokens_of(answer: Sampled) -> list[tuple[int, float, Alternatives]]:
    """The tokens an answer brings, in order, with their logprobs and (when asked) the most likely
    tokens at each position: one token, or a verify chunk's."""
    if isinstance(answer, VerifyAnswer):
        tops = answer.tops or ((),) * len(answer.tokens)
        return list(zip(answer.tokens, answer.logprobs, tops, strict=True))
    return [(answer.token, answer.logprob, answer.top or ())]


def _kept(answer: Sampled, position: int, n: int) -> int:
    """How many positions the route holds after a step at ``position`` of ``n`` positions."""
    kept = answer.position
    if not position < kept <= position + n or len(_tokens_of(answer)) != kept - position:
        raise BadGateway(f"the route answered a {n}-position step at {position} with position {kept}")
    return kept


def _hop_ms(answer: HopAnswer) -> tuple[float, ...]:
    return tuple(h.compute_ms for h in answer.hops)


def _hop_failure(run: _Run, raised: MeshnetError) -> HopFailed:
    """The hop failure behind ``raised``, else ``raised`` itself re-raised. A hop's 400 about the
    request (``REQUEST_CODES``: a grammar too costly for the tail's deadline) is the client's error
    when its request has a grammar; without one no honest hop answers it, so it is the tail's failure
    (only the tail samples; any hop may name a failed hop downstream, so this trusts no one more)."""
    if isinstance(raised, HopFailed):
        return raised
    if raised.code not in REQUEST_CODES or run.grammar:
        raise raised
    why = f"the route answered {raised.code} for a request without a grammar: {raised.message}"
    return HopFailed(why, failed_hop=run.plan.hops[-1].url)


def _since(began: float) -> float:
    return time.monotonic() - began


def _verified(run: _Run, answer: HopAnswer, expected: ChunkLedger | None = None) -> None:
    """Raise ``RouteInconsistent`` unless ``answer``'s entries show the route holding what ``expected``
    (by default the run's ledger) says, each computed from what the hop before it sent
    (``verify_hops``), and each signed by its own hop's key, the tail's over the answer too
    (``check_signatures``; for an answer with tokens ``_check_tokens`` checked the tail's before
    looking at its tokens, and the others' are checked on the latest entries at the end). The
    entries become the nodes' receipts for the session (``Usage.signed``)."""
    plan = run.plan
    verify_hops(run.ledger if expected is None else expected, plan.hops, answer.hops)
    if answer.kind not in CLAIMED_KINDS:
        check_signatures(plan.session_id, plan.hops, answer)
        run.usage.signed(answer)
    else:  # only the tail's signature is checked yet: the others' are, on the latest, at the end
        run.usage.signed(answer, plan.session_id, {h.node: h.key for h in plan.hops})
    if run.audited and isinstance(answer, TokenAnswer | VerifyAnswer):
        _keep_answer(run, answer, answer.position)


def _keep_answer(run: _Run, answer: Sampled, position: int) -> None:
    """An audited generation keeps the tail's signed answers, by the position of each token: those
    that committed a draw, and (greedy: each token is its row's most likely) a verify chunk's."""
    if isinstance(answer, TokenAnswer) and answer.draw is not None:
        positions = [position]
    elif isinstance(answer, VerifyAnswer) and run.params.greedy:
        positions = list(range(position - len(answer.tokens) + 1, position + 1))
    else:
        return
    if run.answers_of != run.plan.session_id:
        run.answers, run.answers_of = {}, run.plan.session_id
    claim = claim_of(answer)
    assert claim is not None
    for at in positions:
        run.answers[at] = (answer.hops[-1], claim)


def _sent(run: _Run, chunk: Sequence[int]) -> None:
    """A step of ``chunk`` went out: its positions join the ledger, and the rewind it carried is done."""
    run.surplus = False
    for token in chunk:  # a verify chunk's positions compute as one-position steps (ShardInfo)
        run.add([token])


def _leave_unused(run: _Run) -> None:
    """The tail did not use a leave to relay (or it could not be sent): after ``_UNUSED_LEAVES`` in a
    row, no leaves for the next ``_LEAVE_PAUSE_TOKENS`` tokens, twice as many at each pause after
    that until the tail uses one again."""
    run.unused += 1
    if run.unused < _UNUSED_LEAVES:
        return
    run.leave_at = run.generated + (_LEAVE_PAUSE_TOKENS << min(run.pauses, 16))
    run.pauses += 1
    run.unused = 0


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a void round's outcome: of no use, and not worth a warning


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
