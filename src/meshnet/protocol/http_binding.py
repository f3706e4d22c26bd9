"""The HTTP binding of the hop protocol (docs/protocol.md): records to requests and back.

``encode_request`` / ``decode_request`` map a ``HopRequest`` to ``POST /v1/sessions/{id}/{verb}``
headers and a raw body and back; ``encode_reroute`` / ``decode_reroute`` do the same for
``.../reroute`` and ``encode_prefix`` / ``decode_prefix`` for ``.../prefix``; answers travel as
JSON (an answer record's ``to_json`` / ``answer_from_response``), and an error answer becomes the
``MeshnetError`` it means to the sender (``error_from_response``). This is the only place that
reads or writes an ``X-Meshnet-*`` hop header; the decode channel's ``STEP`` frames carry the same
fields in binary (``protocol.channel``), checked the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from meshnet.errors import HopFailed, InvalidRequest, MeshnetError, SeamMismatch, hop_error
from meshnet.httputil import error_field, error_message
from meshnet.ids import SessionId
from meshnet.protocol import headers as H
from meshnet.protocol.ledger import format_chunks, parse_chunks
from meshnet.protocol.messages import (
    HopAnswer,
    HopRequest,
    Payload,
    PrefixClaim,
    PrefixRequest,
    RerouteRequest,
    RestoreRequest,
    Verb,
    answer_from_json,
)
from meshnet.protocol.prefix import format_prefix, parse_prefix
from meshnet.protocol.wire import format_shape, parse_range, read_frame, split_token_ids

__all__ = [
    "answer_from_response",
    "decode_prefix",
    "decode_request",
    "decode_reroute",
    "decode_restore",
    "encode_prefix",
    "encode_request",
    "encode_reroute",
    "encode_restore",
    "error_from_response",
    "parse_hops",
    "request_path",
]

OCTETS = "application/octet-stream"


def request_path(session: SessionId, verb: Verb | str) -> str:
    return f"/v1/sessions/{session}/{verb}"


def encode_request(request: HopRequest) -> tuple[str, dict[str, str], bytes]:
    """``(path, headers, body)`` of a hop request."""
    frame = request.payload.frame
    headers: dict[str, str] = {}
    if request.model is not None:
        headers[H.MODEL] = request.model
    if request.route_id is not None:
        headers[H.ROUTE_ID] = request.route_id
    if request.verb is Verb.PREFILL:
        headers[H.TOKEN_RANGE] = f"{request.start}-{request.start + request.n - 1}"
    else:
        headers[H.POSITION] = str(request.start)
    if request.next_hops is not None:
        headers[H.NEXT_HOPS] = ",".join(request.next_hops)
    if request.sampling:
        headers[H.SAMPLING] = request.sampling
    if request.chunks is not None and len(request.chunks) > 1:
        headers[H.CHUNKS] = format_chunks(list(request.chunks))
    if request.sample:
        headers[H.SAMPLE] = "1"
    if request.drafts:
        headers[H.DRAFT] = ",".join(map(str, request.drafts))
    if request.replay:
        headers[H.REPLAY] = str(request.replay)
    if request.rewind:
        headers[H.REWIND] = "1"
    if request.guess is not None:
        headers[H.GUESS] = str(request.guess)
    if request.ticket is not None:
        headers[H.TICKET] = request.ticket
    if request.prefix is not None:
        headers[H.PREFIX] = format_prefix(request.prefix.block, request.prefix.hashes)
    headers[H.SHAPE] = format_shape(frame.shape)
    headers[H.DTYPE] = frame.dtype
    body = frame.body
    if request.payload.token_ids is not None:
        headers[H.TOKEN_IDS] = str(len(request.payload.token_ids) // 4)
        body = request.payload.token_ids + body
    headers["Content-Type"] = OCTETS
    return request_path(request.session, request.verb), headers, body


def decode_request(
    verb: Verb, session: SessionId, headers: Mapping[str, str], body: bytes, *, max_body_bytes: int
) -> HopRequest:
    """The request a ``POST .../{verb}`` stands for; every malformed header or body is a 4xx here,
    before anything on the node changes."""
    if verb is Verb.PREFILL:
        start, stop = parse_range(headers.get(H.TOKEN_RANGE))
        n = stop - start
        drafts: tuple[int, ...] = ()
    else:
        start = _position(headers)
        drafts = _drafts(headers) if verb is Verb.VERIFY else ()
        n = 1 + len(drafts)
    token_ids = None
    if headers.get(H.TOKEN_IDS) is not None:
        ids, body = split_token_ids(body, headers[H.TOKEN_IDS], n)
        token_ids = ids.astype("<i4").tobytes()
    frame = read_frame(body, headers.get(H.SHAPE), headers.get(H.DTYPE), max_bytes=max_body_bytes)
    raw_hops = headers.get(H.NEXT_HOPS)
    return HopRequest(
        verb=verb,
        session=session,
        start=start,
        n=n,
        payload=Payload(frame, token_ids),
        model=headers.get(H.MODEL),
        route_id=headers.get(H.ROUTE_ID),
        next_hops=None if raw_hops is None else parse_hops(raw_hops),
        sampling=headers.get(H.SAMPLING) or None,
        chunks=_chunks(headers, n) if verb is Verb.PREFILL else None,
        sample=verb is Verb.PREFILL and headers.get(H.SAMPLE) == "1",
        drafts=drafts,
        replay=_replay(headers, verb),
        rewind=headers.get(H.REWIND) == "1",
        guess=_guess(headers, verb),
        ticket=headers.get(H.TICKET),
        prefix=_prefix(headers),
    )


def encode_prefix(request: PrefixRequest) -> tuple[str, dict[str, str]]:
    """``(path, headers)`` of a prefix request (it has no body)."""
    headers = {
        H.ROUTE_ID: request.route_id,
        H.PREFIX: format_prefix(request.prefix.block, request.prefix.hashes),
        H.REUSE: str(request.reuse),
        H.NEXT_HOPS: ",".join(request.next_hops),
        **_binding(request.model, request.sampling, request.ticket),
    }
    return request_path(request.session, "prefix"), headers


def decode_prefix(session: SessionId, headers: Mapping[str, str]) -> PrefixRequest:
    prefix = _prefix(headers)
    if prefix is None:
        raise InvalidRequest(f"a prefix request names the prompt's blocks in {H.PREFIX}")
    route_id = _first_route_id(headers)
    raw = headers.get(H.REUSE, "")
    if not (raw.isascii() and raw.isdigit()):
        raise InvalidRequest(
            f"header {H.REUSE} must be the most blocks to reuse (0..{len(prefix.hashes)}), got {raw!r}"
        )
    return PrefixRequest(
        session=session,
        prefix=prefix,
        reuse=int(raw),
        route_id=route_id,
        model=headers.get(H.MODEL),
        next_hops=parse_hops(headers.get(H.NEXT_HOPS, "")),
        sampling=headers.get(H.SAMPLING) or None,
        ticket=headers.get(H.TICKET),
    )


def encode_reroute(request: RerouteRequest) -> tuple[str, dict[str, str]]:
    headers = {H.NEXT_HOPS: ",".join(request.next_hops), H.REPLAY: str(request.replay)}
    if request.model is not None:
        headers[H.MODEL] = request.model
    if request.route_id is not None:
        headers[H.ROUTE_ID] = request.route_id
    if request.sampling:
        headers[H.SAMPLING] = request.sampling
    if request.step is not None:
        headers[H.POSITION] = str(request.step)
    if request.ticket is not None:
        headers[H.TICKET] = request.ticket
    if request.replay_from:
        headers[H.REPLAY_FROM] = str(request.replay_from)
    if not request.resend:
        headers[H.RESEND] = "0"
    return request_path(request.session, "reroute"), headers


def decode_reroute(session: SessionId, headers: Mapping[str, str]) -> RerouteRequest:
    hops = parse_hops(headers.get(H.NEXT_HOPS, ""))
    raw = headers.get(H.REPLAY, "0")
    if not (raw.isascii() and raw.isdigit()):
        raise InvalidRequest(f"header {H.REPLAY} must be 0..{len(hops)} (hops to rebuild), got {raw!r}")
    since = headers.get(H.REPLAY_FROM, "0")
    if not (since.isascii() and since.isdigit()):
        raise InvalidRequest(f"header {H.REPLAY_FROM} must be the positions the restored hop holds, got {since!r}")
    resend = headers.get(H.RESEND, "1")
    if resend not in ("0", "1"):
        raise InvalidRequest(f"header {H.RESEND} must be 0 (the gateway resends the step) or 1, got {resend!r}")
    return RerouteRequest(
        session=session,
        next_hops=hops,
        route_id=headers.get(H.ROUTE_ID),
        model=headers.get(H.MODEL),
        replay=int(raw),
        sampling=headers.get(H.SAMPLING) or None,
        step=_position(headers) if headers.get(H.POSITION) is not None else None,
        ticket=headers.get(H.TICKET),
        replay_from=int(since),
        resend=resend == "1",
    )


def encode_restore(request: RestoreRequest) -> tuple[str, dict[str, str]]:
    """``(path, headers)`` of a restore request (it has no body)."""
    headers = {H.ROUTE_ID: request.route_id, **_binding(request.model, request.sampling, request.ticket)}
    return request_path(request.session, "restore"), headers


def decode_restore(session: SessionId, headers: Mapping[str, str]) -> RestoreRequest:
    return RestoreRequest(session, _first_route_id(headers), model=headers.get(H.MODEL),
                          sampling=headers.get(H.SAMPLING) or None, ticket=headers.get(H.TICKET))  # fmt: skip


def answer_from_response(response: httpx.Response, sender: str) -> HopAnswer:
    """The answer of the hop at ``sender``, or the error it means (``HopFailed`` names the hop)."""
    if response.status_code >= 400:
        raise error_from_response(response, sender, sender_is_head=False)
    try:
        return answer_from_json(response.status_code, response.json())
    except ValueError as exc:
        raise HopFailed(
            f"next hop {sender} sent an answer that is not a hop answer: {exc}", failed_hop=sender
        ) from None


def error_from_response(response: httpx.Response, sender: str, *, sender_is_head: bool) -> MeshnetError:
    message = f"next hop {sender} answered {response.status_code}: {error_message(response)}"
    deeper = error_field(response, "failed_hop")
    return hop_error(
        message, status=response.status_code, failed_hop=deeper, sender=sender, sender_is_head=sender_is_head,
        code=error_field(response, "code"),
    )  # fmt: skip


def _chunks(headers: Mapping[str, str], n: int) -> tuple[int, ...] | None:
    chunks = tuple(parse_chunks(headers.get(H.CHUNKS), n))
    return chunks if len(chunks) > 1 else None


def _binding(model: str | None, sampling: str | None, ticket: str | None) -> dict[str, str]:
    """The optional headers that bind a session's first request (prefix, restore) to its route."""
    headers = {H.MODEL: model} if model is not None else {}
    if sampling:
        headers[H.SAMPLING] = sampling
    if ticket is not None:
        headers[H.TICKET] = ticket
    return headers


def _first_route_id(headers: Mapping[str, str]) -> str:
    route_id = headers.get(H.ROUTE_ID)
    if not route_id:
        raise InvalidRequest(f"header {H.ROUTE_ID} is required on a session's first request")
    return route_id


def _prefix(headers: Mapping[str, str]) -> PrefixClaim | None:
    raw = headers.get(H.PREFIX)
    if raw is None:
        return None
    try:
        block, hashes = parse_prefix(raw)
    except ValueError as exc:
        raise InvalidRequest(f"header {H.PREFIX} {exc}") from None
    return PrefixClaim(block, hashes)


def parse_hops(raw: str) -> tuple[str, ...]:
    """``X-Meshnet-Next-Hops``: comma-separated URLs, each without its trailing slash."""
    return tuple(h.strip().rstrip("/") for h in raw.split(",") if h.strip())


def _position(headers: Mapping[str, str]) -> int:
    raw = headers.get(H.POSITION)
    if raw is None or not (raw.isascii() and raw.isdigit()):
        raise SeamMismatch(f"header {H.POSITION} must be the step's absolute position, got {raw!r}")
    return int(raw)


def _drafts(headers: Mapping[str, str]) -> tuple[int, ...]:
    raw = headers.get(H.DRAFT, "")
    parts = [p.strip() for p in raw.split(",")] if raw.strip() else []
    if not parts or not all(p.isascii() and p.isdigit() for p in parts):
        raise InvalidRequest(f"header {H.DRAFT} must list the drafted token ids, comma-separated, got {raw!r}")
    return tuple(int(p) for p in parts)


def _guess(headers: Mapping[str, str], verb: Verb) -> int | None:
    raw = headers.get(H.GUESS)
    if raw is None:
        return None
    if verb is Verb.PREFILL:
        raise InvalidRequest(f"only a decode step or a verify chunk is a guess: drop {H.GUESS}")
    if not (raw.isascii() and raw.isdigit()):
        raise InvalidRequest(f"header {H.GUESS} must be the step's own token id, guessed, got {raw!r}")
    return int(raw)


def _replay(headers: Mapping[str, str], verb: Verb) -> int:
    raw = headers.get(H.REPLAY)
    if raw is None:
        return 0
    if verb is Verb.VERIFY:
        raise InvalidRequest(f"a verify chunk is never replayed: drop {H.REPLAY}")
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise InvalidRequest(f"header {H.REPLAY} must be the number of hops to rebuild (>= 1), got {raw!r}")
    return int(raw)
