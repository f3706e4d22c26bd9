"""Frames of the decode channel: the kept-open WebSocket between a gateway and each hop of its
routes, and between neighbouring hops (docs/protocol.md, "Decode channel").

Every WebSocket *binary* message is one frame::

    b"MN" | version u8 (2) | kind u8 | header length u32 little-endian | header (UTF-8 JSON) | body

The header is small (a session id, a step number and the same ``X-Meshnet-*`` fields a
``decode-step`` request carries); the body is the raw tensor, exactly the bytes the HTTP binding
sends, so nothing large is ever parsed as JSON. Kinds:

- ``HELLO`` (server → dialer, once, first): ``{"channel": id, "node": node_id, "version": 2}``.
  The id names this connection as a return address.
- ``STEP`` (gateway → head, hop → next hop): ``{"session", "seq", "verb": "decode-step"|"verify",
  "headers": {X-Meshnet-*: str}, "returns": [channel id per hop from the receiver on]}`` + the
  step's body.
- ``ENTRY`` (a hop before the tail → gateway, on the gateway's own channel to that hop):
  ``{"session", "seq", "entry": {...}}`` — the hop's signed entry for the step, sent once the step
  has gone on: its signature is off the token's path through the route.
- ``TOKEN`` (tail → gateway, on the gateway's own channel to the tail): ``{"session", "seq",
  "answer": {...}}`` — the answer a ``decode-step``/``verify`` request would get, with the tail's
  entry; the gateway puts the other hops' ``ENTRY`` entries before it.
- ``ERROR`` (any hop → gateway, on the gateway's channel to that hop): ``{"session", "seq",
  "status", "error": {...}}`` — the error body the HTTP binding would send.
- ``CREDIT`` (gateway → tail, on the gateway's channel to the tail): ``{"session", "after", "seq",
  "head", "returns", "model", "route_id", "stop"}`` — leave to *relay*: once the tail has answered
  step ``after`` with a token not in ``stop``, it sends the next decode step (that token, at the
  answer's position) to ``head`` itself, as step ``seq`` returning to ``returns``, and says so in
  its ``TOKEN`` (``"relayed": seq``). One use; a credit for any other step is dropped.
"""

from __future__ import annotations

import asyncio
import functools
import json
import struct
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Generic, TypeGuard, TypeVar

from meshnet.errors import InvalidRequest, MeshnetError
from meshnet.httputil import error_body
from meshnet.protocol import http_binding
from meshnet.protocol.messages import HopAnswer, HopEntry, HopRequest, answer_from_json

K = TypeVar("K")

__all__ = [
    "CHANNEL_PATH",
    "MAX_HEADER_BYTES",
    "VERSION",
    "ChannelFrame",
    "Credit",
    "Direct",
    "Fields",
    "InOrder",
    "Kind",
    "Step",
    "credit_frame",
    "decode_frame",
    "encode_frame",
    "entry_frame",
    "error_frame",
    "read_credit",
    "read_entry",
    "read_step",
    "read_token",
    "relayed_of",
    "step_frame",
    "step_frame_of",
    "step_ids",
    "token_frame",
    "ws_url",
]

CHANNEL_PATH = "/v1/channel"
MAGIC = b"MN"
VERSION = 2  # 2: the hops before the tail send their entries to the gateway (ENTRY)
MAX_HEADER_BYTES = 1 << 20
_PREFIX = struct.Struct("<2sBBI")
STEP_VERBS = {"decode-step": False, "verify": True}  # a STEP frame's verb -> is a verify chunk
MAX_SESSION_ID = 128


class Kind(IntEnum):
    HELLO = 1
    STEP = 2
    TOKEN = 3
    ERROR = 4
    CREDIT = 5
    ENTRY = 6


@dataclass(frozen=True, slots=True)
class ChannelFrame:
    kind: Kind
    header: dict[str, Any]
    body: bytes = b""


def encode_frame(kind: Kind, header: dict[str, Any], body: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, int(kind), len(raw)) + raw + body


class Fields(Mapping[str, str]):
    """A ``STEP`` frame's ``X-Meshnet-*`` fields, looked up without regard to case as HTTP headers are
    (the first of names that differ only in case wins, as in Starlette's ``Headers``). A dict of the
    lowered names: ``Headers`` scans its whole list at every lookup, and reading a step takes about
    twenty."""

    __slots__ = ("_fields",)

    def __init__(self, raw: Mapping[str, str]) -> None:
        fields: dict[str, str] = {}
        for name, value in raw.items():
            fields.setdefault(name.lower(), value)
        self._fields = fields

    def __getitem__(self, name: str) -> str:
        return self._fields[name.lower()]

    def get(self, name: str, default: Any = None) -> Any:
        return self._fields.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


@dataclass(frozen=True, slots=True)
class Direct:
    """A step that came over the decode channel: its number, and the return ids of this hop and the
    ones after it."""

    seq: int
    returns: tuple[str, ...]

    def onward(self) -> Direct:
        return Direct(self.seq, self.returns[1:])


class InOrder(Generic[K]):
    """Steps that run one after another per key (a session, on one channel or hop), each after the
    one before it has ended however it ended, and beside the steps of other keys."""

    def __init__(self) -> None:
        self._newest: dict[K, asyncio.Task[None]] = {}

    def start(self, key: K, step: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``step`` once the key's step before it has ended; its task."""
        before = self._newest.get(key)
        task = asyncio.ensure_future(step if before is None else _after(before, step))
        self._newest[key] = task
        task.add_done_callback(functools.partial(self._forget, key))
        return task

    def _forget(self, key: K, done: asyncio.Task[None]) -> None:
        if self._newest.get(key) is done:
            del self._newest[key]


async def _after(before: asyncio.Task[None], step: Coroutine[Any, Any, None]) -> None:
    await asyncio.wait([before])
    await step


def decode_frame(data: bytes) -> ChannelFrame:
    """One frame, or ``InvalidRequest`` saying what is wrong with it."""
    if len(data) < _PREFIX.size:
        raise InvalidRequest(f"a channel frame is at least {_PREFIX.size} bytes, got {len(data)}")
    magic, version, kind, size = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise InvalidRequest(f"not a Meshnet channel frame: it starts with {magic!r}, not {MAGIC!r}")
    if version != VERSION:
        raise InvalidRequest(f"channel frame version {version}; this node speaks version {VERSION}")
    if kind not in Kind._value2member_map_:
        raise InvalidRequest(f"unknown channel frame kind {kind}")
    if size > MAX_HEADER_BYTES or _PREFIX.size + size > len(data):
        raise InvalidRequest(f"channel frame header of {size} bytes does not fit the {len(data)}-byte frame")
    try:
        header = json.loads(data[_PREFIX.size : _PREFIX.size + size])
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"channel frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidRequest("channel frame header must be a JSON object")
    return ChannelFrame(Kind(kind), header, bytes(data[_PREFIX.size + size :]))


@dataclass(frozen=True, slots=True)
class Step:
    """A ``STEP`` frame, read and checked: the session, the step's number, whether it is a verify
    chunk, its ``X-Meshnet-*`` fields, the return ids of the receiving hop and every hop after it,
    and the body (the tensor, as the HTTP binding sends it)."""

    session: str
    seq: int
    verify: bool
    headers: dict[str, str]
    returns: tuple[str, ...]
    body: bytes


def step_frame(
    session: str, seq: int, *, verb: str, headers: dict[str, str], body: bytes, returns: Sequence[str]
) -> bytes:
    """A ``STEP`` frame: from the gateway to the head, or from a hop to the next."""
    header = {"session": session, "seq": seq, "verb": verb, "headers": headers, "returns": list(returns)}
    return encode_frame(Kind.STEP, header, body)


def step_frame_of(request: HopRequest, seq: int, returns: Sequence[str]) -> bytes:
    """``request`` (a decode step or verify chunk) as a ``STEP`` frame: its HTTP binding's fields and body."""
    headers, body = http_binding.encode_step(request)
    return step_frame(request.session, seq, verb=str(request.verb), headers=headers, body=body, returns=returns)


def read_step(frame: ChannelFrame) -> Step:
    """A ``STEP`` frame's fields, or ``InvalidRequest`` saying which is wrong."""
    if frame.kind is not Kind.STEP:
        raise InvalidRequest(f"a node takes STEP frames on its channel, got {frame.kind.name}")
    header = frame.header
    session, seq = header.get("session"), header.get("seq")
    if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_ID:
        raise InvalidRequest(f'a STEP frame needs "session": the session id, a string of 1..{MAX_SESSION_ID}')
    if not _is_seq(seq):
        raise InvalidRequest('a STEP frame needs "seq": the step\'s number, an integer >= 0')
    returns = header.get("returns")
    if not isinstance(returns, list) or not returns or not all(isinstance(r, str) for r in returns):
        raise InvalidRequest('a STEP frame needs "returns": the return ids of this hop and every hop after it')
    verb = header.get("verb")
    if verb not in STEP_VERBS:
        raise InvalidRequest(f'a STEP frame\'s "verb" is one of {", ".join(STEP_VERBS)}, got {verb!r}')
    raw = header.get("headers")
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise InvalidRequest('a STEP frame\'s "headers" are the X-Meshnet-* fields, an object of strings')
    return Step(session, seq, STEP_VERBS[verb], raw, tuple(returns), frame.body)


def step_ids(frame: ChannelFrame) -> tuple[str | None, int | None]:
    """The session and step number a frame names, each where it is well-formed (else ``None``): what
    an error about the rest of the frame is reported under."""
    session, seq = frame.header.get("session"), frame.header.get("seq")
    return (session if isinstance(session, str) else None), (seq if _is_seq(seq) else None)


def _is_seq(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def token_frame(session: str, seq: int, answer: dict[str, Any], relayed: int | None = None) -> bytes:
    """The tail's answer to a step (its answer record's ``to_json``), on the gateway's channel to the
    tail; ``relayed``: the step the tail sent on after it with a ``CREDIT`` (its number)."""
    header: dict[str, Any] = {"session": session, "seq": seq, "answer": answer}
    if relayed is not None:
        header["relayed"] = relayed
    return encode_frame(Kind.TOKEN, header)


def entry_frame(session: str, seq: int, entry: HopEntry) -> bytes:
    """A hop's own signed entry for a step it passed on, on the gateway's channel to that hop."""
    return encode_frame(Kind.ENTRY, {"session": session, "seq": seq, "entry": entry.to_json()})


def read_entry(frame: ChannelFrame) -> HopEntry:
    """The entry an ``ENTRY`` frame carries; ``ValueError`` when it carries none."""
    return HopEntry.from_json(frame.header.get("entry"))


def relayed_of(frame: ChannelFrame) -> int | None:
    """The step a ``TOKEN`` frame says the tail relayed after it, if it says one."""
    relayed = frame.header.get("relayed")
    return relayed if _is_seq(relayed) else None


@dataclass(frozen=True, slots=True)
class Credit:
    """A gateway's leave for the tail to send the next decode step itself (``CREDIT``): after it has
    answered step ``after`` of ``session`` with a token not in ``stop``, that token goes to ``head``
    as step ``seq``, its reports to the channels ``returns`` names (head first), with the session's
    ``model`` and ``route_id``."""

    session: str
    after: int
    seq: int
    head: str
    returns: tuple[str, ...]
    model: str | None
    route_id: str | None
    stop: frozenset[int]


def credit_frame(credit: Credit) -> bytes:
    header = {"session": credit.session, "after": credit.after, "seq": credit.seq, "head": credit.head,
              "returns": list(credit.returns), "model": credit.model, "route_id": credit.route_id,
              "stop": sorted(credit.stop)}  # fmt: skip
    return encode_frame(Kind.CREDIT, header)


def read_credit(frame: ChannelFrame) -> Credit:
    """A ``CREDIT`` frame's fields, or ``InvalidRequest`` saying which is wrong."""
    h = frame.header
    session = h.get("session")
    if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_ID:
        raise InvalidRequest(f'a CREDIT frame needs "session": the session id, a string of 1..{MAX_SESSION_ID}')
    after, seq = h.get("after"), h.get("seq")
    if not _is_seq(after) or not _is_seq(seq):
        raise InvalidRequest('a CREDIT frame needs "after" and "seq": the numbers of the step it follows and its own')
    head = h.get("head")
    if not isinstance(head, str) or not head.startswith(("http://", "https://")):
        raise InvalidRequest('a CREDIT frame needs "head": the URL of the route\'s head')
    returns = h.get("returns")
    if not isinstance(returns, list) or not returns or not all(isinstance(r, str) for r in returns):
        raise InvalidRequest('a CREDIT frame needs "returns": the return ids of every hop of the route, head first')
    model, route_id = h.get("model"), h.get("route_id")
    if not all(v is None or isinstance(v, str) for v in (model, route_id)):
        raise InvalidRequest('a CREDIT frame\'s "model" and "route_id" are strings')
    stop = h.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
        raise InvalidRequest('a CREDIT frame\'s "stop" is a list of token ids')
    return Credit(session, after, seq, head, tuple(returns), model, route_id, frozenset(stop))


def read_token(frame: ChannelFrame) -> HopAnswer:
    """The answer a ``TOKEN`` frame carries; ``ValueError`` when it carries none."""
    return answer_from_json(200, frame.header.get("answer"))


def error_frame(session: str | None, seq: int | None, error: MeshnetError) -> bytes:
    return encode_frame(Kind.ERROR, {"session": session, "seq": seq, "status": error.status, **error_body(error)})


def ws_url(http_url: str) -> str:
    """The channel's address on a node advertised at ``http_url``."""
    scheme, sep, rest = http_url.rstrip("/").partition("://")
    if not sep or scheme not in ("http", "https"):
        raise ValueError(f"a node URL must be http:// or https://, got {http_url!r}")
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest}{CHANNEL_PATH}"
