"""Every request on a session is its drivers' (node.authority, #28 item 1): over in-process ticketed
chains of fake shards, only the gateway that opened a session and, on each hop, the hop before it
on the ticket's route may drive, read, reroute or close it; a repair's newer epoch rebinds the hops
after the replaced run and supersedes every older ticket; a closed session's tickets open nothing.
Then the tracker's side: tickets name their owner and epoch, and sessions are shown to their owner
and admins only."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from meshnet.errors import Forbidden, HopFailed, SessionGone, SessionNotFound, Unauthorized
from meshnet.ids import RouteId, SessionId
from meshnet.node.authority import CODE_NOT_DRIVER, ClosedSessions, SessionAuthority
from meshnet.node.service import NodeConfig, NodeService
from meshnet.protocol.channel import Direct
from meshnet.protocol.messages import HopRequest, Payload, RerouteRequest, TokenAnswer, Verb
from meshnet.protocol.tickets import (
    CODE_CLOSED,
    CODE_SUPERSEDED,
    RouteTicket,
    TicketSigner,
    TicketVerifier,
    repair_ticket,
    route_ticket,
)
from meshnet.protocol.wire import encode_tensor
from meshnet.tracker.db import TrackerDB
from tests.unit.test_node_service import (
    PROMPT,
    SID,
    MixShard,
    Swarm,
    decode,
    prefill,
    reference,
    step,
    ticket_hops,
    ticketed_swarm,
)
from tests.unit.test_tracker_standby import Swarm as TrackerSwarm
from tests.unit.test_tracker_standby import open_on, the_route

GW = "gw"


def _open(swarm: Swarm, route: list[str], ticket: RouteTicket, signer: TicketSigner) -> tuple[str, list[int]]:
    """Open SID on ``route`` as the gateway ``gw`` with ``ticket``; its token and the first tokens."""
    token = signer.sign(ticket)

    async def main() -> list[int]:
        head = swarm.transport.services[route[0]]
        first = dataclasses.replace(prefill(PROMPT, 0, route=route, final=True, first=True), ticket=token)
        answer = await head.handle(first, caller=GW)
        assert isinstance(answer, TokenAnswer)
        return await decode(swarm, route[0], [answer.token], 3)

    return token, asyncio.run(main())


def _not_driver(error: pytest.ExceptionInfo[Forbidden]) -> None:
    assert error.value.code == CODE_NOT_DRIVER and error.value.status == 403


def test_only_the_gateway_and_the_upstream_hop_drive_a_session_on_every_verb() -> None:
    signer = TicketSigner.generate()
    want = reference(8)
    swarm, urls = ticketed_swarm(signer)
    route = urls[:3]
    ticket = route_ticket(SID, RouteId("r1"), "mix", ticket_hops(route), ttl_s=60, owner=GW)
    token, tokens = _open(swarm, route, ticket, signer)
    head, middle, tail = (swarm.transport.services[u] for u in route)
    position = len(PROMPT) + len(tokens) - 1
    repair = signer.sign(repair_ticket(ticket, ticket_hops(route), repair_from=1, ttl_s=60))

    async def attacks() -> None:
        for caller in ("spy", "gw2", "middle"):  # a stranger, another gateway, a hop that is not upstream
            with pytest.raises(Forbidden) as appended:
                await head.handle(step(99, position), caller=caller)
            _not_driver(appended)
            with pytest.raises(Forbidden):  # the rewind that wipes the session
                await head.handle(step(99, 1, rewind=True), caller=caller)
            with pytest.raises(Forbidden):  # a verify chunk, a prefill chunk
                await head.handle(step(99, position, drafts=[5, 6]), caller=caller)
            with pytest.raises(Forbidden):
                await head.handle(prefill([7, 8], position, route=route, final=True, first=False), caller=caller)
            with pytest.raises(Forbidden):  # a KV snapshot to a standby
                await head.snapshot(SID, repair, caller)
            with pytest.raises(Forbidden):
                head.session_state(SID, caller)
            with pytest.raises(Forbidden):
                await head.delete(SID, token, caller)
            reroute = RerouteRequest(SID, tuple(route[1:]), "r1", replay=1, step=position, ticket=repair)
            with pytest.raises(Forbidden):  # even holding a genuine repair ticket
                await head.reroute(reroute, caller=caller)
        with pytest.raises(Forbidden):  # the tail is driven by the middle (and the gateway), not the head
            tail.session_state(SID, "head")
        assert middle.session_state(SID, "head")["position"] == position
        assert tail.session_state(SID, "middle")["position"] == tail.session_state(SID, GW)["position"] == position
        # a hop that holds the ticket cannot open the session where it is not the upstream either
        other = SessionId("s2")
        stolen = signer.sign(dataclasses.replace(ticket, session_id=other))
        first = dataclasses.replace(prefill(PROMPT, 0, route=route, final=True, first=True), session=other)
        with pytest.raises(Forbidden):
            await head.handle(dataclasses.replace(first, ticket=stolen), caller="middle")
        assert head.session_state(SID, GW)["position"] == position  # nothing appended, nothing rewound
        assert head.session_state(SID, "ops", admin=True)["position"] == position  # an admin reads

    asyncio.run(attacks())
    assert asyncio.run(decode(swarm, route[0], tokens, 8)) == want


def test_the_head_takes_a_relayed_decode_step_from_the_routes_tail_and_nothing_else() -> None:
    """The relay exception: at the head, the route's tail may send a plain decode step over the decode
    channel (the step a gateway's ``CREDIT`` let it relay) — not over HTTP, not a verify chunk, not a
    rewind; no other hop may; and the tail's ticket names the only head it relays to."""
    signer = TicketSigner.generate()
    swarm, urls = ticketed_swarm(signer)
    route = urls[:3]
    ticket = route_ticket(SID, RouteId("r1"), "mix", ticket_hops(route), ttl_s=60, owner=GW)
    token, tokens = _open(swarm, route, ticket, signer)
    head = swarm.transport.services[route[0]]
    position = len(PROMPT) + len(tokens) - 1
    direct = Direct(99, tuple(route))

    async def attempts() -> None:
        with pytest.raises(Forbidden):  # over HTTP
            await head.handle(step(tokens[-1], position), caller="tail")
        with pytest.raises(Forbidden):
            await head.handle(step(tokens[-1], position, drafts=[5]), direct, caller="tail")
        with pytest.raises(Forbidden):
            await head.handle(step(tokens[-1], position, rewind=True), direct, caller="tail")
        with pytest.raises(Forbidden):  # the middle is no relayer
            await head.handle(step(tokens[-1], position), direct, caller="middle")

    asyncio.run(attempts())
    at_head = SessionAuthority.of(ticket, token, "head", None)
    at_tail = SessionAuthority.of(ticket, token, "tail", None)
    at_head.check("tail", SID, "head", "drive", relay=True)
    assert (at_head.relayer, at_head.head, at_tail.relayer, at_tail.head) == ("tail", None, None, route[0])
    alone = route_ticket(SID, RouteId("r1"), "mix", ticket_hops(route[:1]), ttl_s=60, owner=GW)
    assert SessionAuthority.of(alone, token, "head", None).relayer is None  # a one-hop route relays nothing
    assert head.session_state(SID, GW)["position"] == position  # nothing the attempts sent was computed


def test_a_repair_rebinds_the_hops_after_it_and_supersedes_every_older_ticket() -> None:
    signer = TicketSigner.generate()
    want = reference(10)
    swarm, urls = ticketed_swarm(signer)
    swap = "http://swap:5"  # a second middle: the repair replaces the middle, the tail stays
    config = NodeConfig(node_id="swap", url=swap, tickets=TicketVerifier(signer.public_pem()))
    swarm.transport.add(swap, NodeService(MixShard("4:8"), config, swarm.transport))
    route = urls[:3]
    ticket = route_ticket(SID, RouteId("r1"), "mix", ticket_hops(route), ttl_s=60, owner=GW)
    _, tokens = _open(swarm, route, ticket, signer)
    head, tail = swarm.transport.services[route[0]], swarm.transport.services[route[2]]

    async def main() -> list[int]:
        position = len(PROMPT) + len(tokens) - 1
        swarm.transport.remove(route[1])
        with pytest.raises(HopFailed):
            await swarm.send(route[0], step(tokens[-1], position))
        fixed = [route[0], swap, route[2]]
        once = repair_ticket(ticket, ticket_hops(fixed), repair_from=1, ttl_s=60)
        assert (once.epoch, once.owner) == (1, GW)
        answer = await head.reroute(
            RerouteRequest(SID, tuple(fixed[1:]), "r1", replay=1, step=position, ticket=signer.sign(once)), caller=GW
        )
        assert isinstance(answer, TokenAnswer)
        tokens.append(answer.token)
        # the tail learned its new upstream from the resent step: the old middle drives nothing now
        with pytest.raises(Forbidden):
            tail.session_state(SID, "middle")
        assert tail.session_state(SID, "swap")["position"] == position + 1
        # a second repair (epoch 2) and then the first one replayed: superseded, on every hop it reaches
        twice = repair_ticket(once, ticket_hops(fixed), repair_from=1, ttl_s=60)
        clear = RerouteRequest(SID, tuple(fixed[1:]), "r1", step=position + 1, ticket=signer.sign(twice))
        await head.reroute(clear, caller=GW)
        stale = dataclasses.replace(clear, ticket=signer.sign(once), replay=1)
        with pytest.raises(Unauthorized) as superseded:
            await head.reroute(stale, caller=GW)
        assert superseded.value.code == CODE_SUPERSEDED
        old_route = dataclasses.replace(step(tokens[-1], position + 1), ticket=signer.sign(ticket))
        with pytest.raises(Unauthorized, match="superseded"):
            await head.handle(old_route, caller=GW)
        return await decode(swarm, route[0], tokens, 10)

    assert asyncio.run(main()) == want


def test_a_closed_sessions_tickets_open_nothing_but_a_later_repair_does() -> None:
    signer = TicketSigner.generate()
    swarm, urls = ticketed_swarm(signer)
    route = urls[:3]
    ticket = route_ticket(SID, RouteId("r1"), "mix", ticket_hops(route), ttl_s=60, owner=GW)
    token, _ = _open(swarm, route, ticket, signer)
    head, tail = swarm.transport.services[route[0]], swarm.transport.services[route[2]]
    first = dataclasses.replace(prefill(PROMPT, 0, route=route, final=True, first=True), ticket=token)

    async def main() -> None:
        await head.delete(SID, token, GW)
        with pytest.raises((SessionNotFound, SessionGone)):
            tail.session_state(SID, "middle")  # the delete travelled down the chain
        with pytest.raises(Unauthorized) as replayed:
            await head.handle(first, caller=GW)
        assert replayed.value.code == CODE_CLOSED and len(head.closed) == 1
        # the tracker signs a later epoch only for a session still open on it (a repair re-adding a node)
        later = repair_ticket(ticket, ticket_hops(route), repair_from=1, ttl_s=60)
        answer = await head.handle(dataclasses.replace(first, ticket=signer.sign(later)), caller=GW)
        assert isinstance(answer, TokenAnswer)

    asyncio.run(main())


def test_closed_sessions_are_forgotten_after_their_tickets_expire_and_are_bounded() -> None:
    hops = ticket_hops(["http://head:1", "http://middle:2", "http://tail:3"])
    closed = ClosedSessions(keep_s=10, limit=2)
    for n, sid in enumerate(("a", "b", "c")):
        closed.close(SessionId(sid), 0, now=100.0 + n)
    assert len(closed) == 2  # the oldest went first
    ticket = route_ticket(SessionId("c"), RouteId("r"), "m", hops, ttl_s=5, now=100.0)
    with pytest.raises(Unauthorized):
        closed.check(ticket, now=105.0)
    closed.check(dataclasses.replace(ticket, session_id=SessionId("a")), now=105.0)
    closed.check(ticket, now=120.0)  # past every ticket the tracker issued before the close
    assert len(closed) == 0


def test_an_open_swarm_node_binds_nobody() -> None:
    """Without tickets (an open swarm, --no-tls) there are no drivers to check: it works as before."""
    swarm = Swarm()
    route = ["http://head", "http://middle", "http://tail"]
    for url, layers in zip(route, ["0:4", "4:8", "8:12"], strict=True):
        swarm.node(url, layers)

    async def main() -> None:
        head = swarm.transport.services[route[0]]
        answer = await head.handle(prefill(PROMPT, 0, route=route, final=True, first=True), caller="anyone")
        assert isinstance(answer, TokenAnswer)
        assert head.session_state(SID, "someone")["position"] == len(PROMPT)
        ids = Payload(encode_tensor(np.array([[answer.token]], dtype="int32"), "int32"))
        await head.handle(HopRequest(Verb.DECODE, SID, len(PROMPT), 1, ids, route_id="r1"), caller="else")

    asyncio.run(main())


# -- the tracker ----------------------------------------------------------------------------------


def test_the_tracker_shows_a_session_to_its_owner_and_admins_only(tmp_path: Path) -> None:
    db = TrackerDB(f"sqlite:///{tmp_path}/tracker.db")
    try:
        swarm = TrackerSwarm(tmp_path, db)
        the_route(swarm)
        owner = swarm.member("gw", "gateway")
        session = open_on(owner, ["head", "mid", "tail"], exclude=[])
        sid = session["session_id"]
        for other in (swarm.member("spy"), swarm.member("gw-2", "gateway")):
            assert other.get("/v1/sessions").json()["sessions"] == []
            assert other.get(f"/v1/sessions/{sid}").status_code == 404
        for allowed in (owner, swarm.member("ops", "admin")):
            assert [s["session_id"] for s in allowed.get("/v1/sessions").json()["sessions"]] == [sid]
            assert allowed.get(f"/v1/sessions/{sid}").json()["route_id"] == session["route_id"]
    finally:
        db.close()


def test_tracker_tickets_name_their_owner_and_bump_the_epoch_at_every_repair(tmp_path: Path) -> None:
    db = TrackerDB(f"sqlite:///{tmp_path}/tracker.db")
    try:
        swarm = TrackerSwarm(tmp_path, db)
        the_route(swarm)
        swarm.register("spare", "10:20")
        owner = swarm.member("gw", "gateway")
        session = open_on(owner, ["head", "mid", "tail"], exclude=["spare"])
        sid = session["session_id"]
        opened = swarm.verifier.verify(session["ticket"])
        assert (opened.owner, opened.epoch) == ("gw", 0)
        standby = owner.post(f"/v1/sessions/{sid}/standbys", json={}).json()["standbys"][0]
        assert swarm.verifier.verify(standby["ticket"]).epoch == 0  # a contingency: no repair happened
        epochs = []
        for failed in ("mid", "spare"):
            swarm.register("mid", "10:20")  # back after its suspension (its next heartbeat)
            swarm.register("spare", "10:20")
            repaired = owner.post(f"/v1/sessions/{sid}/repair", json={"failed_node": failed})
            assert repaired.status_code == 200, repaired.text
            signed = swarm.verifier.verify(repaired.json()["ticket"])
            assert signed.owner == "gw"
            epochs.append(signed.epoch)
        assert epochs == [1, 2]
    finally:
        db.close()
