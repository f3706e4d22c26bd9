"""The gateway's side of the decode channel (docs/protocol.md, "Decode channel"), on asyncio.

The gateway keeps one WebSocket open to every node its routes use, shared by every generation.
A decode step goes to the head as a ``STEP`` frame naming each hop's *return id* (the id the node
gave this gateway's channel in its ``HELLO``); the head passes it on over its own channel to the
next hop, and so on; the tail sends the ``TOKEN`` straight back on the gateway's channel to the
tail, each hop before it sends its own signed entry (``ENTRY``) on the gateway's channel to itself
once the step has gone on, and any hop that fails sends an ``ERROR`` there. So a step costs one
one-way leg per seam plus one back, no hop signs on the token's path but the tail, and a failure
still names the hop. The answer is the tail's with the other hops' entries before its own, in
route order, once all of them are in.

A node whose channel closes (its process died) fails every step waiting on a route through it at
once, naming it; a step that hears nothing within its deadline is located by asking each hop what
it holds (``GET /v1/sessions/{id}``): the first hop that did not compute it is the failed one.

Concurrency: one event loop (the gateway's) owns every channel; one reader task per channel hands
each frame to the step waiting for it. Opening a channel (TCP, TLS, the WebSocket upgrade and the
node's ``HELLO``) is bounded as a whole by one deadline: cancelling the open wakes whatever it waits
on, a TLS read included, so a peer that completes TLS and then says nothing costs the deadline and
no more, with no watchdog beside it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from meshnet.errors import BadGateway, HopFailed, InvalidRequest, hop_error
from meshnet.protocol.channel import (
    MAX_HEADER_BYTES,
    ChannelFrame,
    Credit,
    Kind,
    credit_frame,
    decode_frame,
    read_entry,
    read_token,
    relayed_of,
    step_frame,
    ws_url,
)
from meshnet.protocol.messages import HopAnswer, HopEntry, HopRequest
from meshnet.protocol.ws_send import send_now

__all__ = ["ChannelUnavailable", "Channels", "Probe", "StepSlot", "no_entry", "silent_hop"]

log = logging.getLogger("meshnet.gateway")

_OPEN_TIMEOUT_S = 5.0
# a node that refused its channel (or did not open it in time: a loaded machine, a node starting)
# gets HTTP steps this long before it is dialed again, twice as long after each refusal in a row
_RETRY_FIRST_S = 2.0
_RETRY_S = 30.0  # at most
_MAX_FRAME_BYTES = 64 * 2**20 + MAX_HEADER_BYTES
_CLOSE_TIMEOUT_S = 3.0  # websockets' closing handshake waits close_timeout (2 s); past this the socket is cut


class ChannelUnavailable(Exception):
    """A node of the route takes no decode channel (an older node, a proxy that passes no WebSocket,
    a node that is down): nothing was sent, the caller sends the step over HTTP instead."""


# (node url, step seq) -> True: it computed the step; False: it did not; None: it cannot be asked
Probe = Callable[[str, int], Awaitable[bool | None]]


@dataclass(frozen=True, slots=True)
class _Closed:
    url: str
    reason: str


@dataclass(frozen=True, slots=True)
class _Report:
    url: str  # the node whose channel it came on
    frame: ChannelFrame


class StepSlot:
    """A step's number and the future of its answer (``Channels.reserve``), and, while it waits,
    what settles it: the first report that decides it (``Channels._report``), right where the frame
    is read — a task in between would cost every token a loop turn. What takes a request to decide
    (a closed channel, the deadline) runs in ``tasks``. ``launched``: the step is out — the gateway
    sent it, or the tail relayed it (its ``TOKEN`` said so). ``entries``: the entries the hops
    before the tail sent (``ENTRY``), by URL; ``pending``: the tail's answer while one is missing."""

    def __init__(self, key: tuple[str, int], urls: Sequence[str], answer: asyncio.Future[HopAnswer], probe: Probe,
                 timeout_s: float) -> None:  # fmt: skip
        self.key = key
        self.seq = key[1]
        self.urls = tuple(urls)
        self.members = frozenset(urls)
        self.answer = answer
        self.probe = probe
        self.timeout_s = timeout_s
        self.timer: asyncio.TimerHandle | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.launched = False
        self.entries: dict[str, HopEntry] = {}
        self.pending: HopAnswer | None = None

    def settle(self, item: _Report | _Closed | HopFailed) -> bool:
        """Settle the answer by ``item``; False when it is the tail's answer and a hop's entry is still
        to come (it waits in ``pending``)."""
        if self.answer.done():
            return True
        if isinstance(item, HopFailed):
            self.answer.set_exception(item)
            return True
        try:
            answer = _answer(item, self.urls)
        except Exception as exc:  # the failure the report stands for
            self.answer.set_exception(exc)
            return True
        return self.take(answer)

    def take(self, answer: HopAnswer) -> bool:
        """The tail's answer: settles the step if every other hop's entry is in, else waits for them."""
        self.pending = answer
        return self.complete()

    def add_entry(self, url: str, entry: HopEntry) -> bool:
        """A hop's own entry (its ``ENTRY``); True when that settled the answer."""
        self.entries.setdefault(url, entry)
        return self.pending is not None and self.complete()

    def missing(self) -> str | None:
        """The first hop before the tail whose entry has not come."""
        return next((url for url in self.urls[:-1] if url not in self.entries), None)

    def complete(self) -> bool:
        """Settle the answer with the tail's and every other hop's entry, if all are in."""
        if self.pending is None or self.missing() is not None:
            return False
        self.answer.set_result(self.pending.after(*(self.entries[url] for url in self.urls[:-1])))
        return True

    def run(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def end(self) -> None:
        """The answer is settled or of no more use: no timer, no request still out for it."""
        if self.timer is not None:
            self.timer.cancel()
        current = asyncio.current_task()
        for task in list(self.tasks):
            if task is not current:
                task.cancel()


class _NodeChannel:
    """One open channel: frames go out one at a time, and its reader task hands every frame that
    comes in to ``Channels.deliver`` (and says ``Channels.lost`` when the channel ends)."""

    def __init__(self, owner: Channels, url: str, connection: ClientConnection, return_id: str) -> None:
        self.url = url
        self.connection = connection
        self.return_id = return_id
        self.closed = False
        self._send_lock = asyncio.Lock()
        self._reader = asyncio.create_task(self._read(owner), name=f"channel {url}")

    @classmethod
    async def open(cls, owner: Channels, url: str) -> _NodeChannel:
        """Dial the node at ``url`` and read its ``HELLO``, all within ``_OPEN_TIMEOUT_S``; any
        failure is ``ChannelUnavailable`` naming the node and the cause (nothing was sent).

        No proxy: a route's nodes are dialed directly, as their HTTP steps are."""
        connection: ClientConnection | None = None
        failure = "refused its decode channel"
        try:
            async with asyncio.timeout(_OPEN_TIMEOUT_S):
                connection = await connect(ws_url(url), ssl=owner.tls if url.startswith("https:") else None,
                                           proxy=None, open_timeout=_OPEN_TIMEOUT_S, compression=None,
                                           max_size=_MAX_FRAME_BYTES, close_timeout=2)  # fmt: skip
                failure = "sent no HELLO on its decode channel"
                hello = decode_frame(bytes(await connection.recv(decode=False)))
                if hello.kind is not Kind.HELLO or not isinstance(hello.header.get("channel"), str):
                    raise InvalidRequest(f"it opened with {hello.kind.name}, not HELLO")
        except (OSError, WebSocketException, InvalidRequest) as exc:  # OSError: TimeoutError too
            if connection is not None:
                connection.transport.abort()
            cause = str(exc) or f"not open within {_OPEN_TIMEOUT_S:g} s"
            raise ChannelUnavailable(f"node {url} {failure}: {type(exc).__name__}: {cause}") from None
        except BaseException:  # cancelled: the half-open connection must not outlive the dial
            if connection is not None:
                connection.transport.abort()
            raise
        return cls(owner, url, connection, hello.header["channel"])

    async def send(self, data: bytes) -> None:
        """Nothing went out when this fails: the caller can still send the step another way."""
        try:
            if self._send_lock.locked() or not send_now(self.connection, data):
                async with self._send_lock:
                    await self.connection.send(data)
        except (OSError, WebSocketException) as exc:
            raise ChannelUnavailable(f"node {self.url}: decode channel lost: {exc}") from None

    async def _read(self, owner: Channels) -> None:
        reason = "closed"
        try:
            async for message in self.connection:
                try:
                    frame = decode_frame(message if isinstance(message, bytes) else message.encode())
                except Exception as exc:
                    log.warning("node %s sent an unreadable channel frame: %s", self.url, exc)
                    continue
                owner.deliver(_Report(self.url, frame))
        except (OSError, WebSocketException) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            self.closed = True
            owner.lost(self, reason)

    async def close(self) -> None:
        """Bounded: a peer that does not finish the closing handshake in time is cut off, and the
        reader, which ends with the connection, is cancelled if it has not."""
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await self.connection.close()
        except Exception:
            self.connection.transport.abort()
        self._reader.cancel()
        await asyncio.wait([self._reader], timeout=1.0)


class Channels:
    """Kept-open decode channels to nodes, by URL; to ``https`` nodes with the member TLS ``tls``.

    Every method runs on the one event loop that owns the channels: no lock guards the tables, and
    only a dial (which waits on the network) is serialized, per URL."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self._open: dict[str, _NodeChannel] = {}
        self._dialing: dict[str, asyncio.Lock] = {}
        self._waiters: dict[tuple[str, int], StepSlot] = {}
        self._seq = itertools.count()
        # url -> (when its channel was last refused, HTTP steps for this long from then): _channel
        self._refused: dict[str, tuple[float, float]] = {}

    async def _channel(self, url: str) -> _NodeChannel:
        channel = self._open.get(url)
        if channel is not None and not channel.closed:
            return channel
        refused_at, wait_s = self._refused.get(url, (0.0, 0.0))
        if wait_s and time.monotonic() - refused_at < wait_s:
            raise ChannelUnavailable(f"node {url} refused its decode channel less than {wait_s:g} s ago")
        async with self._dialing.setdefault(url, asyncio.Lock()):
            channel = self._open.get(url)
            if channel is not None and not channel.closed:
                return channel
            try:
                channel = await _NodeChannel.open(self, url)
            except ChannelUnavailable as exc:
                wait_s = min(_RETRY_S, 2 * wait_s) if wait_s else _RETRY_FIRST_S
                self._refused[url] = (time.monotonic(), wait_s)
                log.warning("%s; its routes get HTTP decode steps, the channel is tried again in %g s", exc, wait_s)
                raise
            self._open[url] = channel
            self._refused.pop(url, None)
            return channel

    async def start(
        self,
        urls: Sequence[str],
        request: HopRequest,
        *,
        timeout_s: float,
        probe: Probe,
        slot: StepSlot | None = None,
    ) -> asyncio.Future[HopAnswer]:
        """Send ``request`` (a decode step or verify chunk) to the route of nodes at ``urls`` (head
        first), as ``slot``'s step if given (``reserve``); once it is sent, the future of the tail's
        answer (cancel it when the answer is of no more use). A session's steps reach every hop in
        the order they were started, so several can be in flight (pipelined speculation rounds).

        Raises ``ChannelUnavailable`` (before anything was sent) when a node takes no channel; the
        future raises ``HopFailed`` naming the hop that failed, ``BadGateway`` for an error of the
        head's own. ``await probe(url, seq)`` says whether the node at ``url`` has computed step
        ``seq`` (``None``: it cannot say); it locates a failure: a hop whose channel closed is named
        only once the hop before it has computed the step (else that one's own report is awaited, so
        a repair always has an upstream that holds the step), and after ``timeout_s`` of silence the
        first hop that has not computed it is named. The deadline covers sending the step too: a
        head that takes no more bytes for ``timeout_s`` is located the same way (part of the frame
        may have gone out, so it is no ``ChannelUnavailable``)."""
        channels = [await self._channel(url) for url in urls]
        session = request.session
        waiter = slot if slot is not None else await self.reserve(urls, session, timeout_s=timeout_s, probe=probe)
        frame = step_frame(request, waiter.seq, [c.return_id for c in channels])
        try:
            for channel in channels:  # one that closed before the waiter was registered never tells it
                if channel.closed:
                    self._report(waiter, _Closed(channel.url, "closed"))
            deadline = asyncio.get_running_loop().time() + timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    await channels[0].send(frame)
            except TimeoutError:
                raise await silent_hop(urls, waiter.seq, timeout_s, probe) from None
        except BaseException:
            if waiter.answer.done() and not waiter.answer.cancelled():
                waiter.answer.exception()  # settled by a closed channel: what is raised here says it
            waiter.answer.cancel()
            self._forget(waiter)
            raise
        self._launched(waiter)
        return waiter.answer

    async def reserve(self, urls: Sequence[str], session: str, *, timeout_s: float, probe: Probe) -> StepSlot:
        """A step number of ``session`` on the route at ``urls`` and the future of its answer, before the
        step is sent: by ``start``, or by the route's tail after the step before it (a ``CREDIT``).
        Reports for it are taken from now on; its deadline runs once it is out (``launched``). Cancel
        its future if it is never used. ``ChannelUnavailable`` when the channel to a node is not open
        (``start`` dials them first; a leave to relay is not worth waiting for a dial)."""
        for url in urls:
            channel = self._open.get(url)
            if channel is None or channel.closed:
                raise ChannelUnavailable(f"no decode channel open to node {url}")
        seq = next(self._seq)
        key = (session, seq)
        waiter = StepSlot(key, urls, asyncio.get_running_loop().create_future(), probe, timeout_s)
        self._waiters[key] = waiter
        waiter.answer.add_done_callback(functools.partial(self._forget, waiter))  # cancelled by its consumer
        return waiter

    async def credit(self, slot: StepSlot, *, after: int, model: str | None, route_id: str | None,
                     stop: Iterable[int]) -> bool:  # fmt: skip
        """Give the route's tail leave to relay ``slot``'s step once it has answered step ``after``
        (a ``CREDIT`` frame on this gateway's channel to it); False when it could not be sent (the
        gateway sends the step itself)."""
        session, seq = slot.key
        channels = [self._open.get(url) for url in slot.urls]
        if any(c is None or c.closed for c in channels):
            return False
        returns = tuple(c.return_id for c in channels if c is not None)
        credit = Credit(session, after, seq, slot.urls[0], returns, model, route_id, frozenset(stop))
        tail = channels[-1]
        assert tail is not None
        try:
            await tail.send(credit_frame(credit))
        except ChannelUnavailable:
            return False
        return True

    def _launched(self, waiter: StepSlot) -> None:
        """The step is out: its deadline runs from now."""
        if waiter.launched or waiter.answer.done():
            waiter.launched = True
            return
        waiter.launched = True
        waiter.timer = asyncio.get_running_loop().call_later(waiter.timeout_s, lambda: waiter.run(self._silent(waiter)))

    def _report(self, waiter: StepSlot, item: _Report | _Closed) -> None:
        """A frame (or a lost channel) for a waiting step: it settles the step, unless it is a closed
        channel past the head, which counts only once the hop before it has computed the step, or
        the channel of the tail or of a hop whose entry is in while the tail's answer waits for another's."""
        if waiter.answer.done():
            return
        if isinstance(item, _Report) and item.frame.kind is Kind.ENTRY:
            self._entry(waiter, item)
            return
        if isinstance(item, _Closed) and waiter.pending is not None:
            # only a hop before the tail that has not sent its entry matters now: the tail has answered
            if item.url in waiter.urls[:-1] and item.url not in waiter.entries:
                cause = f"its decode channel closed ({item.reason}) before it sent its entry for step {waiter.seq}"
                self._settle(waiter, HopFailed(f"node {item.url} failed: {cause}", failed_hop=item.url))
            return
        if isinstance(item, _Closed):
            at = waiter.urls.index(item.url)
            if at > 0:
                waiter.run(self._closed(waiter, item, at))
                return
        self._settle(waiter, item)

    def _settle(self, waiter: StepSlot, item: _Report | _Closed | HopFailed) -> None:
        if waiter.settle(item):
            self._forget(waiter)  # now: the session's next step may start before the answer's callbacks run

    def _entry(self, waiter: StepSlot, report: _Report) -> None:
        """A hop's ``ENTRY``: kept for the tail's answer (the first one a hop sends counts); from the
        tail, or without an entry, it is that hop's failure."""
        url = report.url
        if url == waiter.urls[-1]:
            self._settle(waiter, HopFailed(f"the tail {url} sent an ENTRY for step {waiter.seq}: a tail's entry comes "
                                           "with its TOKEN", failed_hop=url))  # fmt: skip
            return
        try:
            entry = read_entry(report.frame)
        except ValueError as exc:
            self._settle(waiter, HopFailed(f"node {url} sent an ENTRY without an entry: {exc}", failed_hop=url))
            return
        if waiter.add_entry(url, entry):
            self._forget(waiter)

    async def _closed(self, waiter: StepSlot, item: _Closed, at: int) -> None:
        if await waiter.probe(waiter.urls[at - 1], waiter.seq) is True:
            self._settle(waiter, item)
        # else the hop before it has not sent the step yet: its report will name the lost one

    async def _silent(self, waiter: StepSlot) -> None:
        missing = waiter.missing() if waiter.pending is not None else None
        if missing is not None:  # the tail answered: the hop passed the step on and withheld its entry
            self._settle(waiter, no_entry(missing, waiter.seq, f" within {waiter.timeout_s:.0f} s"))
            return
        self._settle(waiter, await silent_hop(waiter.urls, waiter.seq, waiter.timeout_s, waiter.probe))

    def _forget(self, waiter: StepSlot, _: object = None) -> None:
        if self._waiters.get(waiter.key) is waiter:
            del self._waiters[waiter.key]
        waiter.end()

    def deliver(self, report: _Report) -> None:
        header = report.frame.header
        key = (header.get("session"), header.get("seq"))
        waiter = self._waiters.get(key)  # type: ignore[arg-type]
        if waiter is not None and report.url not in waiter.members:
            log.warning("node %s sent a %s for a step of a route it is not on; ignored", report.url,
                        report.frame.kind.name)  # fmt: skip
        elif waiter is not None:
            relayed = relayed_of(report.frame) if report.frame.kind is Kind.TOKEN else None
            if relayed is not None and report.url == waiter.urls[-1]:
                slot = self._waiters.get((key[0], relayed))  # type: ignore[arg-type]
                if slot is not None and slot.urls == waiter.urls:
                    self._launched(slot)  # before the answer is settled: its reader sees the slot out
            self._report(waiter, report)
        elif report.frame.kind is Kind.ERROR:
            log.warning("node %s reported an error for no waiting step: %s", report.url, header.get("error"))

    def lost(self, channel: _NodeChannel, reason: str) -> None:
        if self._open.get(channel.url) is channel:
            del self._open[channel.url]
        for waiter in [w for w in self._waiters.values() if channel.url in w.members]:
            self._report(waiter, _Closed(channel.url, reason))

    async def aclose(self) -> None:
        """Close every channel (their waiting steps fail as for a lost channel); each close is bounded."""
        channels = list(self._open.values())
        self._open.clear()
        await asyncio.gather(*(channel.close() for channel in channels))


def no_entry(url: str, seq: int, within: str = "") -> HopFailed:
    """The failure of the hop at ``url``, which passed step ``seq`` on and sent no entry for it."""
    timed_out = "Timeout: " if within else ""
    return HopFailed(f"{timed_out}node {url} passed step {seq} on but sent no entry for it{within}", failed_hop=url)


async def silent_hop(urls: Sequence[str], seq: int, timeout_s: float, probe: Probe) -> HopFailed:
    """A step that heard nothing within ``timeout_s``, located: the first hop that has not computed
    it failed (the tail when every hop says it has: it computed the step and never answered)."""
    failed = urls[-1]
    for url in urls:
        if await probe(url, seq) is not True:
            failed = url
            break
    return HopFailed(f"Timeout: node {failed} did not pass step {seq} on within {timeout_s:.0f} s", failed_hop=failed)


def _answer(item: _Report | _Closed, urls: Sequence[str]) -> HopAnswer:
    """The tail's answer, or the failure as the HTTP binding reports it: an error past the head
    names the hop that sent it (or the one at or after it that it names), the head's own is the
    gateway's 502. A token counts only from the tail's channel: a hop that answers for the route
    (skipping the hops after it) has failed."""
    if isinstance(item, _Closed):
        raise HopFailed(f"node {item.url} failed: its decode channel closed ({item.reason})", failed_hop=item.url)
    frame = item.frame
    if frame.kind is Kind.TOKEN and item.url != urls[-1]:
        raise HopFailed(f"node {item.url} sent the step's token, which only the tail {urls[-1]} computes",
                        failed_hop=item.url)  # fmt: skip
    if frame.kind is Kind.TOKEN:
        try:
            return read_token(frame)
        except ValueError as exc:
            raise HopFailed(f"the tail {item.url} sent a TOKEN frame without an answer: {exc}",
                            failed_hop=item.url) from None  # fmt: skip
    if frame.kind is not Kind.ERROR:
        raise BadGateway(f"node {item.url} sent a {frame.kind.name} frame for a step")
    raw = frame.header.get("error")
    error: dict[str, Any] = raw if isinstance(raw, dict) else {}
    status = frame.header.get("status")
    message = f"route hop answered {status}: {error.get('message', 'no message')}"
    at = urls.index(item.url)  # deliver() passes on only the route's own reports
    raise hop_error(message, status=status, failed_hop=error.get("failed_hop"), sender=item.url,
                    sender_is_head=at == 0, code=error.get("code"), may_name=urls[at:])  # fmt: skip
