"""API keys for the gateway's public API: who may call it, and how much.

``--api-keys FILE`` holds the keys, either one per line (``#`` starts a comment; every key gets the
default limits) or JSON with a policy per key::

    {"keys": [{"key": "sk-alice-...", "name": "alice", "max_concurrency": 2, "requests_per_minute": 30}]}

A request names its key as OpenAI's clients do, ``Authorization: Bearer KEY`` — or, for the web
dashboard's page (an ``EventSource`` cannot set headers), the ``meshnet_api_key`` cookie. Every
``/v1/...`` endpoint and ``/metrics`` need a key; ``/health``, ``/v1/health`` and the dashboard's
static files do not. A missing or unknown key is a 401 (``invalid_api_key``); a key past its
concurrent generations or its requests per minute is a 429 (``rate_limit_exceeded``, with
``Retry-After``), both in OpenAI's error shape. Keys are held as SHA-256 digests only.

Concurrency counts generations, not requests: a request with ``n: 8`` holds 8 of its key's slots
(``KeyLease``: the middleware opens one per request, the endpoint takes the request's ``n`` from it
once the body is read, and the middleware gives them back when the response, a stream included,
has ended). Requests per minute count requests.

The cookie (issue 28) is the server's, never the page's script's: ``POST /dashboard/key`` checks a
key and sets it ``HttpOnly; SameSite=Strict; Path=/v1/`` (no script on the page, nor on any other
port of the host, can read it), ``DELETE /dashboard/key`` clears it. It is honoured only on the
endpoints the dashboard reads (``COOKIE_PATHS``) and only on a request the browser marks as
same-origin or does not mark at all (``Sec-Fetch-Site``): cookies are shared by every port of a
host, so a page on another port is "same-site" and its requests would carry it.
``gateway.origin`` refuses any request whose ``Origin`` is not the gateway's own.

Like llama-server, a gateway bound to loopback serves without keys unless ``--api-keys`` is given;
the CLI refuses to bind any other address without keys unless ``--no-auth`` says so.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import math
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.cookies import SimpleCookie
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from meshnet.errors import InvalidRequest, MeshnetError, NotFound, RateLimited, Unauthorized
from meshnet.httputil import error_response, read_body

__all__ = [
    "COOKIE",
    "COOKIE_PATHS",
    "KEY_PATH",
    "ApiKeyMiddleware",
    "KeyLease",
    "KeyPolicy",
    "KeyRing",
    "admit_generations",
    "key_routes",
    "load_keys",
]

COOKIE = "meshnet_api_key"
KEY_PATH = "/dashboard/key"  # where the page signs in (POST), out (DELETE) and asks (GET)
# The endpoints the dashboard calls: the only ones the cookie opens (prefixes).
COOKIE_PATHS = ("/v1/models", "/v1/swarm", "/v1/health", "/v1/generations", "/v1/chat/completions", "/v1/audits")
_CROSS = frozenset({"cross-site", "same-site"})  # Sec-Fetch-Site values of a request from another origin
DEFAULT_MAX_CONCURRENCY = 4
MIN_KEY_CHARS = 16  # a guessable key is no key
_OPEN_PATHS = frozenset({"/health", "/v1/health"})
_GENERATING = frozenset({"/v1/chat/completions", "/v1/completions"})
_WINDOW_S = 60.0


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyPolicy:
    name: str
    key_digest: str
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY  # generations in flight at once
    requests_per_minute: int = 0  # generation requests per sliding minute; 0: no limit
    trusted_only: bool = False  # every route of this key's generations over trusted nodes only

    @property
    def prefix_namespace(self) -> bytes:
        """The namespace this key's prompt blocks are hashed in (protocol.prefix): its own, so no other
        key reuses, or learns of, its cached prompts. The key's digest: what only its holder can name."""
        return bytes.fromhex(self.key_digest)

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"key {self.name!r}: max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.requests_per_minute < 0:
            raise ValueError(f"key {self.name!r}: requests_per_minute must be >= 0, got {self.requests_per_minute}")


def load_keys(path: Path) -> KeyRing:
    """Read ``--api-keys``; a file that is missing, empty or malformed raises ``ValueError`` saying what to fix."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    policies = _json_policies(text, path) if text.lstrip().startswith("{") else _line_policies(text, path)
    if not policies:
        raise ValueError(f'{path} holds no API keys (one per line, or JSON {{"keys": [...]}})')
    return KeyRing(policies)


def _check_key(key: object, where: str) -> str:
    if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise ValueError(f"{where}: a key is at least {MIN_KEY_CHARS} characters without spaces")
    return key


def _line_policies(text: str, path: Path) -> list[KeyPolicy]:
    policies: list[KeyPolicy] = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.split("#", 1)[0].strip()
        if key:
            policies.append(KeyPolicy(f"key-{len(policies) + 1}", digest(_check_key(key, f"{path}:{number}"))))
    return policies


def _json_policies(text: str, path: Path) -> list[KeyPolicy]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f'{path}: expected {{"keys": [{{"key": ..., "name": ...}}, ...]}}')
    policies = []
    for i, entry in enumerate(entries):
        where = f"{path}: keys[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object")
        unknown = set(entry) - {"key", "name", "max_concurrency", "requests_per_minute", "trusted_only"}
        if unknown:
            raise ValueError(f"{where} has unknown fields {sorted(unknown)}")
        name, concurrency, rpm = (
            entry.get("name", f"key-{i + 1}"),
            entry.get("max_concurrency"),
            entry.get("requests_per_minute"),
        )
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: name must be a non-empty string")
        for field, value in (("max_concurrency", concurrency), ("requests_per_minute", rpm)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{where}: {field} must be an integer")
        trusted = entry.get("trusted_only", False)
        if not isinstance(trusted, bool):
            raise ValueError(f"{where}: trusted_only must be true or false")
        policies.append(
            KeyPolicy(
                name,
                digest(_check_key(entry.get("key"), where)),
                max_concurrency=DEFAULT_MAX_CONCURRENCY if concurrency is None else concurrency,
                requests_per_minute=rpm or 0,
                trusted_only=trusted,
            )
        )
    names = [p.name for p in policies]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: key names must be unique")
    if len({p.key_digest for p in policies}) != len(policies):
        raise ValueError(f"{path}: a key is listed twice")
    return policies


class KeyRing:
    """The known keys and each key's live use (generations in flight, recent requests). Thread-safe."""

    def __init__(self, policies: Iterable[KeyPolicy], *, clock: Callable[[], float] = time.monotonic) -> None:
        self._by_digest = {p.key_digest: p for p in policies}
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._recent: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def policies(self) -> tuple[KeyPolicy, ...]:
        return tuple(self._by_digest.values())

    def authenticate(self, key: str | None) -> KeyPolicy:
        if not key:
            raise Unauthorized(
                "this gateway needs an API key: send it as 'Authorization: Bearer KEY' (OpenAI clients: api_key=KEY)"
            )
        wanted = digest(key)
        for known, policy in self._by_digest.items():  # constant-time comparison of digests
            if hmac.compare_digest(known, wanted):
                return policy
        raise Unauthorized("the API key is not valid for this gateway")

    def admit(self, policy: KeyPolicy, generations: int = 1) -> None:
        """Count one request of ``generations`` generations of ``policy``'s key in, or raise
        ``RateLimited`` (nothing counted); more generations than the key may ever run at once is a 400."""
        if generations > policy.max_concurrency:
            raise InvalidRequest(
                f"key {policy.name!r} runs at most {policy.max_concurrency} generations at once; n={generations} asks "
                f"for {generations} (send fewer choices, or several requests)",
                param="n",
            )
        with self._lock:
            now = self._clock()
            recent = self._recent[policy.name]
            while recent and recent[0] <= now - _WINDOW_S:
                recent.popleft()
            if policy.requests_per_minute and len(recent) >= policy.requests_per_minute:
                wait = math.ceil(recent[0] + _WINDOW_S - now)
                raise RateLimited(
                    f"key {policy.name!r} sent {len(recent)} requests in the last minute, its limit; retry in {wait} s",
                    retry_after_s=max(1, wait),
                )
            if self._in_flight[policy.name] + generations > policy.max_concurrency:
                raise RateLimited(
                    f"key {policy.name!r} has {self._in_flight[policy.name]} generations in flight and its limit is "
                    f"{policy.max_concurrency}; retry when one ends",
                    retry_after_s=1,
                )
            self._in_flight[policy.name] += generations
            recent.append(now)

    def release(self, policy: KeyPolicy, generations: int = 1) -> None:
        with self._lock:
            self._in_flight[policy.name] -= generations

    def in_flight(self, name: str) -> int:
        with self._lock:
            return self._in_flight[name]


class KeyLease:
    """The generations one request of a key holds: taken by the endpoint once it knows ``n``
    (``admit_generations``), given back by the middleware when the response has ended."""

    def __init__(self, keys: KeyRing, policy: KeyPolicy) -> None:
        self.keys = keys
        self.policy = policy
        self.held = 0

    def admit(self, generations: int) -> None:
        if self.held:
            raise RuntimeError("a request admits its generations once")
        self.keys.admit(self.policy, generations)
        self.held = generations

    def release(self) -> None:
        if self.held:
            self.keys.release(self.policy, self.held)
            self.held = 0


class ApiKeyMiddleware:
    """Checks the key of every API request and holds its generations' concurrency slots (taken by
    the endpoint, ``admit_generations``) until its response (a stream included) has ended."""

    def __init__(self, app: ASGIApp, keys: KeyRing) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not _needs_key(path):
            await self.app(scope, receive, send)
            return
        try:
            policy = self.keys.authenticate(_presented_key(scope))
        except MeshnetError as exc:
            await error_response(exc, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        lease = KeyLease(self.keys, policy)
        state = scope.setdefault("state", {})
        state[_POLICY], state[_LEASE] = policy, lease  # what the key may ask for (key_policy), its slots
        try:
            await self.app(scope, receive, send)
        finally:
            lease.release()


def key_policy(scope: Scope) -> KeyPolicy | None:
    """The policy of the API key a request came with (None: this gateway takes no keys)."""
    policy = (scope.get("state") or {}).get(_POLICY)
    return policy if isinstance(policy, KeyPolicy) else None


def admit_generations(scope: Scope, generations: int) -> None:
    """Hold ``generations`` of the request's key's concurrent generations (and count the request
    against its requests per minute), or raise ``RateLimited``; nothing on a gateway without keys."""
    lease = (scope.get("state") or {}).get(_LEASE)
    if isinstance(lease, KeyLease):
        lease.admit(generations)


_POLICY = "meshnet_key_policy"
_LEASE = "meshnet_key_lease"


def _needs_key(path: str) -> bool:
    return (path.startswith("/v1/") or path == "/metrics") and path not in _OPEN_PATHS


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _presented_key(scope: Scope) -> str | None:
    headers = _headers(scope)
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    path: str = scope.get("path", "")
    if not path.startswith(COOKIE_PATHS) or headers.get("sec-fetch-site", "").lower() in _CROSS:
        return None  # the cookie opens the dashboard's endpoints only, and only to the gateway's own page
    return _cookie_key(headers)


def _cookie_key(headers: dict[str, str]) -> str | None:
    if "cookie" not in headers:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(headers["cookie"])
    except Exception:  # a malformed cookie header is no key
        return None
    if COOKIE in jar:  # URI-encoded: a key may hold characters a cookie value cannot
        return urllib.parse.unquote(str(jar[COOKIE].value))
    return None


# -- the dashboard's sign-in ------------------------------------------------------------------------
_MAX_SIGN_IN_BYTES = 4096


def cookie_header(key: str | None) -> str:
    """The ``Set-Cookie`` value that keeps ``key`` for the dashboard (``None``: deletes it). No
    ``Secure``: the gateway itself speaks plain http (a TLS proxy in front of it may add it)."""
    value = urllib.parse.quote(key, safe="") if key else ""
    expiry = "" if key else "; Max-Age=0"
    return f"{COOKIE}={value}; Path=/v1/; HttpOnly; SameSite=Strict{expiry}"


def key_routes(keys: KeyRing | None) -> list[Route]:
    """``/dashboard/key``: the page signs in with a key (POST ``{"key": ...}``: 204 and the cookie,
    or the 401 the API would answer), signs out (DELETE) and asks whether it needs to (GET)."""

    async def sign_in(request: Request) -> Response:
        if keys is None:
            raise NotFound("this gateway takes no API keys: nothing to sign in to")
        if request.headers.get("sec-fetch-site", "").lower() in _CROSS:
            raise Unauthorized("a key is signed in from the gateway's own page only")
        raw = await read_body(request, _MAX_SIGN_IN_BYTES, "the sign-in")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            data = None
        key = data.get("key") if isinstance(data, dict) else None
        if not isinstance(key, str):
            raise InvalidRequest('send {"key": "YOUR-API-KEY"}', param="key")
        keys.authenticate(key.strip())
        headers = {"Set-Cookie": cookie_header(key.strip()), "Cache-Control": "no-store"}
        return Response(status_code=204, headers=headers)

    async def sign_out(_: Request) -> Response:
        return Response(status_code=204, headers={"Set-Cookie": cookie_header(None)})

    async def signed_in(_: Request) -> Response:
        # The cookie's Path is /v1/: this path never gets it, so say only whether keys are needed.
        return JSONResponse({"keys": keys is not None}, headers={"Cache-Control": "no-store"})

    return [
        Route(KEY_PATH, sign_in, methods=["POST"]),
        Route(KEY_PATH, sign_out, methods=["DELETE"]),
        Route(KEY_PATH, signed_in, methods=["GET"]),
    ]
