"""Prefix caching on the nodes (node.prefix_cache, node.service): the cache itself, and chains of
node services over the in-process transport with the fake shard of test_node_service, whose every
output depends on everything its session holds — so KV adopted from a wrong, stale or partial
entry changes the tokens, and each test compares whole token sequences against a cold run.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from meshnet.errors import Conflict, InvalidRequest
from meshnet.ids import SessionId
from meshnet.node.prefix_cache import CachedPrefix, PrefixCache
from meshnet.node.service import NodeConfig, NodeService
from meshnet.protocol import http_binding
from meshnet.protocol.ledger import ChunkLedger, verify_hops
from meshnet.protocol.messages import (
    AnswerKind,
    HopRequest,
    PrefixClaim,
    PrefixRequest,
    RerouteRequest,
    TokenAnswer,
    Verb,
)
from meshnet.protocol.prefix import block_hashes
from meshnet.routes import Hop
from tests.unit.test_node_service import MixShard, Swarm, every_state_live, ids_payload

BLOCK = 4
ROUTE = ["http://head", "http://middle", "http://tail"]
LAYERS = ["0:4", "4:8", "8:12"]
SYSTEM = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]  # three blocks


# -- the cache -------------------------------------------------------------------------------------
def entry(tokens: Sequence[int], size: int = 100) -> CachedPrefix:
    hashes = tuple(block_hashes(tokens, BLOCK))
    n = len(hashes)
    return CachedPrefix(BLOCK, hashes, bytes(size), (b"i" * 16,) * n, (b"o" * 16,) * n, bytes(8 * n * BLOCK), "f32")


def test_a_lookup_finds_the_longest_cached_run_of_leading_blocks_within_its_limit() -> None:
    cache = PrefixCache(10_000)
    assert cache.add(entry(SYSTEM))
    asked = tuple(block_hashes([*SYSTEM, 1, 2, 3, 4], BLOCK))
    found = cache.lookup(BLOCK, asked, limit=4)
    assert found is not None and found[1] == 3
    capped = cache.lookup(BLOCK, asked, limit=2)
    assert capped is not None and capped[1] == 2
    other = tuple(block_hashes([1, *SYSTEM[1:]], BLOCK))  # the first token differs: every block does
    assert cache.lookup(BLOCK, other, limit=3) is None
    assert cache.lookup(BLOCK, asked, limit=0) is None
    assert cache.stats.hits == 2 and cache.stats.misses == 2


def test_an_entry_that_extends_another_replaces_it_and_a_shorter_one_adds_nothing() -> None:
    cache = PrefixCache(10_000)
    cache.add(entry(SYSTEM[:8]))
    cache.add(entry(SYSTEM))
    assert len(cache) == 1 and cache.used == entry(SYSTEM).nbytes
    assert cache.add(entry(SYSTEM[:4]))  # already held inside the longer one
    assert len(cache) == 1
    assert cache.touch(tuple(block_hashes(SYSTEM[:8], BLOCK)))


def test_two_conversations_sharing_a_system_prompt_both_find_it_and_eviction_keeps_the_survivor_indexed() -> None:
    cache = PrefixCache(10_000)
    a, b = entry([*SYSTEM, 1, 1, 1, 1]), entry([*SYSTEM, 2, 2, 2, 2])
    cache.add(a)
    cache.add(b)
    system = tuple(block_hashes(SYSTEM, BLOCK))
    found = cache.lookup(BLOCK, system, limit=3)
    assert found is not None and found[1] == 3
    cache._drop(found[0].hashes[-1])  # whichever held the index: the other still serves the system prompt
    again = cache.lookup(BLOCK, system, limit=3)
    assert again is not None and again[1] == 3


def test_an_entry_computed_from_other_inputs_than_its_hashes_say_is_replaced_by_an_honest_one() -> None:
    """A member that names one prompt's blocks while computing another's leaves KV under the wrong
    hashes; the digests differ from an honest session's, which replaces it (and a longer honest
    entry sharing only a system prompt with it is kept)."""
    cache = PrefixCache(10_000)
    honest = entry(SYSTEM)
    poisoned = dataclasses.replace(honest, inputs=(b"x" * 16,) * 3)
    cache.add(poisoned)
    assert not cache.agrees(honest.hashes, honest.inputs, honest.outputs)
    assert cache.agrees(poisoned.hashes, poisoned.inputs, poisoned.outputs)
    cache.add(honest)
    assert cache.agrees(honest.hashes, honest.inputs, honest.outputs)
    found = cache.lookup(BLOCK, honest.hashes, limit=3)
    assert found is not None and found[0] is honest and len(cache) == 1
    cache.add(entry([*SYSTEM[:4], 1, 1, 1, 1]))  # shares block 0 with it, with the same digest: both stay
    assert len(cache) == 2


def test_least_recently_used_entries_go_first_and_an_entry_over_the_budget_is_refused() -> None:
    one, two, three = entry([1] * 8), entry([2] * 8), entry([3] * 8)
    cache = PrefixCache(one.nbytes * 2)
    cache.add(one)
    cache.add(two)
    assert cache.lookup(BLOCK, one.hashes, limit=2) is not None  # one is now the most recent
    cache.add(three)
    assert cache.lookup(BLOCK, two.hashes, limit=2) is None
    assert cache.lookup(BLOCK, one.hashes, limit=2) is not None
    assert cache.used <= cache.budget_bytes and cache.stats.evicted == 1
    assert not PrefixCache(10).add(one)
    filter_ = cache.filter()
    assert all(h in filter_ for h in one.hashes + three.hashes)


def test_a_prefix_header_round_trips_and_a_bad_one_is_a_clear_400() -> None:
    claim = PrefixClaim(BLOCK, tuple(block_hashes(SYSTEM, BLOCK)))
    request = PrefixRequest(
        SessionId("s"), claim, 2, "r1", model="mix", next_hops=("http://b",), sampling='{"seed": 1}'
    )
    path, headers = http_binding.encode_prefix(request)
    assert path == "/v1/sessions/s/prefix"
    assert http_binding.decode_prefix(SessionId("s"), headers) == request
    with pytest.raises(InvalidRequest, match=r"X-Meshnet-Reuse must be 0\.\.3"):
        http_binding.decode_prefix(SessionId("s"), {**headers, "X-Meshnet-Reuse": "4"})
    with pytest.raises(InvalidRequest, match="X-Meshnet-Prefix"):
        http_binding.decode_prefix(SessionId("s"), {**headers, "X-Meshnet-Prefix": "4:zz"})
    with pytest.raises(InvalidRequest, match="X-Meshnet-Route-Id"):
        http_binding.decode_prefix(SessionId("s"), {k: v for k, v in headers.items() if k != "X-Meshnet-Route-Id"})


# -- on a chain of nodes ---------------------------------------------------------------------------
class Gateway:
    """Plays the gateway's part (gateway.route_engine): canonical chunks of ``BLOCK``, the prompt's
    blocks on the first request or a prefix request, the digest check, greedy decode, DELETE."""

    def __init__(self, swarm: Swarm, route: Sequence[str] = ROUTE) -> None:
        self.swarm, self.route = swarm, list(route)
        self.count = 0

    async def generate(self, prompt: Sequence[int], n: int, *, reuse: bool = True) -> tuple[list[int], int]:
        """``n`` greedy tokens after ``prompt`` on a new session, and the positions reused."""
        self.count += 1
        sid = SessionId(f"s{self.count}")
        claim = PrefixClaim(BLOCK, tuple(block_hashes(prompt, BLOCK)))
        ledger = ChunkLedger(sends=False)
        for begin in range(0, len(prompt), BLOCK):
            ledger.record(
                len(prompt[begin : begin + BLOCK]), np.asarray(prompt[begin : begin + BLOCK], "<i4").tobytes()
            )
        head = self.route[0]
        start = 0
        if reuse:
            limit = min(len(claim.hashes), (len(prompt) - 1) // BLOCK)
            request = PrefixRequest(sid, claim, limit, "r1", model="mix", next_hops=tuple(self.route[1:]))
            answer = await self.swarm.transport.send(head, request, timeout_s=5)
            assert answer.kind is AnswerKind.CACHED
            start = answer.count
            expected = ChunkLedger(False, list(ledger.ends), list(ledger.inputs))
            expected.rewind(start)
            verify_hops(expected, [Hop(u, u, None) for u in self.route], answer.hops)  # type: ignore[arg-type]
        token = None
        for begin in range(start, len(prompt), BLOCK):
            part = prompt[begin : begin + BLOCK]
            final = begin + BLOCK >= len(prompt)
            first = begin == 0
            req = HopRequest(
                Verb.PREFILL, sid, begin, len(part), ids_payload(part), model="mix", route_id="r1",
                next_hops=tuple(self.route[1:]) if first else None, sample=final, prefix=claim if first else None,
            )  # fmt: skip
            answer = await self.swarm.send(head, req)
            token = answer.token if isinstance(answer, TokenAnswer) else None
        assert token is not None
        tokens = [token]
        while len(tokens) < n:
            step = HopRequest(Verb.DECODE, sid, len(prompt) + len(tokens) - 1, 1, ids_payload(tokens[-1:]),
                              route_id="r1")  # fmt: skip
            answer = await self.swarm.send(head, step)
            assert isinstance(answer, TokenAnswer)
            tokens.append(answer.token)
        await self.swarm.services(head).delete(sid)
        return tokens, start


class PrefixSwarm(Swarm):
    def node(self, url: str, layers: str, **kwargs: object) -> NodeService:
        budget = int(kwargs.pop("prefix_cache_bytes", 1 << 20))  # type: ignore[call-overload]
        config = NodeConfig(node_id=url, url=url, prefix_cache_bytes=budget)
        service = NodeService(MixShard(layers, **kwargs), config, self.transport)  # type: ignore[arg-type]
        self.transport.add(url, service)
        return service

    def services(self, url: str) -> NodeService:
        return self.transport.services[url]


def build(**budgets: int) -> PrefixSwarm:
    swarm = PrefixSwarm()
    for url, layers in zip(ROUTE, LAYERS, strict=True):
        name = url.removeprefix("http://")
        swarm.node(url, layers, prefix_cache_bytes=budgets.get(name, 1 << 20))
    return swarm


def cold(prompt: Sequence[int], n: int) -> list[int]:
    tokens, _ = asyncio.run(Gateway(build()).generate(prompt, n, reuse=False))
    return tokens


def test_the_next_turn_of_a_conversation_reuses_its_history_and_gives_the_cold_runs_tokens() -> None:
    turn1 = [*SYSTEM, 40, 41]
    swarm = build()
    gateway = Gateway(swarm)

    async def main() -> tuple[list[int], list[int], int]:
        first, reused = await gateway.generate(turn1, 6)
        assert reused == 0  # nothing was cached yet
        turn2 = [*turn1, *first, 42, 43, 44]
        second, reused = await gateway.generate(turn2, 6)
        return turn2, second, reused

    turn2, second, reused = asyncio.run(main())
    assert reused == 12  # the three full blocks of turn 1's prompt; its last two tokens and the answer are new
    assert second == cold(turn2, 6)
    for url in ROUTE:
        stats = swarm.services(url).prefix_cache.describe()  # type: ignore[union-attr]
        assert stats["hits"] == 1 and stats["reused_positions"] == 12


def test_a_route_reuses_only_what_every_hop_holds_and_the_hops_before_drop_the_rest() -> None:
    swarm = build()
    gateway = Gateway(swarm)
    prompt = [*SYSTEM, 40, 41, 42, 43, 44]  # four full blocks
    shorter = _shorter(prompt)

    async def main() -> tuple[list[int], int]:
        await gateway.generate(prompt, 3)
        tail = swarm.services(ROUTE[2]).prefix_cache
        assert tail is not None
        tail.clear()
        tail.add(shorter)  # the tail holds two blocks only
        return await gateway.generate([*prompt, 49], 5)

    tokens, reused = asyncio.run(main())
    assert reused == 2 * BLOCK
    assert tokens == cold([*prompt, 49], 5)


def _shorter(prompt: Sequence[int]) -> CachedPrefix:
    """The tail's entry for ``prompt``'s first two blocks, as a cold session elsewhere leaves it."""
    other = build()
    asyncio.run(Gateway(other).generate(prompt[: 2 * BLOCK + 1], 2, reuse=False))
    tail = other.services(ROUTE[2])
    cache = tail.prefix_cache
    assert cache is not None and len(cache) == 1
    held = next(iter(cache._entries.values()))
    assert isinstance(held, CachedPrefix) and held.parked is not None  # in the other tail's shard: write it out
    store = tail.shard.store
    with store.pinned(held.parked) as state:
        assert store.demote is not None
        blob = store.demote(state, held.parked.position)
    return dataclasses.replace(held, snapshot=blob, parked=None)


def test_two_conversations_share_a_long_system_prompts_kv() -> None:
    swarm = build()
    gateway = Gateway(swarm)

    async def main() -> list[tuple[list[int], int]]:
        await gateway.generate([*SYSTEM, 1, 2], 3)
        return [await gateway.generate([*SYSTEM, 5, 6, 7], 4)]

    [(tokens, reused)] = asyncio.run(main())
    assert reused == len(SYSTEM)
    assert tokens == cold([*SYSTEM, 5, 6, 7], 4)


def test_under_a_tiny_budget_nothing_is_kept_and_the_next_turn_prefills_cold_with_the_same_tokens() -> None:
    swarm = build(middle=64)
    gateway = Gateway(swarm)
    prompt = [*SYSTEM, 1, 2]

    async def main() -> tuple[list[int], int]:
        await gateway.generate(prompt, 3)
        assert len(swarm.services(ROUTE[1]).prefix_cache) == 0  # type: ignore[arg-type]
        return await gateway.generate([*prompt, 9, 9], 4)

    tokens, reused = asyncio.run(main())
    assert reused == 0
    assert tokens == cold([*prompt, 9, 9], 4)


def _after_one_turn(evicting: Callable[[NodeService, PrefixCache], None]) -> tuple[list[int], int]:
    """A conversation's turn; then live sessions take every state of the middle's shard (the turn's
    parked KV yields), ``evicting`` checks what that did to the middle's cache; then the next turn:
    its tokens and the positions it reused."""
    swarm = build()
    gateway = Gateway(swarm)
    prompt = [*SYSTEM, 1, 2]
    middle = swarm.services(ROUTE[1])
    cache = middle.prefix_cache
    assert cache is not None

    async def main() -> tuple[list[int], int]:
        await gateway.generate(prompt, 3)
        parked = cache.describe()
        assert (parked["parked"], parked["parked_positions"]) == (1, 12)  # no host copy of the KV
        [held] = cache._entries.values()
        assert isinstance(held, CachedPrefix) and held.snapshot == b""  # host memory: seam log and digests only
        assert middle.shard.store.parked_count() == 1 and len(middle.shard.store) == 0
        evicting(middle, cache)
        return await gateway.generate([*prompt, 9, 9], 4)

    tokens, reused = asyncio.run(main())
    assert tokens == cold([*prompt, 9, 9], 4)
    return tokens, reused


def test_kept_blocks_stay_parked_in_the_shard_and_yield_to_live_sessions_then_serve_from_host_memory() -> None:
    def evicting(middle: NodeService, cache: PrefixCache) -> None:
        before = cache.used
        with every_state_live(middle):  # the 4th live session takes the parked state's room
            stats = cache.describe()
        assert (stats["parked"], stats["entries"], stats["demoted"]) == (0, 1, 1)  # now in host memory
        assert stats["bytes"] > before

    _, reused = _after_one_turn(evicting)
    assert reused == len(SYSTEM)  # every hop served it: the middle from host memory, the others parked


def test_a_parked_entry_evicted_with_no_host_room_is_dropped_and_the_next_turn_prefills_cold() -> None:
    def evicting(middle: NodeService, cache: PrefixCache) -> None:
        cache.budget_bytes = cache.used  # room for what it holds in host memory, not for its KV too
        with every_state_live(middle):
            assert (len(cache), cache.describe()["evicted"]) == (0, 1)
            assert middle.shard.store.parked_count() == 0

    _, reused = _after_one_turn(evicting)
    assert reused == 0


def test_a_broken_session_and_blocks_computed_in_other_chunks_are_never_cached() -> None:
    swarm = build()

    async def main() -> None:
        head = swarm.services(ROUTE[0])
        claim = PrefixClaim(BLOCK, tuple(block_hashes(SYSTEM, BLOCK)))
        sid = SessionId("odd")
        # a first chunk of 6: block 0 and 1 are not the chunks a cold prefill computes them in
        for begin, end in ((0, 6), (6, 12)):
            req = HopRequest(
                Verb.PREFILL, sid, begin, end - begin, ids_payload(SYSTEM[begin:end]), model="mix", route_id="r1",
                next_hops=tuple(ROUTE[1:]) if begin == 0 else None, sample=end == 12,
                prefix=claim if not begin else None,
            )  # fmt: skip
            await swarm.send(ROUTE[0], req)
        await head.delete(sid)
        assert all(len(swarm.services(u).prefix_cache) == 0 for u in ROUTE)  # type: ignore[arg-type]
        # a session broken by a dead hop keeps nothing either
        swarm.transport.remove(ROUTE[2])
        sid = SessionId("broken")
        req = HopRequest(Verb.PREFILL, sid, 0, 4, ids_payload(SYSTEM[:4]), model="mix", route_id="r1",
                         next_hops=tuple(ROUTE[1:]), sample=True, prefix=claim)  # fmt: skip
        with pytest.raises(Exception):  # noqa: B017 - the dead tail's failure, named as such elsewhere
            await swarm.send(ROUTE[0], req)
        await head.delete(sid)
        assert len(head.prefix_cache) == 0  # type: ignore[arg-type]

    asyncio.run(main())


def test_a_prefix_request_is_a_sessions_first_request_only() -> None:
    swarm = build()

    async def main() -> None:
        claim = PrefixClaim(BLOCK, tuple(block_hashes(SYSTEM, BLOCK)))
        request = PrefixRequest(SessionId("p"), claim, 2, "r1", model="mix", next_hops=tuple(ROUTE[1:]))
        answer = await swarm.transport.send(ROUTE[0], request, timeout_s=5)
        assert answer.kind is AnswerKind.CACHED and answer.count == 0 and len(answer.hops) == 3
        with pytest.raises(Conflict, match="first request"):
            await swarm.services(ROUTE[0]).prefix(request)

    asyncio.run(main())


def test_a_session_that_reused_cached_blocks_can_still_have_a_dead_tail_rebuilt_from_the_seam_log() -> None:
    swarm = build()
    gateway = Gateway(swarm)
    prompt = [*SYSTEM, 1, 2]
    longer = [*prompt, 3, 4, 5]

    async def main() -> list[int]:
        await gateway.generate(prompt, 2)
        sid = SessionId("repaired")
        claim = PrefixClaim(BLOCK, tuple(block_hashes(longer, BLOCK)))
        request = PrefixRequest(sid, claim, 3, "r1", model="mix", next_hops=tuple(ROUTE[1:]))
        answer = await swarm.transport.send(ROUTE[0], request, timeout_s=5)
        assert answer.count == 12
        final = await swarm.send(ROUTE[0], HopRequest(Verb.PREFILL, sid, 12, 5, ids_payload(longer[12:]),
                                                      model="mix", route_id="r1", sample=True))  # fmt: skip
        assert final.token is not None
        tokens = [final.token]
        position = len(longer)
        swarm.transport.remove(ROUTE[2])
        swarm.node("http://spare", "8:12")
        reroute = RerouteRequest(sid, ("http://spare",), "r1", model="mix", replay=1, step=position)
        step = HopRequest(Verb.DECODE, sid, position, 1, ids_payload(tokens), route_id="r1")
        with pytest.raises(Exception):  # noqa: B017 - the dead tail
            await swarm.send(ROUTE[0], step)
        answer = await swarm.services(ROUTE[1]).reroute(reroute)
        assert answer.token is not None
        tokens.append(answer.token)
        cleared = RerouteRequest(sid, (ROUTE[1], "http://spare"), "r1", step=position)
        await swarm.services(ROUTE[0]).reroute(cleared)
        while len(tokens) < 5:
            step = HopRequest(Verb.DECODE, sid, position + len(tokens) - 1, 1, ids_payload(tokens[-1:]), route_id="r1")
            got = await swarm.send(ROUTE[0], step)
            assert got.token is not None
            tokens.append(got.token)
        return tokens

    assert asyncio.run(main()) == cold(longer, 5)
