"""The one exception tree of Meshnet, and its HTTP mapping.

    MeshnetError                      500  server_error
    ├── InvalidRequest                400  invalid_request_error
    │   ├── ContextOverflow           400  context_length_exceeded
    │   └── SeamMismatch              400  seam_mismatch      (hidden width, dtype, shape at a seam)
    ├── Unauthorized                  401  invalid_api_key    (no API key, or not one of this gateway's)
    ├── Forbidden                     403  permission_error   (a swarm member acting outside its role or id)
    ├── NotFound                      404  not_found_error
    │   ├── UnknownModel              404  model_not_found    (type invalid_request_error, as OpenAI's)
    │   └── SessionNotFound           404  session_not_found
    ├── SessionGone                   410  session_gone       (expired, closed, or the node restarted)
    ├── Conflict                      409  conflict_error
    │   ├── PositionMismatch          409  position_mismatch  (not the session's next position)
    │   ├── SessionBusy               409  session_busy       (a second concurrent call on a session)
    │   └── SessionBroken             409  session_broken     (a forward failed; names the failed hop)
    ├── PayloadTooLarge               413  payload_too_large
    ├── BadGateway                    502  bad_gateway        (the next hop failed or broke the session)
    │   ├── HopFailed                 502  hop_failed         (names the hop that failed: route repair)
    │   │   └── HopFull               502  hop_full           (a hop had no room for the session: wait)
    │   └── RouteInconsistent         502  route_inconsistent (hops disagree on what they computed)
    ├── Overloaded                    503  overloaded_error   (carries Retry-After)
    │   ├── StoreFull                 503  kv_store_full
    │   └── RateLimited               429  rate_limit_exceeded (an API key past its limits)
    └── EngineError                   500  engine_error       (a backend failed mid-generation)

Foreign errors (pydantic, llama.cpp, JSON) are mapped into this tree at the boundary that
meets them, never further in. The HTTP layers translate with :func:`http_status` only.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = [
    "REQUEST_CODES",
    "BadGateway",
    "Conflict",
    "ContextOverflow",
    "EngineError",
    "Forbidden",
    "HopFailed",
    "HopFull",
    "InvalidRequest",
    "MeshnetError",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "PositionMismatch",
    "RateLimited",
    "RouteInconsistent",
    "SeamMismatch",
    "SessionBroken",
    "SessionBusy",
    "SessionGone",
    "SessionNotFound",
    "StoreFull",
    "Unauthorized",
    "UnknownModel",
    "hop_error",
    "http_status",
]


class MeshnetError(Exception):
    """Base of every error Meshnet raises on purpose.

    ``param`` names the request field at fault (OpenAI's error shape carries it);
    ``code`` is a stable machine-readable string; ``failed_hop`` (``HopFailed``, ``SessionBroken``)
    is the base URL of the route hop whose failure caused this one: what route repair replaces.
    """

    status = 500
    error_type = "server_error"
    code: str | None = None
    failed_hop: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(MeshnetError):
    status = 400
    error_type = "invalid_request_error"


class ContextOverflow(InvalidRequest):
    code = "context_length_exceeded"


class SeamMismatch(InvalidRequest):
    code = "seam_mismatch"


class Unauthorized(MeshnetError):
    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(MeshnetError):
    """Who the caller is is known (its swarm certificate), and this is not its to do."""

    status = 403
    error_type = "permission_error"
    code = "forbidden"


class NotFound(MeshnetError):
    status = 404
    error_type = "not_found_error"


class UnknownModel(NotFound):
    error_type = "invalid_request_error"  # OpenAI's shape for an unknown model: a 404 of this type
    code = "model_not_found"


class SessionNotFound(NotFound):
    code = "session_not_found"


class SessionGone(MeshnetError):
    status = 410
    error_type = "gone_error"
    code = "session_gone"


class Conflict(MeshnetError):
    status = 409
    error_type = "conflict_error"


class PositionMismatch(Conflict):
    code = "position_mismatch"


class SessionBusy(Conflict):
    code = "session_busy"


class ModelMismatch(Conflict):
    """A node registers a model id that the swarm's other nodes serve as another model."""

    code = "model_mismatch"


class SessionBroken(Conflict):
    """An earlier forward of this session failed here; ``failed_hop`` is the hop that did."""

    code = "session_broken"

    def __init__(self, message: str, *, failed_hop: str | None, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.failed_hop = failed_hop


class PayloadTooLarge(MeshnetError):
    status = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class BadGateway(MeshnetError):
    status = 502
    error_type = "upstream_error"
    code = "bad_gateway"


class HopFailed(BadGateway):
    """A hop of the route did not answer (or lost the session); ``failed_hop`` is its URL.

    Nodes pass the innermost failure up the chain unchanged, so whoever repairs the route learns
    which hop to replace, not just that something downstream broke.
    """

    code = "hop_failed"

    def __init__(self, message: str, *, failed_hop: str) -> None:
        super().__init__(message)
        self.failed_hop = failed_hop


class HopFull(HopFailed):
    """A hop had no room to open the session (its sessions or KV taken, or the caller's quota there
    spent: a 503 ``kv_store_full`` or a 429); ``failed_hop`` names it. Nothing failed: before the
    first token the gateway waits for room or goes elsewhere, and reports no failure."""

    code = "hop_full"


# The error codes of a hop that had no room for a session (HopFull).
FULL_CODES = frozenset({"kv_store_full", "rate_limit_exceeded", "hop_full"})
# The error codes of a hop's 400 about the request itself, not about the hop, with the request field
# at fault: any hop would answer the same (a grammar too costly to sample under the tail's per-token
# deadline), so it is the client's error, and no hop is reported or replaced for it.
REQUEST_CODES: dict[str, str] = {"grammar_too_costly": "grammar"}


def hop_error(
    message: str,
    *,
    status: object,
    failed_hop: object,
    sender: str,
    sender_is_head: bool,
    code: object = None,
    may_name: Collection[str] | None = None,
) -> MeshnetError:
    """What an error answer from the hop at ``sender`` means to the gateway: a failure naming the hop
    it names (``failed_hop``), or the sender itself when it is past the head or lost the session
    (410: it restarted; replace, rebuild it); anything else of the head's own is a plain 502. An
    answer with a ``code`` of ``FULL_CODES`` is a hop without room (``HopFull``), not a failure; a 400
    with a code of ``REQUEST_CODES`` is the request's own error (``InvalidRequest`` naming its field).

    ``may_name``: the hops the sender can know failed (itself and the hops after it on the route).
    An answer naming any other is the sender's own failure: a hop cannot get one before it, or a
    node off the route, suspended by blaming it."""
    if failed_hop and may_name is not None and str(failed_hop) not in may_name:
        return HopFailed(f"{message} (it blamed {failed_hop}, which is not a hop at or after it on the route)",
                         failed_hop=sender)  # fmt: skip
    if status == 400 and isinstance(code, str) and code in REQUEST_CODES:
        return InvalidRequest(message, param=REQUEST_CODES[code], code=code)
    if code in FULL_CODES:
        return HopFull(message, failed_hop=str(failed_hop or sender))
    if failed_hop:
        return HopFailed(message, failed_hop=str(failed_hop))
    if not sender_is_head or status == 410:
        return HopFailed(message, failed_hop=sender)
    return BadGateway(message)


class RouteInconsistent(BadGateway):
    """The hops of a route disagree on the positions they hold or on what they computed them from
    (protocol.ledger): text from it could be wrong without any other error, so the generation stops."""

    code = "route_inconsistent"


class Overloaded(MeshnetError):
    status = 503
    error_type = "overloaded_error"

    def __init__(self, message: str, *, retry_after_s: int = 1, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class StoreFull(Overloaded):
    code = "kv_store_full"


class RateLimited(Overloaded):
    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


class EngineError(MeshnetError):
    error_type = "engine_error"


def http_status(error: MeshnetError) -> int:
    """The HTTP status of an error: the single place the mapping lives."""
    return error.status
