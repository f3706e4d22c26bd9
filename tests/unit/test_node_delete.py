"""Who may end a session on a node of a private swarm: only a holder of the session's ticket
(the gateway that opened it, the route's hops); a member that merely knows the id cannot."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from meshnet.errors import SessionGone, SessionNotFound, Unauthorized
from meshnet.ids import RouteId, SessionId
from meshnet.protocol.messages import TokenAnswer
from meshnet.protocol.tickets import TicketSigner, route_ticket
from tests.unit.test_node_service import PROMPT, SID, prefill, ticket_hops, ticketed_swarm


def test_a_delete_needs_the_sessions_ticket_and_travels_with_it_down_the_chain() -> None:
    signer = TicketSigner.generate()
    swarm, urls = ticketed_swarm(signer)
    route = urls[:3]
    ticket = route_ticket(SID, RouteId("r1"), "mix", ticket_hops(route), ttl_s=60)
    token = signer.sign(ticket)

    async def main() -> None:
        first = dataclasses.replace(prefill(PROMPT, 0, route=route, final=True, first=True), ticket=token)
        assert isinstance(await swarm.send(route[0], first), TokenAnswer)
        services = [swarm.transport.services[u] for u in route]
        with pytest.raises(Unauthorized, match="no route ticket"):
            await services[0].delete(SID)
        with pytest.raises(Unauthorized, match="does not trust"):
            await services[0].delete(SID, TicketSigner.generate().sign(ticket))
        other = signer.sign(route_ticket(SessionId("s2"), RouteId("r1"), "mix", ticket_hops(route), ttl_s=60))
        with pytest.raises(Unauthorized):  # a genuine ticket of another session
            await services[1].delete(SID, other)
        assert all(len(s.shard.store) == 1 for s in services)  # nothing changed
        # an expired ticket still ends its session (a session outlives its 5-minute ticket)
        old = route_ticket(SID, RouteId("r1"), "mix", ticket_hops(route), ttl_s=60, now=time.time() - 3600)
        await services[0].delete(SID, signer.sign(old))
        for service in services:
            assert len(service.shard.store) == 0
            with pytest.raises((SessionNotFound, SessionGone)):
                service.session_state(SID)

    asyncio.run(main())
