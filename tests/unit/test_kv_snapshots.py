"""KV snapshots for route repair (node.snapshots, node.service) over the in-process transport with
the fake shard of test_node_service: a hop pushes its session's KV to the standby the tracker's
ticket names; when the hop dies the standby restores it and only the positions after it are
replayed — and the text goes on exactly as if nothing had failed."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence

import pytest

from meshnet.errors import Conflict, HopFailed, InvalidRequest, SessionNotFound, StoreFull, Unauthorized
from meshnet.ids import RouteId
from meshnet.node.service import NodeConfig, NodeService
from meshnet.node.snapshots import SessionSnapshot
from meshnet.protocol.messages import AnswerKind, RerouteRequest, RestoreRequest, TokenAnswer
from meshnet.protocol.tickets import RouteTicket, TicketHop, TicketSigner, TicketVerifier, repair_ticket, route_ticket
from tests.unit.test_node_service import (
    PROMPT,
    SID,
    MixShard,
    Swarm,
    decode,
    every_state_live,
    prefill,
    reference,
    step,
)

LAYERS = {"head": "0:4", "middle": "4:8", "tail": "8:12", "mid2": "4:8", "tail2": "8:12"}


def url(name: str) -> str:
    return f"http://{name}:1"


def hops(names: Sequence[str]) -> list[TicketHop]:
    return [TicketHop(n, url(n), LAYERS[n]) for n in names]


def build(signer: TicketSigner | None, **budgets: int) -> Swarm:
    swarm = Swarm()
    for name, layers in LAYERS.items():
        config = NodeConfig(
            node_id=name, url=url(name), tickets=None if signer is None else TicketVerifier(signer.public_pem()),
            prefix_cache_bytes=budgets.get(name, 1 << 20),
        )  # fmt: skip
        swarm.transport.add(url(name), NodeService(MixShard(layers), config, swarm.transport))
    return swarm


def service(swarm: Swarm, name: str) -> NodeService:
    return swarm.transport.services[url(name)]


ROUTE = ["head", "middle", "tail"]


def route() -> RouteTicket:
    return route_ticket(SID, RouteId("r1"), "mix", hops(ROUTE), ttl_s=60)


def standby_ticket(signer: TicketSigner, index: int, standby: str) -> str:
    """What the tracker's standbys answer carries: the repair ticket of "hop ``index`` fails and
    ``standby`` replaces it"."""
    names = [*ROUTE[:index], standby, *ROUTE[index + 1 :]]
    return signer.sign(repair_ticket(route(), hops(names), repair_from=index, ttl_s=60))


async def opened(swarm: Swarm, signer: TicketSigner, n: int) -> list[int]:
    urls = [url(n) for n in ROUTE]
    first = dataclasses.replace(prefill(PROMPT, 0, route=urls, final=True, first=True), ticket=signer.sign(route()))
    answer = await swarm.send(urls[0], first)
    assert isinstance(answer, TokenAnswer)
    return await decode(swarm, urls[0], [answer.token], n)


async def pushed(node: NodeService) -> None:
    await asyncio.gather(*node._pushes)


@pytest.mark.parametrize("dead", [1, 2])
@pytest.mark.parametrize("kept", ["parked", "host", "demoted"])
def test_a_standby_restores_the_dead_hops_snapshot_and_only_later_positions_are_replayed(dead: int, kept: str) -> None:
    """The standby keeps the snapshot in its shard's own memory when it has a state to spare
    ("parked": the restored session opens on it, nothing copied), in host memory when live sessions
    fill the shard ("host"), or moved there when a live session takes its room ("demoted")."""
    signer = TicketSigner.generate()
    swarm = build(signer)
    spare = ["", "mid2", "tail2"][dead]

    async def main() -> tuple[list[int], int, int]:
        tokens = await opened(swarm, signer, 3)
        victim = service(swarm, ROUTE[dead])
        standby = service(swarm, spare)
        with every_state_live(standby) if kept == "host" else contextlib.nullcontext():
            taken = await victim.snapshot(SID, standby_ticket(signer, dead, spare))
            assert taken == {"snapshot": len(PROMPT) + 2, "to": spare}
            await pushed(victim)
        assert standby.prefix_cache is not None
        held = standby.prefix_cache.describe()
        assert (held["snapshots"], held["parked_snapshots"]) == (1, int(kept != "host"))
        if kept == "demoted":
            with every_state_live(standby):
                held = standby.prefix_cache.describe()
            assert (held["snapshots"], held["parked_snapshots"], held["demoted"]) == (1, 0, 1)
        tokens = await decode(swarm, url("head"), tokens, 6)  # the session goes on past the snapshot
        position = len(PROMPT) + len(tokens) - 1
        swarm.transport.remove(url(ROUTE[dead]))
        with pytest.raises(HopFailed):
            await swarm.send(url("head"), step(tokens[-1], position))
        repair = standby_ticket(signer, dead, spare)  # the tracker's repair ticket (prefer: the standby)
        restored = await service(swarm, spare).restore(RestoreRequest(SID, "r1", model="mix", ticket=repair))
        assert restored.kind is AnswerKind.RESTORED and restored.count == taken["snapshot"]
        fixed = [url(n) for n in [*ROUTE[:dead], spare, *ROUTE[dead + 1 :]]]
        reroute = RerouteRequest(SID, tuple(fixed[dead:]), "r1", model="mix", replay=1, step=position, ticket=repair,
                                 replay_from=restored.count)  # fmt: skip
        answer = await swarm.transport.services[fixed[dead - 1]].reroute(reroute)
        assert isinstance(answer, TokenAnswer) and [h.held for h in answer.hops][-1] == position + 1
        for i in range(dead - 2, -1, -1):
            cleared = RerouteRequest(SID, tuple(fixed[i + 1 :]), "r1", step=position, ticket=repair)
            await swarm.transport.services[fixed[i]].reroute(cleared)
        tokens.append(answer.token)
        computed = service(swarm, spare).shard.store.get(SID).positions_processed
        return await decode(swarm, url("head"), tokens, 10), computed, position + 1 - restored.count

    tokens, computed, after = asyncio.run(main())
    assert tokens == reference(10)
    assert computed == after  # the standby computed only the positions after its snapshot


def test_snapshots_go_only_where_a_tracker_ticket_names_a_same_layer_standby() -> None:
    signer = TicketSigner.generate()
    swarm = build(signer)

    async def main() -> None:
        await opened(swarm, signer, 2)
        middle = service(swarm, "middle")
        with pytest.raises(Unauthorized, match="cannot hold"):  # a standby of other layers
            await middle.snapshot(SID, standby_ticket(signer, 2, "tail2"))
        with pytest.raises(Unauthorized, match="repair ticket"):  # the route ticket names no standby
            await middle.snapshot(SID, signer.sign(route()))
        with pytest.raises(Unauthorized, match="does not trust"):
            await middle.snapshot(SID, standby_ticket(TicketSigner.generate(), 1, "mid2"))
        body = SessionSnapshot("s1", "4:8", 1, b"kv", (1,), (b"i" * 16,), (b"o" * 16,)).encode()
        with pytest.raises(Unauthorized):  # the standby checks it is the one the ticket names
            await service(swarm, "tail2").receive_snapshot(SID, standby_ticket(signer, 1, "mid2"), body)
        with pytest.raises(SessionNotFound, match="no KV snapshot"):
            await service(swarm, "mid2").restore(RestoreRequest(SID, "r1", ticket=standby_ticket(signer, 1, "mid2")))

    asyncio.run(main())


def test_an_open_swarm_has_no_trusted_nodes_and_so_no_snapshots() -> None:
    swarm = build(None)
    urls = [url(n) for n in ROUTE]

    async def main() -> None:
        await swarm.send(urls[0], prefill(PROMPT, 0, route=urls, final=True, first=True))
        with pytest.raises(Conflict, match="private swarm") as refused:
            await service(swarm, "middle").snapshot(SID, "mnt1.x.y")
        assert refused.value.code == "no_trusted_nodes"

    asyncio.run(main())


def test_a_standby_without_room_refuses_the_snapshot_and_the_repair_replays_everything() -> None:
    signer = TicketSigner.generate()
    swarm = build(signer, mid2=16)

    async def main() -> None:
        await opened(swarm, signer, 2)
        middle = service(swarm, "middle")
        await middle.snapshot(SID, standby_ticket(signer, 1, "mid2"))
        taken = await middle._take_snapshot(middle._existing(SID))
        with pytest.raises(StoreFull, match="does not fit"):
            await service(swarm, "mid2").receive_snapshot(SID, standby_ticket(signer, 1, "mid2"), taken.encode())
        await pushed(middle)  # the push met the same refusal: logged, nothing held
        with pytest.raises(SessionNotFound):
            await service(swarm, "mid2").restore(RestoreRequest(SID, "r1", ticket=standby_ticket(signer, 1, "mid2")))

    asyncio.run(main())


def test_a_snapshot_round_trips_and_a_damaged_one_is_a_clear_400() -> None:
    snap = SessionSnapshot("s1", "4:8", 3, b"kvkv", (2, 3), (b"a" * 16, b"b" * 16), (), b"log", "float32", b"ids", (7,))
    assert SessionSnapshot.decode(snap.encode()) == snap
    body = snap.encode()
    for broken, why in (
        (b"XXXX" + body[4:], "magic"),
        (body[:10], "cut short"),
        (body + b"!", "add up"),
        (body.replace(b'"ends":[2,3]', b'"ends":[2,4]'), "ledger"),
        (body.replace(b'"position":3', b'"position":"x"'), "header"),
    ):
        with pytest.raises(InvalidRequest, match=why):
            SessionSnapshot.decode(broken)


def test_a_session_that_ends_whole_has_its_standbys_drop_the_snapshot() -> None:
    signer = TicketSigner.generate()
    swarm = build(signer)

    async def main() -> None:
        await opened(swarm, signer, 2)
        middle = service(swarm, "middle")
        await middle.snapshot(SID, standby_ticket(signer, 1, "mid2"))
        await pushed(middle)
        standby = service(swarm, "mid2").prefix_cache
        assert standby is not None and standby.describe()["snapshots"] == 1
        await service(swarm, "head").delete(SID, signer.sign(route()))
        assert standby.describe()["snapshots"] == 0 and standby.used == 0

    asyncio.run(main())
