"""The node service (node.service) over the in-process transport with fake shards: pipelining,
decode, verify, route repair, rewind and the failure paths, in milliseconds.

The fake shard's output at a position depends on every position its session holds before it, so
a hop that misses, repeats or keeps a stale position changes the tokens: these tests compare whole
token sequences, as the real-process tests do with llama.cpp.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from meshnet.backends.fake_shard import VOCAB, MixShard
from meshnet.errors import (
    Conflict,
    HopFailed,
    InvalidRequest,
    MeshnetError,
    SeamMismatch,
    SessionBroken,
    SessionBusy,
    SessionGone,
    SessionNotFound,
    Unauthorized,
)
from meshnet.ids import RouteId, SessionId
from meshnet.node.service import NodeConfig, NodeService
from meshnet.protocol.hops import LocalTransport
from meshnet.protocol.messages import (
    AnswerKind,
    HopAnswer,
    HopRequest,
    Payload,
    RerouteRequest,
    TokenAnswer,
    Verb,
    ids_payload,
)
from meshnet.protocol.tickets import TicketHop, TicketSigner, TicketVerifier, repair_ticket, route_ticket
from meshnet.protocol.wire import encode_tensor

SID = SessionId("s1")


@contextlib.contextmanager
def every_state_live(node: NodeService) -> Iterator[None]:
    """Live sessions in every state of ``node``'s shard (the KV it keeps parked yields its room to
    them), closed again on the way out."""
    live = [SessionId(f"live{i}") for i in range(node.shard.store.limits.max_sessions)]
    for sid in live:
        node.shard.open_session(sid)
    try:
        yield
    finally:
        for sid in live:
            node.shard.close_session(sid)


class Swarm:
    """Hop services by URL over one ``LocalTransport``; the test plays the gateway."""

    def __init__(self) -> None:
        self.transport = LocalTransport()

    def node(self, url: str, layers: str, **kwargs: object) -> NodeService:
        service = NodeService(MixShard(layers, **kwargs), NodeConfig(node_id=url, url=url), self.transport)  # type: ignore[arg-type]
        self.transport.add(url, service)
        return service

    async def send(self, hop: str, request: HopRequest) -> HopAnswer:
        return await self.transport.send(hop, request, timeout_s=5)


def prefill(
    tokens: Sequence[int], start: int, *, route: Sequence[str], final: bool, first: bool, route_id: str = "r1"
) -> HopRequest:
    return HopRequest(
        Verb.PREFILL, SID, start, len(tokens), ids_payload(tokens), model="mix", route_id=route_id,
        next_hops=tuple(route[1:]) if first else None, sample=final,
    )  # fmt: skip


def step(token: int, position: int, *, drafts: Sequence[int] = (), rewind: bool = False) -> HopRequest:
    verb = Verb.VERIFY if drafts else Verb.DECODE
    payload = ids_payload([token, *drafts])
    return HopRequest(verb, SID, position, 1 + len(drafts), payload, route_id="r1", drafts=tuple(drafts), rewind=rewind)


PROMPT = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]


async def generate(swarm: Swarm, route: Sequence[str], n: int, *, chunk: int = 4) -> list[int]:
    """Prefill ``PROMPT`` in chunks, then ``n`` greedy steps; the tokens."""
    head = route[0]
    answer = None
    for start in range(0, len(PROMPT), chunk):
        final = start + chunk >= len(PROMPT)
        req = prefill(PROMPT[start : start + chunk], start, route=route, final=final, first=start == 0)
        answer = await swarm.send(head, req)
        assert answer.kind is (AnswerKind.TOKEN if final else AnswerKind.ACCEPTED)
    assert isinstance(answer, TokenAnswer)
    out = [answer.token]
    return await decode(swarm, head, out, n)


async def decode(swarm: Swarm, head: str, tokens: list[int], n: int) -> list[int]:
    """Greedy steps after ``PROMPT`` and ``tokens`` until there are ``n`` tokens; ``tokens``, grown."""
    while len(tokens) < n:
        answer = await swarm.send(head, step(tokens[-1], len(PROMPT) + len(tokens) - 1))
        assert isinstance(answer, TokenAnswer)
        tokens.append(answer.token)
    return tokens


def chain(swarm: Swarm, **kwargs: object) -> list[str]:
    urls = ["http://head", "http://middle", "http://tail"]
    for url, layers in zip(urls, ["0:4", "4:8", "8:12"], strict=True):
        swarm.node(url, layers, **kwargs)
    return urls


def reference(n: int) -> list[int]:
    swarm = Swarm()
    return asyncio.run(generate(swarm, chain(swarm), n))


def test_a_pipelined_prefill_and_decode_through_three_hops_answer_with_every_hops_entry() -> None:
    swarm = Swarm()
    route = chain(swarm)

    async def main() -> HopAnswer:
        first = await swarm.send(route[0], prefill(PROMPT[:4], 0, route=route, final=False, first=True))
        assert first.kind is AnswerKind.ACCEPTED and first.status == 202
        assert [h.node for h in first.hops] == ["http://head"]  # answered before the others computed it
        await swarm.send(route[0], prefill(PROMPT[4:], 4, route=route, final=True, first=False))
        return await swarm.send(route[0], step(7, len(PROMPT)))

    answer = asyncio.run(main())
    assert answer.kind is AnswerKind.TOKEN and answer.position == len(PROMPT) + 1
    assert [h.node for h in answer.hops] == route
    assert [h.held for h in answer.hops] == [len(PROMPT) + 1] * 3
    # every hop computed from exactly what the one before it sent
    assert answer.hops[1].input_digest == answer.hops[0].output_digest
    assert answer.hops[2].input_digest == answer.hops[1].output_digest
    tokens = reference(12)
    assert len(set(tokens)) > 3  # the fake model's tokens do vary


def test_the_token_sequence_does_not_depend_on_the_prefill_chunking() -> None:
    swarm = Swarm()
    assert asyncio.run(generate(swarm, chain(swarm), 10, chunk=3)) == reference(10)


def test_a_dead_next_hop_breaks_the_session_on_every_hop_before_it_and_names_the_hop() -> None:
    swarm = Swarm()
    route = chain(swarm)

    async def main() -> None:
        tokens = await generate(swarm, route, 3)
        swarm.transport.remove(route[2])
        with pytest.raises(HopFailed) as failed:
            await swarm.send(route[0], step(tokens[-1], len(PROMPT) + 2))
        assert failed.value.failed_hop == route[2]
        # later requests get the reason instead of diverging, naming the same hop
        with pytest.raises(HopFailed, match="broken") as again:
            await swarm.send(route[0], step(tokens[-1], len(PROMPT) + 3))
        assert again.value.failed_hop == route[2]
        middle = swarm.transport.services[route[1]]
        activations = Payload(encode_tensor(np.zeros((1, 1, 2), dtype=np.float32), "float32"))
        with pytest.raises(SessionBroken):
            await middle.handle(HopRequest(Verb.DECODE, SID, len(PROMPT) + 3, 1, activations))

    asyncio.run(main())


class BlamingHop:
    """A hop that fails every decode step naming ``blamed`` as the failed hop (a liar, when that is
    not a hop after it); everything else goes to the real service."""

    def __init__(self, service: NodeService, blamed: str) -> None:
        self.service, self.blamed = service, blamed

    def __getattr__(self, name: str) -> object:
        return getattr(self.service, name)

    async def handle(self, request: HopRequest) -> HopAnswer:
        if request.verb is Verb.DECODE:
            raise SessionBroken("session broken on this node", failed_hop=self.blamed)
        return await self.service.handle(request)


@pytest.mark.parametrize(("blamed", "failed"), [("http://head", 1), ("http://elsewhere", 1), ("http://tail", 2)])
def test_a_hop_can_blame_only_a_hop_after_it(blamed: str, failed: int) -> None:
    swarm = Swarm()
    route = chain(swarm)
    swarm.transport.add(route[1], BlamingHop(swarm.transport.services[route[1]], blamed))  # type: ignore[arg-type]

    async def main() -> None:
        tokens = await generate(swarm, route, 1)
        with pytest.raises(HopFailed) as error:
            await swarm.send(route[0], step(tokens[-1], len(PROMPT)))
        # relayed by the head, a name before the middle (or off the route) would read as the head's word
        assert error.value.failed_hop == route[failed]

    asyncio.run(main())


def spare_for(swarm: Swarm, route: list[str], dead: int) -> list[str]:
    """A spare of the dead hop's layers joins; the route with it in the dead hop's place."""
    spare = f"http://spare{dead}"
    swarm.node(spare, ["0:4", "4:8", "8:12"][dead])
    return [*route[:dead], spare, *route[dead + 1 :]]


@pytest.mark.parametrize("dead", [1, 2])
def test_a_reroute_replays_the_seam_log_into_a_replacement_and_the_text_goes_on_identically(dead: int) -> None:
    want = reference(10)
    swarm = Swarm()
    route = chain(swarm)

    async def main() -> list[int]:
        tokens = await generate(swarm, route, 4)
        position = len(PROMPT) + len(tokens) - 1
        swarm.transport.remove(route[dead])
        with pytest.raises(HopFailed) as failed:
            await swarm.send(route[0], step(tokens[-1], position))
        assert failed.value.failed_hop == route[dead]
        fixed = spare_for(swarm, route, dead)
        # the hop before the dead one rebuilds its replacement (and, for a dead tail, nothing after it)
        reroute = RerouteRequest(SID, tuple(fixed[dead:]), "r1", model="mix", replay=1, step=position)
        answer = await swarm.transport.services[fixed[dead - 1]].reroute(reroute)
        assert answer.kind is AnswerKind.TOKEN and answer.position == position + 1
        assert [h.held for h in answer.hops] == [position + 1] * (len(route) - dead + 1)
        for i in range(dead - 2, -1, -1):  # the hops above it broke the session too: the gateway clears them
            cleared = RerouteRequest(SID, tuple(fixed[i + 1 :]), "r1", step=position)
            assert (await swarm.transport.services[fixed[i]].reroute(cleared)).kind is AnswerKind.REROUTED
        assert isinstance(answer, TokenAnswer)
        tokens.append(answer.token)
        return await decode(swarm, route[0], tokens, 10)

    assert asyncio.run(main()) == want


@pytest.mark.parametrize("dead", [1, 2])
def test_a_reroute_without_resend_replays_what_came_before_the_step_and_the_gateway_resends_it(dead: int) -> None:
    """After pipelined rounds a hop's own copy of the interrupted step may be a voided round's: without
    ``resend`` it drops the step too, replays only what came before, and the step goes through the
    whole route again."""
    want = reference(10)
    swarm = Swarm()
    route = chain(swarm)

    async def main() -> list[int]:
        tokens = await generate(swarm, route, 4)
        position = len(PROMPT) + len(tokens) - 1
        stale = await swarm.send(route[0], step((tokens[-1] + 1) % VOCAB, position))  # a wrong token at the step
        assert stale.kind is AnswerKind.TOKEN
        swarm.transport.remove(route[dead])
        fixed = spare_for(swarm, route, dead)
        reroute = RerouteRequest(SID, tuple(fixed[dead:]), "r1", model="mix", replay=1, step=position, resend=False)
        answer = await swarm.transport.services[fixed[dead - 1]].reroute(reroute)
        assert answer.kind is AnswerKind.REPLAYED and answer.hops[0].held == position
        for i in range(dead - 2, -1, -1):
            cleared = RerouteRequest(SID, tuple(fixed[i + 1 :]), "r1", step=position, resend=False)
            assert (await swarm.transport.services[fixed[i]].reroute(cleared)).kind is AnswerKind.REROUTED
        resent = await swarm.send(route[0], step(tokens[-1], position, rewind=True))
        assert isinstance(resent, TokenAnswer) and [h.held for h in resent.hops] == [position + 1] * 3
        tokens.append(resent.token)
        return await decode(swarm, route[0], tokens, 10)

    assert asyncio.run(main()) == want


def test_a_reroute_without_a_seam_log_says_the_session_needs_a_fresh_prefill() -> None:
    swarm = Swarm()
    route = ["http://head", "http://tail"]
    swarm.transport.add(
        route[0], NodeService(MixShard("0:6"), NodeConfig("head", route[0], seam_log_bytes=0), swarm.transport)
    )
    swarm.node(route[1], "6:12")

    async def main() -> None:
        await generate(swarm, route, 2)
        reroute = RerouteRequest(SID, ("http://tail",), "r1", replay=1, step=len(PROMPT))
        with pytest.raises(Conflict, match="fresh prefill") as refused:
            await swarm.transport.services[route[0]].reroute(reroute)
        assert refused.value.code == "no_seam_log"
        with pytest.raises(Conflict, match="pinned to route r1"):
            await swarm.transport.services[route[0]].reroute(RerouteRequest(SID, ("http://tail",), "other"))
        with pytest.raises(InvalidRequest, match=r"0\.\.1"):
            RerouteRequest(SID, ("http://tail",), "r1", replay=2)

    asyncio.run(main())


def test_a_resent_step_with_rewind_replaces_the_position_every_hop_already_holds() -> None:
    want = reference(6)
    swarm = Swarm()
    route = chain(swarm)

    async def main() -> list[int]:
        tokens = await generate(swarm, route, 5)
        position = len(PROMPT) + 3  # the step that produced tokens[4]: every hop holds it already
        again = await swarm.send(route[0], step(tokens[3], position, rewind=True))
        assert again.token == tokens[4] and [h.held for h in again.hops] == [position + 1] * 3
        answer = await swarm.send(route[0], step(tokens[4], position + 1))
        assert isinstance(answer, TokenAnswer)
        return [*tokens, answer.token]

    assert asyncio.run(main()) == want


def test_a_verify_chunk_keeps_the_agreeing_drafts_and_every_hop_drops_the_rest() -> None:
    want = reference(10)
    swarm = Swarm()
    route = chain(swarm)

    async def main() -> list[int]:
        tokens = await generate(swarm, route, 3)
        position = len(PROMPT) + 2
        drafts = [want[3], want[4], (want[5] + 1) % VOCAB]  # the third draft is wrong
        answer = await swarm.send(route[0], step(tokens[-1], position, drafts=drafts))
        assert answer.kind is AnswerKind.TOKENS
        assert (answer.drafted, answer.accepted) == (3, 2)
        assert list(answer.tokens) == want[3:6] and answer.position == position + 3
        assert [h.held for h in answer.hops] == [position + 3] * 3  # the rejected draft is gone everywhere
        tokens += answer.tokens
        return await decode(swarm, route[0], tokens, 10)

    assert asyncio.run(main()) == want


def guessed(tokens: Sequence[int], position: int, *, rewind: bool = False) -> HopRequest:
    """A pipelined round: ``tokens`` at ``position``, the first one a guess too."""
    request = step(tokens[0], position, drafts=tokens[1:], rewind=rewind)
    return dataclasses.replace(request, guess=tokens[0])


def test_a_pipelined_round_is_kept_only_where_the_tail_sampled_its_guess() -> None:
    """The tail keeps a round whose guessed first token is the one it sampled there, and voids any
    other without computing it; over HTTP every hop before it drops the round as the answer passes."""
    want = reference(10)
    swarm = Swarm()
    route = chain(swarm)
    tail = swarm.transport.services[route[2]]

    def computed() -> float:
        return float(tail.metrics.positions.value)

    async def main() -> list[int]:
        tokens = await generate(swarm, route, 3)
        position = len(PROMPT) + 2  # where the tail's newest token, tokens[2], goes
        before = computed()
        wrong = (tokens[-1] + 1) % VOCAB
        voided = await swarm.send(route[0], guessed([wrong, want[3]], position))
        assert voided.kind is AnswerKind.VOIDED and voided.count == position
        assert [h.held for h in voided.hops] == [position] * 3  # dropped on every hop
        assert computed() == before and tail.metrics.voided.value == 1
        with pytest.raises(InvalidRequest, match="not the step's own token"):  # the head checks the guess
            await swarm.transport.services[route[0]].handle(
                dataclasses.replace(guessed([tokens[-1], want[3]], position), guess=wrong)
            )
        kept = await swarm.send(route[0], guessed([tokens[-1], want[3], want[4]], position))
        assert kept.kind is AnswerKind.TOKENS and list(kept.tokens) == want[3:6]
        tokens += kept.tokens
        chained = await swarm.send(route[0], guessed([want[5], want[6]], position + 3))  # its guess: the bonus
        assert chained.kind is AnswerKind.TOKENS and list(chained.tokens) == want[6:8]
        tokens += chained.tokens
        return await decode(swarm, route[0], tokens, 10)

    assert asyncio.run(main()) == want


def test_drafts_past_a_hops_limit_or_outside_the_vocabulary_are_refused_and_change_nothing() -> None:
    swarm = Swarm()
    route = chain(swarm, max_verify=2)

    async def main() -> None:
        tokens = await generate(swarm, route, 2)
        position = len(PROMPT) + 1
        head = swarm.transport.services[route[0]]
        with pytest.raises(InvalidRequest, match="at most 2"):
            await head.handle(step(tokens[-1], position, drafts=[1, 2, 3]))
        with pytest.raises(InvalidRequest, match=r"within \[0, 50\)"):
            await head.handle(step(tokens[-1], position, drafts=[VOCAB]))
        answer = await swarm.send(route[0], step(tokens[-1], position, drafts=[1, 2]))
        assert answer.position is not None and [h.held for h in answer.hops] == [answer.position] * 3

    asyncio.run(main())


def test_failure_paths_are_clear_errors_that_leave_the_session_usable() -> None:
    swarm = Swarm()
    head = swarm.node("http://head", "0:12")
    solo = ["http://head"]

    async def main() -> None:
        tokens = await generate(swarm, solo, 2)
        position = len(PROMPT) + 1
        bad: list[tuple[HopRequest, type[MeshnetError], str]] = [
            (step(tokens[-1], position + 5), MeshnetError, "position"),
            (HopRequest(Verb.DECODE, SID, position, 1, ids_payload([1]), model="other"), Conflict, "serves model"),
            (HopRequest(Verb.DECODE, SID, position, 1, ids_payload([1]), route_id="r2"), Conflict, "pinned"),
            (HopRequest(Verb.DECODE, SessionId("new"), 3, 1, ids_payload([1]), route_id="r1"), SessionGone, "unknown"),
            (HopRequest(Verb.DECODE, SessionId("new"), 0, 1, ids_payload([1])), InvalidRequest, "Route-Id"),
            (HopRequest(Verb.DECODE, SID, position, 1, ids_payload([1, 2])), SeamMismatch, "shape 1,1"),
        ]
        for request, error, message in bad:
            with pytest.raises(error, match=message):
                await head.handle(request)
        with pytest.raises(InvalidRequest, match="no next hop"):
            other = SessionId("other")
            await head.handle(
                HopRequest(Verb.PREFILL, other, 0, 2, ids_payload([1, 2]), route_id="r3", next_hops=("x",))
            )
        answer = await head.handle(step(tokens[-1], position))  # nothing above changed the session
        assert answer is not None and answer.position == position + 1

    asyncio.run(main())


def test_a_second_request_on_a_busy_session_is_refused_while_the_first_computes() -> None:
    gate = threading.Event()
    swarm = Swarm()
    head = swarm.node("http://head", "0:12", gate=gate)

    async def main() -> None:
        first = asyncio.ensure_future(head.handle(prefill(PROMPT, 0, route=["h"], final=True, first=True)))
        await asyncio.sleep(0.05)
        with pytest.raises(SessionBusy):
            await head.handle(step(1, len(PROMPT)))
        gate.set()
        answer = await first
        assert answer is not None and answer.kind is AnswerKind.TOKEN

    asyncio.run(main())


def test_opening_a_session_while_another_computes_leaves_the_event_loop_free() -> None:
    """A new session's state waits for the shard's compute lock; on the event loop it stalled every
    request, decode channel and heartbeat of the node until the running chunk ended."""
    gate = threading.Event()
    swarm = Swarm()
    head = swarm.node("http://head", "0:12", gate=gate)
    other = dataclasses.replace(prefill(PROMPT, 0, route=["h"], final=True, first=True), session=SessionId("s-2"))

    async def main() -> None:
        first = asyncio.ensure_future(head.handle(prefill(PROMPT, 0, route=["h"], final=True, first=True)))
        await asyncio.sleep(0.05)  # its chunk now holds the compute lock, waiting on the gate
        second = asyncio.ensure_future(head.handle(other))
        began = time.monotonic()
        for _ in range(10):  # the loop runs on while the second session waits for the lock
            await asyncio.sleep(0.01)
        assert time.monotonic() - began < 2 and not second.done()
        gate.set()
        for answer in await asyncio.wait_for(asyncio.gather(first, second), 10):
            assert answer is not None and answer.kind is AnswerKind.TOKEN

    release = threading.Timer(5, gate.set)  # a stalled loop cannot set the gate itself
    release.start()
    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        release.cancel()
        gate.set()


def test_a_delete_travels_down_the_chain_and_frees_every_hop() -> None:
    swarm = Swarm()
    route = chain(swarm)

    async def main() -> None:
        await generate(swarm, route, 2)
        services = [swarm.transport.services[u] for u in route]
        assert [s.session_state(SID)["position"] for s in services] == [len(PROMPT) + 1] * 3
        await services[0].delete(SID)
        for service in services:
            assert len(service.shard.store) == 0
            with pytest.raises((SessionNotFound, SessionGone)):
                service.session_state(SID)

    asyncio.run(main())


def test_a_delete_a_busy_next_hop_refuses_is_passed_on_again_until_it_frees_the_session() -> None:
    """The gateway closes as soon as the tail's token reaches it over the decode channel, while a hop
    before the tail may still be handing that step on (409 ``session_busy``): the hop before it asks
    again, in the background, and the session leaves every hop, not at its idle TTL."""
    swarm = Swarm()
    route = chain(swarm)

    async def main() -> None:
        await generate(swarm, route, 2)
        head, middle, tail = (swarm.transport.services[u] for u in route)
        bound = tail._bound(SID)  # type: ignore[attr-defined]
        assert bound is not None
        bound.busy = True  # a step still in flight on the tail
        await head.delete(SID)
        assert len(head.shard.store) == 0 and len(middle.shard.store) == 0 and len(tail.shard.store) == 1
        await asyncio.sleep(0.2)
        bound.busy = False  # the step is done
        for _ in range(100):
            if len(tail.shard.store) == 0:
                break
            await asyncio.sleep(0.05)
        assert len(tail.shard.store) == 0

    asyncio.run(main())


# -- route tickets (a private swarm) -------------------------------------------------------------


def ticketed_swarm(signer: TicketSigner) -> tuple[Swarm, list[str]]:
    swarm = Swarm()
    urls = ["http://head:1", "http://middle:2", "http://tail:3", "http://spare:4"]
    for url, layers in zip(urls, ["0:4", "4:8", "8:12", "8:12"], strict=True):
        config = NodeConfig(
            node_id=url.split("//")[1].split(":")[0], url=url, tickets=TicketVerifier(signer.public_pem())
        )
        swarm.transport.add(url, NodeService(MixShard(layers), config, swarm.transport))
    return swarm, urls


def ticket_hops(urls: Sequence[str]) -> list[TicketHop]:
    layers = ["0:4", "4:8", "8:12"]
    return [TicketHop(u.split("//")[1].split(":")[0], u, layers[i]) for i, u in enumerate(urls)]


def test_with_tickets_a_session_opens_only_along_the_trackers_route_and_repairs_with_a_repair_ticket() -> None:
    signer = TicketSigner.generate()
    want = reference(8)
    swarm, urls = ticketed_swarm(signer)
    route = urls[:3]
    ticket = route_ticket(SID, RouteId("r1"), "mix", ticket_hops(route), ttl_s=60)
    token = signer.sign(ticket)

    async def main() -> list[int]:
        head = swarm.transport.services[route[0]]
        first = prefill(PROMPT, 0, route=route, final=True, first=True)
        with pytest.raises(Unauthorized, match="no route ticket"):
            await head.handle(first)
        with pytest.raises(Unauthorized, match="along its ticket"):  # a next hop the ticket does not name
            await head.handle(dataclasses.replace(first, next_hops=(urls[3], route[2]), ticket=token))
        forged = TicketSigner.generate().sign(ticket)
        with pytest.raises(Unauthorized, match="does not trust"):
            await head.handle(dataclasses.replace(first, ticket=forged))
        answer = await swarm.send(route[0], dataclasses.replace(first, ticket=token))
        assert isinstance(answer, TokenAnswer)
        tokens = [answer.token]
        await decode(swarm, route[0], tokens, 4)
        position = len(PROMPT) + len(tokens) - 1
        swarm.transport.remove(route[2])
        with pytest.raises(HopFailed):
            await swarm.send(route[0], step(tokens[-1], position))
        fixed = [*route[:2], urls[3]]
        middle = swarm.transport.services[route[1]]
        with pytest.raises(Unauthorized, match="repair ticket"):  # the route ticket does not steer a session
            await middle.reroute(RerouteRequest(SID, (urls[3],), "r1", replay=1, step=position, ticket=token))
        repair = signer.sign(repair_ticket(ticket, ticket_hops(fixed), repair_from=2, ttl_s=60))
        answer = await middle.reroute(RerouteRequest(SID, (urls[3],), "r1", replay=1, step=position, ticket=repair))
        await head.reroute(RerouteRequest(SID, tuple(fixed[1:]), "r1", step=position, ticket=repair))
        assert isinstance(answer, TokenAnswer)
        tokens.append(answer.token)
        return await decode(swarm, route[0], tokens, 8)

    assert asyncio.run(main()) == want


def test_a_session_is_one_record_that_gives_back_its_seam_log_when_the_store_ends_it() -> None:
    swarm = Swarm()
    route = chain(swarm)
    asyncio.run(generate(swarm, route, 3))
    head = swarm.transport.services[route[0]]
    assert head.logs.used == (len(PROMPT) + 2) * 2 * 4  # float32 activations of every position sent on
    head.shard.store.close(SID, "expired after 600s idle")  # as the store's idle expiry does
    assert head.logs.used == 0
    with pytest.raises(SessionGone, match="expired"):
        head.session_state(SID)


def test_every_hop_counts_where_a_decode_steps_time_goes() -> None:
    """The per-hop breakdown bench_route reads: steps, their compute, and their time on the hop."""
    swarm = Swarm()
    route = chain(swarm)
    asyncio.run(generate(swarm, route, 6))  # 5 decode steps after the prefill's token
    for url in route:
        metrics = swarm.transport.services[url].metrics
        steps = metrics.decode_steps.value
        compute, handle = metrics.decode_compute.value, metrics.decode_handle.value
        assert steps == 5 and 0 < compute <= handle, (url, steps, compute, handle)
