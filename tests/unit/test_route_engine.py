"""The gateway's real route engine (gateway.route_engine) in process: the real tracker app over
httpx's ASGI transport, real node services over fake shards (``backends.fake_shard``) reached
through the nodes' own hop client (``protocol.hops.LocalTransport``), no sockets. Repair at every
position of every hop, the head replayed from token ids, a fresh route during prefill, prefix
reuse, verify rounds, the retry budget, waiting for room and concurrent generations — each in
milliseconds; the real-process tests keep one smoke test of each over llama.cpp.

A fake shard's output at a position depends on every position its session holds before it, so a
repair that misses, repeats or keeps a stale position changes the tokens: every test compares
whole token sequences with an undisturbed run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from meshnet.backends.base import EngineStep, ModelInfo, PrefillProgress, RouteChange, Stop, TokenStep
from meshnet.backends.fake_shard import TOTAL, VOCAB, MixShard
from meshnet.errors import BadGateway, Conflict, Forbidden, HopFailed, InvalidRequest, Overloaded, SessionNotFound
from meshnet.gateway.billing_outbox import BillingOutbox
from meshnet.gateway.route_engine import RouteEngine
from meshnet.gateway.speculative import WalkCosts
from meshnet.node.advert import LatencyProber, advert_fields
from meshnet.node.service import NodeConfig, NodeService
from meshnet.protocol.channel import Credit
from meshnet.protocol.hops import LocalTransport
from meshnet.protocol.signing import HopKey
from meshnet.protocol.tickets import TicketVerifier
from meshnet.routes import RoutePlan
from meshnet.sampling import Sampler, SamplingParams
from meshnet.security.identity import MemberRequest, SwarmCA, make_csr, new_member_key
from meshnet.security.membership import SwarmAuthority
from meshnet.tracker.app import create_tracker_app
from meshnet.tracker.db import TrackerDB
from tests.unit.test_tracker_trust import _as_member, _sans

pytestmark = pytest.mark.timeout(60)

TRACKER = "http://tracker.test"
PROMPT = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 31, 4, 1]
LAYOUT = (("a", "0:4"), ("b", "4:8"), ("c", "8:12"))
NUMERICS = "mix 1"


class Vocabulary:
    """The gateway's side of the fake model: token ids only (nothing here detokenizes)."""

    info = ModelInfo("mix", "mix", "f32", TOTAL, 512, VOCAB, 2, None, "", "", "fake")

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def token_bytes(self, token: int) -> bytes:
        return bytes([65 + token % 26])

    def is_end_of_generation(self, token: int) -> bool:
        return False

    def grammar(self, text: str, *, param: str = "grammar") -> Any:
        raise AssertionError("no grammar here")


class LocalSwarm:
    """A tracker, node services by node id, and route engines over them, all in this process.
    ``private``: a private swarm's tracker (its CA, tickets; every node a trusted member), whose
    nodes check the tracker's route tickets; the gateway is a member too."""

    def __init__(self, tmp_path: Path, *, private: bool = False, channels: bool = False) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.tmp_path = tmp_path
        self.db = TrackerDB(f"sqlite:///{tmp_path}/tracker.db")
        self.tickets: TicketVerifier | None = None
        self.ca: SwarmCA | None = None
        if private:
            self.ca = SwarmCA.init(tmp_path / "swarm", name="lab")
            authority = SwarmAuthority.load(tmp_path / "swarm")
            self.tickets = TicketVerifier(authority.signer.public_pem())
            self.tracker_app = create_tracker_app(self.db, swarm=authority)
        else:
            self.tracker_app = create_tracker_app(self.db)
        self.transport = LocalTransport(channels=channels)
        self.nodes: dict[str, NodeService] = {}
        self.engines: list[RouteEngine] = []

    def _app(self, member: str, role: str) -> Any:
        """The tracker app as ``member`` reaches it (a private swarm: over TLS with its certificate)."""
        if self.ca is None:
            return self.tracker_app
        csr = make_csr(new_member_key(), member)
        cert = self.ca.issue(MemberRequest(csr, role=role, trusted=role == "node", sans=_sans(member, role)))
        return _as_member(self.tracker_app, cert)

    def tracker(self, member: str = "gw", role: str = "gateway") -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self._app(member, role)))

    async def node(self, node_id: str, layers: str, **shard: Any) -> NodeService:
        url = f"http://{node_id}.test:7000" if self.ca is None else f"https://{node_id}.local:7000"
        config = NodeConfig(node_id=node_id, url=url, tickets=self.tickets)
        service = NodeService(MixShard(layers, numerics=NUMERICS, **shard), config, self.transport,
                              channel_send=self.transport.channel_send)  # fmt: skip
        self.transport.add(url, service)
        self.nodes[node_id] = service
        await self._register(service)
        return service

    async def _register(self, service: NodeService) -> None:
        node_id, url, info = service.config.node_id, service.config.url, service.info
        body = {"node_id": node_id, "url": url, "model": info.model_id, "layers": str(info.layers),
                "total_layers": TOTAL, "backend": info.backend, "kv_bytes_free": service.shard.store.free_bytes(),
                "hop_key": service.config.hop_key.public, "prefill_tps": 1000.0, "decode_tps": 100.0,
                **advert_fields(service.shard, service.traffic, LatencyProber())}  # fmt: skip
        async with self.tracker(node_id, "node") as client:
            response = await client.post(f"{TRACKER}/v1/nodes", json=body)
        assert response.status_code in (200, 201), response.text

    async def heartbeat(self) -> None:
        """Every node registers again, as a node's heartbeat does: a test longer than the tracker's node
        TTL (15 s) keeps its nodes."""
        for service in self.nodes.values():
            await self._register(service)

    async def layout(self, *extra: tuple[str, str]) -> None:
        for node_id, layers in (*LAYOUT, *extra):
            await self.node(node_id, layers)

    def kill(self, node_id: str) -> None:
        """As after ``kill -9``: every later request to the node fails."""
        self.transport.remove(self.nodes[node_id].config.url)

    def engine(self, **options: Any) -> RouteEngine:
        member = self._app("gw", "gateway")
        outbox = BillingOutbox(TRACKER, spool_dir=self.tmp_path / f"spool{len(self.engines)}",
                               client=lambda: TestClient(member))  # fmt: skip
        settings: dict[str, Any] = {"n_ctx": 512, "prefill_chunk": 4, "speculative": "off", "timeout_s": 5.0,
                                    "decode_channel": False, **options}  # fmt: skip
        engine = RouteEngine(Vocabulary(), TRACKER, outbox=outbox, hops=self.transport, tracker=self.tracker(),
                             **settings)  # fmt: skip
        self.engines.append(engine)
        return engine

    def run(self, main: Callable[[], Awaitable[Any]]) -> Any:
        """``main()`` on an event loop of its own, the engines' connections closed on it after."""

        async def run() -> Any:
            try:
                return await main()
            finally:
                for engine in self.engines:
                    await engine.aclose()

        return asyncio.run(run())

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.db.close()


@pytest.fixture(params=["http", "channel"])
def swarm(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalSwarm]:
    """Every test over both bindings: steps hop by hop (HTTP), and over the decode channel."""
    local = LocalSwarm(tmp_path, channels=request.param == "channel")
    try:
        yield local
    finally:
        local.close()


OnStep = Callable[[EngineStep, list[int]], Awaitable[None] | None]


async def generate(
    engine: RouteEngine, n: int, *, prompt: Sequence[int] = PROMPT, on_step: OnStep | None = None,
    params: SamplingParams | None = None,
) -> tuple[list[int], list[EngineStep]]:  # fmt: skip
    """``n`` tokens after ``prompt`` on a fresh route; the tokens and every step the engine emitted.
    ``on_step(step, tokens so far)`` runs after each step (it kills nodes)."""
    tokens: list[int] = []
    steps: list[EngineStep] = []

    async def emit(step: EngineStep) -> None:
        steps.append(step)
        if isinstance(step, TokenStep):
            tokens.append(step.token)
        if on_step is not None:
            done = on_step(step, tokens)
            if done is not None:
                await done
        if len(tokens) >= n:
            raise Stop

    plan = await engine.plan(prompt_tokens=len(prompt), max_tokens=n, prompt=prompt)
    sampler = Sampler(params or SamplingParams(temperature=0.0))
    await engine.generate(prompt, sampler, asyncio.Event(), plan, emit)
    return tokens, steps


def changes(steps: Sequence[EngineStep]) -> list[str]:
    return [s.kind for s in steps if isinstance(s, RouteChange)]


def reference(tmp_path: Path, n: int, prompt: Sequence[int] = PROMPT) -> list[int]:
    """The tokens of an undisturbed run on a swarm of its own."""
    local = LocalSwarm(tmp_path / f"reference-{len(list(tmp_path.glob('reference-*')))}")
    try:

        async def run() -> list[int]:
            await local.layout()
            return (await generate(local.engine(), n, prompt=prompt))[0]

        return local.run(run)
    finally:
        local.close()


def test_a_generation_through_three_hops_is_what_the_hops_compute_and_is_billed(swarm: LocalSwarm) -> None:
    async def run() -> tuple[list[int], list[EngineStep]]:
        await swarm.layout()
        return await generate(swarm.engine(), 12)

    tokens, steps = swarm.run(run)
    assert len(tokens) == 12 and all(0 <= t < VOCAB for t in tokens)
    prefill = [s for s in steps if isinstance(s, PrefillProgress)]
    assert [p.done for p in prefill] == [4, 8, 12, 13] and changes(steps) == []  # the prompt in chunks of 4
    first = next(s for s in steps if isinstance(s, TokenStep))
    assert len(first.hop_ms) == 3  # every hop's entry came back
    for node in swarm.nodes.values():  # every hop freed the session at the end
        assert node.shard.store.ids() == []
    outbox = swarm.engines[0].outbox
    assert outbox.wait_idle(10) and outbox.delivered == 1  # the usage reached the tracker's billing
    # the same route computes the same text every time, chunked or not
    again = LocalSwarm(swarm.tmp_path / "again")
    try:

        async def rerun() -> list[int]:
            await again.layout()
            return (await generate(again.engine(prefill_chunk=8), 12))[0]

        assert again.run(rerun) == tokens
    finally:
        again.close()


def killer(node_id: str, swarm: LocalSwarm, *, after_tokens: int) -> OnStep:
    """Kill ``node_id`` once ``after_tokens`` tokens are out (0: after the first prefill chunk)."""
    killed = []

    def on_step(step: EngineStep, tokens: list[int]) -> None:
        if killed:
            return
        if (after_tokens == 0 and isinstance(step, PrefillProgress)) or (
            after_tokens > 0 and isinstance(step, TokenStep) and len(tokens) == after_tokens
        ):
            swarm.kill(node_id)
            killed.append(node_id)

    return on_step


@pytest.mark.parametrize("dead", ["a", "b", "c"])
@pytest.mark.parametrize("after", range(1, 9))
def test_a_hop_killed_in_decode_is_repaired_and_the_text_goes_on_identically(
    swarm: LocalSwarm, dead: str, after: int
) -> None:
    """Repair at every hop (the head: replayed from the gateway's token ids; the others: from the
    upstream's seam log) after each of the first 8 tokens: a spare of the same layers takes its place."""
    expected = reference(swarm.tmp_path, 10)
    spare = {"a": "0:4", "b": "4:8", "c": "8:12"}[dead]

    async def run() -> tuple[list[int], list[EngineStep]]:
        await swarm.layout()
        engine = swarm.engine()
        # the spare joins once the route is pinned, so the route is the layout's own
        plan_of = engine.plan

        async def plan(**kwargs: Any) -> RoutePlan:
            route = await plan_of(**kwargs)
            if "spare" not in swarm.nodes:
                await swarm.node("spare", spare)
            return route

        engine.plan = plan  # type: ignore[method-assign]
        return await generate(engine, 10, on_step=killer(dead, swarm, after_tokens=after))

    tokens, steps = swarm.run(run)
    assert tokens == expected
    assert changes(steps) == ["repair"]
    repair = next(s for s in steps if isinstance(s, RouteChange))
    assert repair.failed_node == dead and [h.node for h in repair.plan.hops].count("spare") == 1
    # every position the route held before the step that failed: over the channel the tail may have
    # relayed the step after the kill's token before the kill (its answer came first), one more
    held = len(PROMPT) + after - 1
    assert repair.replayed in ((held, held + 1) if swarm.transport.channels else (held,))


def test_a_hop_killed_during_prefill_means_a_fresh_route_from_scratch(swarm: LocalSwarm) -> None:
    expected = reference(swarm.tmp_path, 6)

    async def run() -> tuple[list[int], list[EngineStep]]:
        await swarm.layout(("b2", "4:8"))
        engine = swarm.engine()
        return await generate(engine, 6, on_step=killer("b", swarm, after_tokens=0))

    swarm_nodes = swarm.nodes
    tokens, steps = swarm.run(run)
    assert tokens == expected and changes(steps) == ["reroute"]
    reroute = next(s for s in steps if isinstance(s, RouteChange))
    assert reroute.failed_node == "b" and "b2" in [h.node for h in reroute.plan.hops]
    assert swarm_nodes["b"].shard.store.ids() == []  # the old route's hops (the killed one aside) freed it


def test_the_retry_budget_ends_a_generation_that_keeps_failing(swarm: LocalSwarm) -> None:
    async def run() -> None:
        await swarm.layout(("c2", "8:12"))
        engine = swarm.engine(max_retries=1)
        kills = iter(["c", "c2"])

        def on_step(step: EngineStep, tokens: list[int]) -> None:
            if isinstance(step, TokenStep) and len(tokens) in (1, 2):
                swarm.kill(next(kills))

        await generate(engine, 8, on_step=on_step)

    with pytest.raises(BadGateway, match="gave up after 1 route retries"):
        swarm.run(run)


def test_no_spare_for_a_dead_hop_is_a_stated_failure_not_a_hang(swarm: LocalSwarm) -> None:
    async def run() -> None:
        await swarm.layout()
        await generate(swarm.engine(), 8, on_step=killer("b", swarm, after_tokens=2))

    with pytest.raises(BadGateway, match="no route repair"):
        swarm.run(run)


class Oracle:
    """A draft model that knows the text to come and gets one draft wrong at a depth that moves
    every round (none wrong every ``k + 1``-th round): a rejection at every depth of a verify chunk."""

    def __init__(self, expected: Sequence[int], prompt_length: int) -> None:
        self.expected, self.prompt_length, self.rounds = list(expected), prompt_length, 0

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        at = len(tokens) - self.prompt_length
        drafts = self.expected[at : at + k]
        wrong = self.rounds % (k + 1)
        self.rounds += 1
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % VOCAB
        return drafts


@pytest.fixture
def every_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round carries all its drafts, whatever the route's measured costs say (they pick the
    length that pays: on loopback over fake shards, a matter of timing)."""
    monkeypatch.setattr(WalkCosts, "best_drafts", lambda self, available, q, explore=False, draft_s=0.0: available)


@pytest.mark.usefixtures("every_draft")
def test_verify_rounds_with_rejections_at_every_depth_keep_the_text_identical(swarm: LocalSwarm) -> None:
    """Every verify round's rejected drafts are dropped on every hop, and the text is the undisturbed run's."""
    expected = reference(swarm.tmp_path, 30)
    oracle = Oracle(expected, len(PROMPT))

    async def run() -> tuple[list[int], list[EngineStep]]:
        await swarm.layout()
        # one round at a time: every round asks the oracle once, so its wrong depths come in turn
        # (pipelined rounds, voided and redrafted, are tested in test_pipelined_speculation)
        engine = swarm.engine(speculative="draft", draft_model=oracle, draft_tokens=4, pipeline_rounds=1)
        return await generate(engine, 30)

    tokens, steps = swarm.run(run)
    assert tokens == expected
    rounds = [(s.drafted, s.accepted) for s in steps if isinstance(s, TokenStep) and s.drafted]
    assert {accepted for _, accepted in rounds} >= {0, 1, 2, 3}  # a rejection at every depth
    assert any(accepted == drafted for drafted, accepted in rounds)  # and rounds kept whole


def test_a_second_turn_reuses_the_routes_cached_prompt_blocks_and_computes_the_same(swarm: LocalSwarm) -> None:
    prompt = [*PROMPT, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # 24 positions: five whole blocks of 4 reusable
    expected = reference(swarm.tmp_path, 6, prompt)

    async def run() -> tuple[list[EngineStep], list[EngineStep], list[int]]:
        await swarm.layout()
        engine = swarm.engine()
        _, first = await generate(engine, 6, prompt=prompt)
        tokens, second = await generate(engine, 6, prompt=prompt)
        return first, second, tokens

    first, second, tokens = swarm.run(run)
    assert tokens == expected
    assert all(p.cached == 0 for p in first if isinstance(p, PrefillProgress))
    cached = max(p.cached for p in second if isinstance(p, PrefillProgress))
    assert cached == 20  # every whole block but the one that holds the last token


def test_concurrent_generations_on_one_loop_each_equal_their_solo_run(swarm: LocalSwarm) -> None:
    prompts = [PROMPT, [*PROMPT[3:], 1, 2], [7, *PROMPT]]
    expected = [reference(swarm.tmp_path, 8, p) for p in prompts]

    async def run() -> list[list[int]]:
        await swarm.layout()
        engine = swarm.engine()

        async def one(prompt: Sequence[int]) -> list[int]:
            tokens: list[int] = []

            async def emit(step: EngineStep) -> None:
                if isinstance(step, TokenStep):
                    tokens.append(step.token)
                    if len(tokens) >= 8:
                        raise Stop

            plan = await engine.plan(prompt_tokens=len(prompt), max_tokens=8, prompt=prompt)
            await engine.generate(prompt, Sampler(SamplingParams(temperature=0.0)), asyncio.Event(), plan, emit)
            return tokens

        out = await asyncio.gather(*(one(p) for p in prompts))
        await engine.aclose()
        return list(out)

    assert swarm.run(run) == expected


def test_a_hop_without_room_is_waited_for_and_the_generation_goes_on(swarm: LocalSwarm) -> None:
    expected = reference(swarm.tmp_path, 4)

    async def run() -> tuple[list[int], list[EngineStep]]:
        await swarm.layout()
        tail = swarm.nodes["c"].shard
        held = [f"held{i}" for i in range(tail.store.limits.max_sessions)]
        for sid in held:  # every session slot of the tail taken
            tail.open_session(sid)  # type: ignore[arg-type]

        async def free_later() -> None:
            await asyncio.sleep(0.4)
            tail.close_session(held[0])  # type: ignore[arg-type]

        freeing = asyncio.ensure_future(free_later())
        try:
            return await generate(swarm.engine(room_wait_s=10.0), 4)
        finally:
            await freeing
            with contextlib.suppress(Exception):
                for sid in held[1:]:
                    tail.close_session(sid)  # type: ignore[arg-type]

    tokens, steps = swarm.run(run)
    assert tokens == expected
    waits = changes(steps)
    assert waits and set(waits) == {"wait"}


def test_waiting_for_room_is_bounded_and_ends_in_a_503(swarm: LocalSwarm) -> None:
    async def run() -> None:
        await swarm.layout()
        tail = swarm.nodes["c"].shard
        for i in range(tail.store.limits.max_sessions):
            tail.open_session(f"held{i}")  # type: ignore[arg-type]
        await generate(swarm.engine(room_wait_s=0.5), 4)

    with pytest.raises(Overloaded, match="no room on a route") as refused:
        swarm.run(run)
    assert refused.value.status == 503


def test_cached_blocks_that_disagree_with_the_prompt_are_refused_and_the_prompt_prefilled_cold(
    swarm: LocalSwarm,
) -> None:
    """A hop whose prefix cache holds other KV under the prompt's block hashes (a colliding or
    poisoned entry: here its input digests say so) is caught by the answer's digests: the
    generation prefills cold on a fresh route, with the cold run's text, and says nothing wrong."""
    from meshnet.node.prefix_cache import CachedPrefix

    prompt = [*PROMPT, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    expected = reference(swarm.tmp_path, 6, prompt)

    async def run() -> tuple[list[int], list[EngineStep]]:
        await swarm.layout()
        engine = swarm.engine()
        await generate(engine, 6, prompt=prompt)
        cache = swarm.nodes["b"].prefix_cache
        assert cache is not None
        entries = cache._entries
        for key, held in list(entries.items()):
            if isinstance(held, CachedPrefix):
                entries[key] = dataclasses.replace(held, inputs=tuple(b"\x01" * len(d) for d in held.inputs))
        return await generate(engine, 6, prompt=prompt)

    tokens, steps = swarm.run(run)
    assert tokens == expected
    assert all(p.cached == 0 for p in steps if isinstance(p, PrefillProgress))  # computed cold, all of it


def test_a_tail_answering_a_token_outside_the_vocabulary_is_replaced(swarm: LocalSwarm) -> None:
    """Whatever a tail answers is a claim: a token id the model does not have is a failed tail,
    repaired like a dead one (never handed to the detokenizer)."""
    from meshnet.protocol.messages import HopAnswer, TokenAnswer

    expected = reference(swarm.tmp_path, 6)

    async def run() -> tuple[list[int], list[EngineStep]]:
        await swarm.layout()
        liar = swarm.nodes["c"]
        honest_handle = liar.handle
        lies = []

        async def handle(request: Any, *args: Any, **kwargs: Any) -> HopAnswer | None:
            answer = await honest_handle(request, *args, **kwargs)
            if isinstance(answer, TokenAnswer) and request.start > len(PROMPT) and not lies:
                lies.append(answer.token)  # signed by the liar itself: a lie, not a forgery on the way
                return liar.config.hop_key.sign_answer(request.session, dataclasses.replace(answer, token=VOCAB + 7))
            return answer

        liar.handle = handle  # type: ignore[method-assign]
        await swarm.node("spare", "8:12")
        return await generate(swarm.engine(), 6)

    tokens, steps = swarm.run(run)
    assert tokens == expected
    assert changes(steps) == ["repair"]
    repair = next(s for s in steps if isinstance(s, RouteChange))
    assert repair.failed_node == "c" and "not a token of this model's vocabulary" in repair.reason


def test_a_channel_entry_that_its_signature_does_not_cover_is_found_at_the_end_and_no_node_is_paid(
    tmp_path: Path,
) -> None:
    """Decode answers check the tail's signature at once (it covers the tokens) and the other hops'
    on their latest entries at the end (Usage.check_receipts): a head whose entry (sent straight to
    the gateway over the channel) claims other than it signed leaves the text alone and voids the
    session's pay."""
    from meshnet.protocol.messages import Accepted, HopAnswer

    swarm = LocalSwarm(tmp_path / "forged", channels=True)
    try:
        expected = reference(tmp_path, 6)

        async def run() -> tuple[list[int], list[EngineStep]]:
            await swarm.layout()
            liar = swarm.nodes["a"]
            honest_handle = liar.handle

            async def handle(request: Any, *args: Any, **kwargs: Any) -> HopAnswer:
                answer = await honest_handle(request, *args, **kwargs)
                if isinstance(answer, Accepted) and request.start > len(PROMPT):  # a decode step's entry
                    return dataclasses.replace(answer, hops=(dataclasses.replace(answer.hops[0], compute_ms=0.01),))
                return answer

            liar.handle = handle  # type: ignore[method-assign]
            return await generate(swarm.engine(), 6)

        tokens, steps = swarm.run(run)
        assert tokens == expected and changes(steps) == []
        outbox = swarm.engines[0].outbox
        # nothing billed, nothing sent: the tracker would refuse the forged receipt too (dropped)
        assert outbox.wait_idle(10) and (outbox.delivered, outbox.dropped) == (0, 0)
    finally:
        swarm.close()


@pytest.mark.parametrize("dead", ["a", "b", "c"])
def test_in_a_private_swarm_a_dead_hops_standby_restores_its_kv_snapshot_and_only_the_rest_is_replayed(
    tmp_path: Path, dead: str
) -> None:
    """After a long prompt every hop snapshots its KV to a trusted standby of its layers (the
    tracker names it, with a repair ticket); when the hop dies, the repair prefers that standby,
    which restores the snapshot: only the positions after it are replayed, and the text goes on
    identically. Tickets are checked on every hop all along."""
    from meshnet.gateway.route_engine import SNAPSHOT_MIN_POSITIONS

    prompt = [(7 * i + 3) % VOCAB for i in range(SNAPSHOT_MIN_POSITIONS + 4)]
    swarm = LocalSwarm(tmp_path / "private", private=True)
    try:
        expected = reference(tmp_path, 4, prompt)
        standby = {"a": "0:4", "b": "4:8", "c": "8:12"}[dead]

        async def run() -> tuple[list[int], list[EngineStep]]:
            await swarm.layout(("standby", standby))
            engine = swarm.engine(prefill_chunk=64)
            plan_of = engine.plan

            async def plan(**kwargs: Any) -> RoutePlan:  # the route avoids the standby (a tracker's choice)
                return await plan_of(**{**kwargs, "exclude": [*kwargs.get("exclude", ()), "standby"]})

            engine.plan = plan  # type: ignore[method-assign]
            return await generate(engine, 4, prompt=prompt, on_step=killer(dead, swarm, after_tokens=2))

        tokens, steps = swarm.run(run)
    finally:
        swarm.close()
    assert tokens == expected
    (repair,) = [s for s in steps if isinstance(s, RouteChange)]
    assert repair.kind == "repair" and "standby" in [h.node for h in repair.plan.hops]
    assert repair.replayed == 1  # the snapshot held the prompt; only the first token's position was replayed


class AuditRecorder:
    """Picks every generation for an audit and keeps what the route engine collected for it."""

    def __init__(self) -> None:
        self.jobs: list[Any] = []

    def chosen(self) -> bool:
        return True

    def submit(self, job: Any) -> None:
        self.jobs.append(job)


def test_an_audited_generation_collects_every_hops_seam_log_before_the_route_closes(swarm: LocalSwarm) -> None:
    """Through the engine's own hop client: each hop before the tail hands over what it sent on,
    checked against the output digest it signed; the tail's signed answers are kept."""
    audits = AuditRecorder()

    async def run() -> tuple[list[int], list[EngineStep]]:
        await swarm.layout()
        return await generate(swarm.engine(audits=audits), 6)

    swarm.run(run)
    (job,) = audits.jobs
    assert job is not None and sorted(job.logs) == ["a", "b"] and job.withheld == {}
    assert sum(job.chunks) == len(PROMPT) + 5  # the last token's position was never sent
    assert job.answers and all(entry.node == "c" for entry, _ in job.answers.values())


def test_the_next_step_leaves_before_an_answer_is_checked_and_none_past_max_tokens(tmp_path: Path) -> None:
    """Over the decode channel a plain step's answer sends the next step at once, with its token
    (``RouteEngine._step_ahead``): the checks, the telemetry and the consumer run while the route
    computes. Not after the token ``max_tokens`` ends on: the route computes no step nobody takes."""
    swarm = LocalSwarm(tmp_path / "ahead", channels=True)
    try:
        expected = reference(tmp_path, 6)
        in_flight: list[int] = []

        async def run() -> tuple[list[int], list[EngineStep]]:
            await swarm.layout()
            engine = swarm.engine()
            check = engine._check_tokens

            def counted(answer: Any, run: Any) -> Any:
                in_flight.append(len(run.rounds))
                return check(answer, run)

            engine._check_tokens = counted  # type: ignore[method-assign]
            return await generate(engine, 6)

        tokens, steps = swarm.run(run)
        tail_steps = swarm.nodes["c"].metrics.decode_steps.value
    finally:
        swarm.close()
    assert tokens == expected and changes(steps) == []
    assert in_flight[-5:] == [1, 1, 1, 1, 0]  # the decode answers: the next step out, but after the 6th token
    assert tail_steps == 5


@pytest.mark.parametrize("private", [False, True])
def test_the_tail_relays_each_plain_step_after_the_first_two_and_the_text_is_the_same(
    tmp_path: Path, private: bool
) -> None:
    """Over the decode channel the gateway gives the tail leave (a ``CREDIT``) to send each plain
    step's next step to the head itself, once the answer before it is checked and taken: the gateway
    sends the first two decode steps, the tail every later one up to ``max_tokens`` and none past it;
    with ``relay=False`` the gateway sends them all. The tokens are the same either way (in a private
    swarm too, where the tail relays only to its ticket's head)."""
    expected = reference(tmp_path, 12)
    for relay in (True, False):
        swarm = LocalSwarm(tmp_path / f"relay-{relay}", private=private, channels=True)
        try:
            sent: list[int] = []

            async def run(swarm: LocalSwarm = swarm, relay: bool = relay, sent: list[int] = sent) -> list[int]:
                await swarm.layout()
                start_step = swarm.transport.start_step

                async def counted(route: Sequence[str], request: Any, **kw: Any) -> Any:
                    sent.append(request.start)
                    return await start_step(route, request, **kw)

                swarm.transport.start_step = counted  # type: ignore[method-assign]
                return (await generate(swarm.engine(relay=relay), 12))[0]

            tokens = swarm.run(run)
            tail = swarm.nodes["c"].metrics
            relayed, computed = tail.relayed.value, tail.decode_steps.value
        finally:
            swarm.close()
        assert tokens == expected
        assert computed == 11  # every token but the prefill's, none past max_tokens
        assert (relayed, len(sent)) == ((9, 2) if relay else (0, 11))


def test_the_tail_sends_the_relayed_step_before_it_works_out_and_signs_its_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step after a plain step's token leaves the tail for the head as soon as the token is
    chosen: its commitment and signature come after, off the token's way round the route (each
    relay at a position comes before the answer at that position is signed), and the step's time
    on the tail (its Prometheus counters) ends there. The text is the same."""
    expected = reference(tmp_path, 10)
    events: list[tuple[str, int]] = []
    sign_answer = HopKey.sign_answer

    def signed(self: HopKey, session: str, answer: Any) -> Any:
        events.append(("signed", answer.position))
        return sign_answer(self, session, answer)

    monkeypatch.setattr(HopKey, "sign_answer", signed)
    swarm = LocalSwarm(tmp_path / "early", channels=True)
    try:

        async def run() -> list[int]:
            await swarm.layout()
            tail = swarm.nodes["c"]
            send = tail.channel_send
            assert send is not None

            async def relaying(hop: str, request: Any, direct: Any, timeout: float) -> None:
                events.append(("relayed", request.start))
                await send(hop, request, direct, timeout)

            tail.channel_send = relaying
            count = tail.metrics.decode_step

            def counted(compute_s: float, handle_s: float) -> None:
                events.append(("left", -1))
                count(compute_s, handle_s)

            tail.metrics.decode_step = counted  # type: ignore[method-assign]
            return (await generate(swarm.engine(), 10))[0]

        tokens = swarm.run(run)
        relayed = swarm.nodes["c"].metrics.relayed.value
    finally:
        swarm.close()
    assert tokens == expected
    positions = [at for kind, at in events if kind == "relayed"]
    assert len(positions) == relayed >= 6
    for at in positions:  # the step's time on the tail ends where its next step left: counted there
        sent = events.index(("relayed", at))
        assert events[sent + 1] == ("left", -1) and sent + 1 < events.index(("signed", at)), events


def test_a_channel_step_goes_on_before_its_hop_records_it_and_a_failed_send_still_records_it(
    tmp_path: Path,
) -> None:
    """Over the decode channel a hop records a step (its ledger, its seam log) and makes its entry
    only once the step has gone on — to the next hop, or from the tail the relayed step after it —
    and a step whose send fails is recorded all the same: the route repairs around the failed link,
    every entry the gateway checks still describes what the hop computed, and the text is the same."""
    expected = reference(tmp_path, 12)
    held_at_send: list[tuple[str, int, int]] = []  # (node, the step's start, what its ledger held then)
    swarm = LocalSwarm(tmp_path / "late-record", channels=True)
    try:

        async def run() -> list[int]:
            await swarm.layout(("b2", "4:8"))  # the spare that takes over from b
            for node_id in ("a", "b", "b2", "c"):
                service = swarm.nodes[node_id]
                send = service.channel_send
                assert send is not None

                def watching(service: NodeService = service, send: Any = send, node_id: str = node_id) -> Any:
                    async def sending(hop: str, request: Any, direct: Any, timeout: float) -> None:
                        held = service._existing(request.session).ledger.describe()["held"]
                        start = request.start - (node_id == "c")  # the tail relays the step after its own
                        held_at_send.append((node_id, start, int(held)))
                        if node_id == "a" and start == len(PROMPT) + 5:
                            raise HopFailed("the link to the next hop broke", failed_hop=hop)
                        await send(hop, request, direct, timeout)

                    return sending

                service.channel_send = watching()
            return (await generate(swarm.engine(), 12))[0]

        tokens = swarm.run(run)
    finally:
        swarm.close()
    assert tokens == expected
    decode = [(node, start, held) for node, start, held in held_at_send if start >= len(PROMPT)]
    assert {node for node, _, _ in decode} >= {"a", "b", "c"}
    assert all(held == start for _, start, held in decode), decode  # not yet recorded when it went


def test_a_route_where_drafts_do_not_pay_relays_its_steps_and_still_re_probes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft model whose chunks do not pay on the route: it is not asked for drafts, the tail
    relays the plain steps, and the decision a re-probe rides on — taken where the gateway gives the
    tail its leave — still sends one probe (a chunk of 2) after 16 declined steps. Before, the
    relayed steps were never a decision, and a route measured in a bad moment never drafted again."""
    expected = reference(tmp_path, 40)

    class Costly(WalkCosts):  # a route whose 3-position chunk was measured at 25 plain steps
        def __init__(self) -> None:
            super().__init__()
            for _ in range(5):
                self.observe(1, 0.001, 0.002)
                self.observe(3, 0.050, 0.051)

    class Oracle:
        def __init__(self) -> None:
            self.asked: list[int] = []

        def draft(self, tokens: Sequence[int], k: int) -> list[int]:
            self.asked.append(k)
            at = len(tokens) - len(PROMPT)
            return expected[at : at + k]

    monkeypatch.setattr("meshnet.gateway.route_engine.WalkCosts", Costly)
    oracle = Oracle()
    swarm = LocalSwarm(tmp_path / "re-probe", channels=True)
    try:

        async def run() -> list[int]:
            await swarm.layout()
            return (await generate(swarm.engine(speculative="draft", draft_model=oracle, draft_tokens=4), 40))[0]

        tokens = swarm.run(run)
        relayed = swarm.nodes["c"].metrics.relayed.value
    finally:
        swarm.close()
    assert tokens == expected
    assert oracle.asked.count(2) in (1, 2), oracle.asked  # the probe (a second one only if decisions doubled)
    assert set(oracle.asked) <= {1, 2}, oracle.asked  # besides it, only the model's read of the prompt
    assert relayed >= 30, relayed


def test_a_leave_to_relay_is_for_one_step_of_the_tails_own_session_route_and_head(tmp_path: Path) -> None:
    """A node takes a ``CREDIT`` only as the tail of a session it holds, on the session's route,
    naming the head its ticket names; it is kept until the tail answers a step, which uses it up
    whether or not it is the step the credit follows (here it is not: nothing is relayed)."""
    expected = reference(tmp_path, 5)
    swarm = LocalSwarm(tmp_path / "credit", private=True, channels=True)
    held: list[Credit | None] = []
    try:

        async def run() -> list[int]:
            await swarm.layout()
            tail, middle = swarm.nodes["c"], swarm.nodes["b"]

            def on_step(step: EngineStep, tokens: list[int]) -> None:
                if not isinstance(step, TokenStep) or len(tokens) not in (2, 3):
                    return
                (sid,) = tail.shard.store.ids()
                session = tail._bound(sid)
                assert session is not None
                if len(tokens) == 3:  # the step after the credit was answered: it is used up
                    held.append(session.credit)
                    return
                credit = Credit(sid, 10_000, 10_001, "https://a.local:7000", ("r",), None, session.route_id,
                                frozenset())  # fmt: skip
                with pytest.raises(SessionNotFound):
                    tail.take_credit(dataclasses.replace(credit, session="ses-unknown"))
                with pytest.raises(InvalidRequest, match="not a tail"):
                    middle.take_credit(credit)
                with pytest.raises(Conflict, match="pinned to route"):
                    tail.take_credit(dataclasses.replace(credit, route_id="rte-other"))
                with pytest.raises(Forbidden, match="only to its route's head"):
                    tail.take_credit(dataclasses.replace(credit, head="https://b.local:7000"))
                tail.take_credit(credit)
                held.append(session.credit)

            return (await generate(swarm.engine(relay=False), 5, on_step=on_step))[0]

        tokens = swarm.run(run)
        relayed = swarm.nodes["c"].metrics.relayed.value
    finally:
        swarm.close()
    assert tokens == expected
    assert held[0] is not None and held[0].after == 10_000 and held[1:] == [None]
    assert relayed == 0  # the step it named never came


@pytest.mark.parametrize("refused", [3, 1000])
def test_a_tail_that_leaves_three_leaves_unused_gets_none_for_a_while_then_again(tmp_path: Path, refused: int) -> None:
    """A tail that refuses ``CREDIT`` frames (an older node, one that cannot reach its head, a leave
    that came after its step on a loaded machine) costs the generation three refused credits, then
    none for 8 tokens, then three more and none for 16: the gateway sends those steps itself, with
    the same tokens. Once the tail takes leaves again (``refused=3``), it relays the steps after."""
    expected = reference(tmp_path, 40)
    swarm = LocalSwarm(tmp_path / f"refusing-{refused}", channels=True)
    offered: list[int] = []  # the step each leave followed
    try:

        async def run() -> list[int]:
            await swarm.layout()
            tail = swarm.nodes["c"]
            take = tail.take_credit

            def refuse(credit: Credit, caller: str | None = None) -> None:
                offered.append(credit.after)
                if len(offered) <= refused:
                    raise InvalidRequest("this node takes no CREDIT frames")
                take(credit, caller)

            tail.take_credit = refuse  # type: ignore[method-assign]
            return (await generate(swarm.engine(), 40))[0]

        tokens = swarm.run(run)
        relayed = swarm.nodes["c"].metrics.relayed.value
    finally:
        swarm.close()
    assert tokens == expected
    # step numbers: an unused leave's step number is skipped, a relayed step's is the next leave's
    gaps = [b - a for a, b in itertools.pairwise(offered)]
    if refused == 3:
        assert gaps[:2] == [2, 2] and gaps[2] > 8, f"{offered}"  # the gateway sent 8 steps, then gave leave again
        assert relayed == len(offered) - 3 > 25 and set(gaps[3:]) == {1}, f"{offered}"
    else:
        assert relayed == 0 and gaps[:2] == [2, 2] == gaps[3:5] and 8 < gaps[2] < 16 < gaps[5], f"{offered}"


def test_a_step_ahead_the_consumer_never_takes_is_drained_and_the_route_closes(tmp_path: Path) -> None:
    """A stop the engine cannot see coming (a stop string, a client gone) leaves a step ahead in
    flight: it is drained like a void round before the route closes, and nothing of it is billed."""
    swarm = LocalSwarm(tmp_path / "stopped", channels=True)
    try:
        expected = reference(tmp_path, 3)

        async def run() -> list[int]:
            await swarm.layout()
            engine = swarm.engine()
            plan_of = engine.plan

            async def plan(**kwargs: Any) -> RoutePlan:  # the consumer asked for more than it takes
                return await plan_of(**{**kwargs, "max_tokens": 50})

            engine.plan = plan  # type: ignore[method-assign]
            tokens, _ = await generate(engine, 3)
            return tokens

        tokens = swarm.run(run)
        tail = swarm.nodes["c"]
        computed = tail.metrics.decode_steps.value
        open_sessions = len(tail.shard.store)
    finally:
        swarm.close()
    assert tokens == expected
    assert computed == 3  # two steps taken, one ahead and drained
    assert open_sessions == 0
