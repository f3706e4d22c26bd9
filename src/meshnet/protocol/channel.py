"""Frames of the decode channel: the kept-open WebSocket between a gateway and each hop of its
routes, and between neighbouring hops (docs/protocol.md, "Decode channel").

Every WebSocket *binary* message is one frame::

    b"MN" | version u8 (3) | kind u8 | header length u32 little-endian | header | body

The header is small: binary for a ``STEP`` (``step_frame``: the step a ``decode-step`` or
``verify`` request would carry, field by field, read back by ``read_step`` with the checks the HTTP
binding makes — a decode step's header is read and written on every hop of every token, and JSON
of ``X-Meshnet-*`` strings cost a hop ~0.1 ms of it with the caches cold after the compute), UTF-8
JSON for every other kind. The body is the raw tensor, exactly the bytes the HTTP binding sends, so
nothing large is ever parsed. Kinds:

- ``HELLO`` (server → dialer, once, first): ``{"channel": id, "node": node_id, "version": 3}``.
  The id names this connection as a return address.
- ``STEP`` (gateway → head, hop → next hop): the session, the step's number (``seq``), the return
  ids (the channel id of each hop from the receiver on) and the request — verify or not, its
  position, drafts, guess, rewind, model, route id, ticket, sampling, next hops, the tensor's dtype
  and shape (docs/protocol.md has the layout) — + the step's body.
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
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Generic, TypeGuard, TypeVar

from meshnet.errors import InvalidRequest, MeshnetError, PayloadTooLarge, SeamMismatch
from meshnet.httputil import error_body
from meshnet.ids import SessionId
from meshnet.protocol.http_binding import parse_hops
from meshnet.protocol.messages import HopAnswer, HopEntry, HopRequest, Payload, Verb, answer_from_json
from meshnet.protocol.wire import DTYPES, frame_of

K = TypeVar("K")

__all__ = [
    "CHANNEL_PATH",
    "MAX_HEADER_BYTES",
    "VERSION",
    "ChannelFrame",
    "Credit",
    "Direct",
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
    "step_ids",
    "token_frame",
    "ws_url",
]

CHANNEL_PATH = "/v1/channel"
MAGIC = b"MN"
VERSION = 3  # 2: the hops before the tail send their entries to the gateway (ENTRY); 3: binary STEP headers
MAX_HEADER_BYTES = 1 << 20
_PREFIX = struct.Struct("<2sBBI")
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
    """A frame: its JSON header (``{}`` for a ``STEP``, whose binary header is ``raw``) and body."""

    kind: Kind
    header: dict[str, Any]
    body: bytes = b""
    raw: bytes = b""


def encode_frame(kind: Kind, header: dict[str, Any], body: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, int(kind), len(raw)) + raw + body


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
    if kind == Kind.STEP:  # a binary header, read by read_step
        end = _PREFIX.size + size
        return ChannelFrame(Kind.STEP, {}, bytes(data[end:]), bytes(data[_PREFIX.size : end]))
    try:
        header = json.loads(data[_PREFIX.size : _PREFIX.size + size])
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"channel frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidRequest("channel frame header must be a JSON object")
    return ChannelFrame(Kind(kind), header, bytes(data[_PREFIX.size + size :]))


class Step:
    """A ``STEP`` frame whose header was read and checked (``read_step``): the session, the step's
    number, the return ids of the receiving hop and every hop after it; ``request`` checks the body
    and gives the request (a decode step or a verify chunk)."""

    __slots__ = ("_build", "returns", "seq", "session")

    def __init__(
        self, session: str, seq: int, returns: tuple[str, ...], build: Callable[[int], HopRequest]
    ) -> None:  # fmt: skip
        self.session, self.seq, self.returns, self._build = session, seq, returns, build

    def request(self, max_body_bytes: int) -> HopRequest:
        """The request, its body checked against its shape and dtype and against ``max_body_bytes``."""
        return self._build(max_body_bytes)


# A STEP frame's binary header, little-endian (docs/protocol.md, "Decode channel"):
#   seq u64 | session: u8 length + ASCII | flags u8 | position u32 | guess u32 | dtype u8 | rank u8 |
#   drafts u16 | shape u32 x rank | drafted ids u32 x drafts | returns: u8 count, each u8 length + ASCII |
#   model, route id, ticket, sampling, next hops (comma-separated): each u32 length + UTF-8, _ABSENT: none
_STEP_SEQ = struct.Struct("<Q")
_STEP_FIXED = struct.Struct("<BIIBBH")
_VERIFY, _REWIND, _GUESS, _TOKEN_IDS = 1, 2, 4, 8
_FLAGS = _VERIFY | _REWIND | _GUESS | _TOKEN_IDS
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}
_DTYPE_NAMES = tuple(DTYPES)
_ABSENT = 0xFFFFFFFF
_U32 = struct.Struct("<I")


def _short(text: str) -> bytes:
    raw = text.encode("ascii")
    return bytes((len(raw),)) + raw


def _long(text: str | None) -> bytes:
    if text is None:
        return _U32.pack(_ABSENT)
    raw = text.encode()
    return _U32.pack(len(raw)) + raw


def step_frame(request: HopRequest, seq: int, returns: Sequence[str]) -> bytes:
    """``request`` (a decode step or verify chunk) as a ``STEP`` frame: from the gateway to the head,
    or from a hop to the next. What only a prefill or a replay carries has no place in one."""
    if request.verb not in (Verb.DECODE, Verb.VERIFY):
        raise ValueError(f"a STEP frame carries a decode step or a verify chunk, not a {request.verb}")
    if request.replay or request.chunks is not None or request.sample or request.prefix is not None:
        raise ValueError("a STEP frame carries no replay, compute chunks, prompt end or prefix claim")
    frame, ids = request.payload.frame, request.payload.token_ids
    flags = (
        (_VERIFY if request.verb is Verb.VERIFY else 0)
        | (_REWIND if request.rewind else 0)
        | (_GUESS if request.guess is not None else 0)
        | (_TOKEN_IDS if ids is not None else 0)
    )
    rank, drafts = len(frame.shape), request.drafts
    header = b"".join((
        _STEP_SEQ.pack(seq), _short(request.session),
        _STEP_FIXED.pack(flags, request.start, request.guess or 0, _DTYPE_CODES[frame.dtype], rank, len(drafts)),
        struct.pack(f"<{rank}I{len(drafts)}I", *frame.shape, *drafts),
        bytes((len(returns),)), *map(_short, returns),
        _long(request.model), _long(request.route_id), _long(request.ticket), _long(request.sampling),
        _long(None if request.next_hops is None else ",".join(request.next_hops)),
    ))  # fmt: skip
    body = frame.body if ids is None else ids + frame.body
    return _PREFIX.pack(MAGIC, VERSION, Kind.STEP, len(header)) + header + body


class _Reader:
    """Reads a STEP header field by field; running past its end is an ``InvalidRequest``."""

    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, size: int, what: str) -> bytes:
        end = self.at + size
        if end > len(self.data):
            raise InvalidRequest(f"a STEP frame's header ends before its {what} ({len(self.data)} bytes)")
        chunk, self.at = self.data[self.at : end], end
        return chunk

    def unpack(self, layout: struct.Struct, what: str) -> tuple[Any, ...]:
        return layout.unpack(self.take(layout.size, what))

    def short(self, what: str) -> str:
        raw = self.take(self.take(1, what)[0], what)
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise InvalidRequest(f"a STEP frame's {what} is not ASCII") from None

    def long(self, what: str) -> str | None:
        (size,) = self.unpack(_U32, what)
        if size == _ABSENT:
            return None
        try:
            return self.take(size, what).decode()
        except UnicodeDecodeError:
            raise InvalidRequest(f"a STEP frame's {what} is not UTF-8") from None


def read_step(frame: ChannelFrame) -> Step:
    """A ``STEP`` frame's header, every field checked as the HTTP binding checks the same request's
    headers (``InvalidRequest`` or ``SeamMismatch`` saying what is wrong); its body is checked when
    the request is taken (``Step.request``)."""
    if frame.kind is not Kind.STEP:
        raise InvalidRequest(f"a node takes STEP frames on its channel, got {frame.kind.name}")
    r = _Reader(frame.raw)
    (seq,) = r.unpack(_STEP_SEQ, "step number")
    session = r.short("session id")
    if not 0 < len(session) <= MAX_SESSION_ID:
        raise InvalidRequest(f"a STEP frame's session id is 1..{MAX_SESSION_ID} characters, got {len(session)}")
    flags, start, guess, dtype, rank, n_drafts = r.unpack(_STEP_FIXED, "fields")
    if flags & ~_FLAGS:
        raise InvalidRequest(f"a STEP frame's flags {flags:#04x} set bits this node does not know ({_FLAGS:#04x})")
    if dtype >= len(_DTYPE_NAMES):
        raise SeamMismatch(f"a STEP frame's dtype {dtype} is not one of 0..{len(_DTYPE_NAMES) - 1} "
                           f"({', '.join(_DTYPE_NAMES)})")  # fmt: skip
    verify = bool(flags & _VERIFY)
    if verify != (n_drafts > 0):
        raise InvalidRequest("a verify chunk carries its drafted token ids, and a decode step none")
    shape = struct.unpack(f"<{rank}I", r.take(4 * rank, "shape"))
    drafts = struct.unpack(f"<{n_drafts}I", r.take(4 * n_drafts, "drafted token ids"))
    returns = tuple(r.short("return ids") for _ in range(r.take(1, "return ids")[0]))
    if not returns:
        raise InvalidRequest("a STEP frame needs the return ids of this hop and every hop after it")
    model, route_id, ticket = r.long("model"), r.long("route id"), r.long("ticket")
    sampling, hops = r.long("sampling"), r.long("next hops")
    if r.at != len(frame.raw):
        raise InvalidRequest(f"a STEP frame's header has {len(frame.raw) - r.at} bytes after its last field")
    n = 1 + n_drafts

    def build(max_body_bytes: int) -> HopRequest:
        body, ids = frame.body, None
        if len(body) > max_body_bytes:
            raise PayloadTooLarge(f"step body of {len(body)} bytes exceeds this node's limit of {max_body_bytes} bytes")
        if flags & _TOKEN_IDS:
            if len(body) < 4 * n:
                raise SeamMismatch(f"a STEP frame's body is shorter than the {n} token ids its flags announce")
            ids, body = body[: 4 * n], body[4 * n :]
        return HopRequest(
            Verb.VERIFY if verify else Verb.DECODE, SessionId(session), start, n,
            Payload(frame_of(body, shape, _DTYPE_NAMES[dtype]), ids), model, route_id,
            None if hops is None else parse_hops(hops),
            sampling or None, None, False, drafts, 0, bool(flags & _REWIND), guess if flags & _GUESS else None, ticket,
        )  # fmt: skip

    return Step(session, seq, returns, build)


def step_ids(frame: ChannelFrame) -> tuple[str | None, int | None]:
    """The session and step number a frame names, each where it is well-formed (else ``None``): what
    an error about the rest of the frame is reported under."""
    if frame.kind is Kind.STEP:
        raw = frame.raw
        if len(raw) < _STEP_SEQ.size:
            return None, None
        (seq,) = _STEP_SEQ.unpack_from(raw)
        size = raw[_STEP_SEQ.size] if len(raw) > _STEP_SEQ.size else 0
        name = raw[_STEP_SEQ.size + 1 : _STEP_SEQ.size + 1 + size]
        ok = 0 < size <= MAX_SESSION_ID and len(name) == size and name.isascii()
        return (name.decode("ascii") if ok else None), seq
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
