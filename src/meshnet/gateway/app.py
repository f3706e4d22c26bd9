"""The gateway's HTTP surface: OpenAI-compatible API, Generation Telemetry, metrics.

This module is a thin shell: it parses, validates, checks the context cap, opens telemetry and
formats responses. Generation itself lives in ``generation``; telemetry state in ``telemetry``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnet.backends.base import AnyEngine
from meshnet.backends.grammar import check_grammar_cost
from meshnet.errors import ContextOverflow, InvalidRequest, MeshnetError
from meshnet.gateway import dashboard, swarm_view
from meshnet.gateway.audits import MAX_RECORDS as MAX_AUDITS_LISTED
from meshnet.gateway.audits import Audits
from meshnet.gateway.auth import ApiKeyMiddleware, KeyRing, admit_generations, key_policy, key_routes
from meshnet.gateway.catalog import Learner, ModelCatalog, ServedModel
from meshnet.gateway.chat_template import ChatTemplate
from meshnet.gateway.generation import (
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    GenerationService,
    Heartbeat,
    StreamItem,
    is_async,
    plan_route,
    release_route,
)
from meshnet.gateway.logprobs import LogprobsShape
from meshnet.gateway.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from meshnet.gateway.openai_api import ChatCompletionRequest, CompletionRequest, parse_body
from meshnet.gateway.origin import HostPolicy, OriginGuard
from meshnet.gateway.prompt import chat_tokens
from meshnet.gateway.telemetry import EventType, GenerationTelemetry, TelemetryHub
from meshnet.gateway.tools import ParsedReply, ToolPlan
from meshnet.httputil import EXCEPTION_HANDLERS, error_body, error_response, read_body, tls_or_default
from meshnet.ids import GenerationId, new_generation_id, parse_generation_id
from meshnet.models.families import certification
from meshnet.protocol.headers import GENERATION_ID
from meshnet.routes import Hop, RoutePlan
from meshnet.sampling import SamplingParams
from meshnet.tracker.billing import FORMULA

__all__ = ["GatewayState", "create_app"]

PRODUCT_CONTEXT_CAP = 131072
DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # an API request body past this is a 413 (--max-body-mb)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_EVENTS_KEEPALIVE_S = 5.0
_MAX_ANNOUNCE_WAIT_S = 30.0


@dataclass
class GatewayState:
    engine: AnyEngine
    hub: TelemetryHub
    metrics: GatewayMetrics
    service: GenerationService
    template: ChatTemplate
    started: int
    # Every model served, by id (gateway.catalog); engine, service and template above are the first one's.
    catalog: ModelCatalog
    tracker: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tracker_tls: ssl.SSLContext | None = None  # a private swarm's member TLS, for the swarm view
    audits: Audits | None = None  # audit sampling (--audit-rate; gateway.audits)

    def for_model(self, model: str) -> GatewayState:
        """This state as the request's ``model`` sees it: its engine, queue and chat template
        (``UnknownModel``, a 404 ``model_not_found``, for a model not served here)."""
        entry = self.catalog.get(model)
        return dataclasses.replace(self, engine=entry.engine, service=entry.service, template=entry.template)


def create_app(
    engine: AnyEngine,
    *,
    max_queue: int = 64,
    swarm_tracker: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    chat_template: str | None = None,
    api_keys: KeyRing | None = None,
    tracker_tls: ssl.SSLContext | None = None,
    learn: Learner | None = None,
    more_engines: Sequence[AnyEngine] = (),
    allowed_hosts: HostPolicy | None = None,
    audits: Audits | None = None,
) -> Starlette:
    """Compose a gateway around one engine; the caller owns the engine's lifetime. ``chat_template``
    replaces the model's own; with ``api_keys`` the API needs a key (``gateway.auth``). With
    ``swarm_tracker`` and ``learn`` it also serves the models the tracker knows (gateway.catalog);
    ``more_engines`` are served beside the first from the start (the caller owns them too). With
    ``allowed_hosts`` a request for another ``Host`` is refused (``gateway.origin``: the CLI always
    gives one), and a browser request from another origin always is. ``audits``: the route engines'
    audit sampling, read by ``GET /v1/audits`` and ``/metrics``."""
    hub = TelemetryHub()
    metrics = GatewayMetrics()
    catalog = ModelCatalog(
        hub, metrics, max_queue=max_queue, tracker=swarm_tracker, tracker_tls=tracker_tls, learn=learn
    )
    first = catalog.add(engine, template=chat_template)
    for more in more_engines:
        catalog.add(more)
    state = GatewayState(
        engine=engine,
        hub=hub,
        metrics=metrics,
        service=first.service,
        template=first.template,
        started=int(time.time()),
        tracker=swarm_tracker.rstrip("/") if swarm_tracker else None,
        max_body_bytes=max_body_bytes,
        tracker_tls=tracker_tls,
        catalog=catalog,
        audits=audits,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        catalog.start()
        yield
        for entry in catalog.entries():  # an async engine's connections live on this loop
            if is_async(entry.engine):
                await entry.engine.aclose()
        catalog.close()

    routes = [
        Route("/v1/models", _with(state, list_models), methods=["GET"]),
        Route("/v1/chat/completions", _with(state, chat_completions), methods=["POST"]),
        Route("/v1/completions", _with(state, completions), methods=["POST"]),
        Route("/v1/generations", _with(state, list_generations), methods=["GET"]),
        Route("/v1/generations/{generation_id}", _with(state, get_generation), methods=["GET"]),
        Route("/v1/generations/{generation_id}/events", _with(state, generation_events), methods=["GET"]),
        Route("/v1/swarm", _with(state, swarm), methods=["GET"]),
        Route("/v1/audits", _with(state, list_audits), methods=["GET"]),
        Route("/v1/health", _with(state, health), methods=["GET"]),
        Route("/health", _with(state, health), methods=["GET"]),
        Route("/metrics", _with(state, prometheus), methods=["GET"]),
        *dashboard.routes(),  # the live web dashboard at / and /dashboard (docs/dashboard.md)
        *key_routes(api_keys),  # its sign-in: the server-set key cookie (gateway.auth)
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.state.gateway = state
    if api_keys is not None:
        app.add_middleware(ApiKeyMiddleware, keys=api_keys)
    app.add_middleware(OriginGuard, hosts=allowed_hosts)  # before any key is looked at
    # outermost: refused requests (401, 429) are counted too
    app.add_middleware(_CountRequests, metrics=metrics, paths=frozenset(r.path for r in routes))
    return app


Handler = Callable[[GatewayState, Request], Awaitable[Response]]


def _with(state: GatewayState, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handler(state, request)

    return endpoint


# -- errors ---------------------------------------------------------------------------------------
class _CountRequests:
    """Counts responses by endpoint and status for /metrics (ids folded out of the path)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path.startswith("/v1/generations/"):
            endpoint = "/v1/generations/{id}"
        else:  # unknown paths share one label, so scanners cannot blow up the series count
            endpoint = path if path in self.paths else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


# -- OpenAI endpoints -----------------------------------------------------------------------------
async def list_models(state: GatewayState, _: Request) -> Response:
    """Every model served here that the swarm can route end to end right now (gateway.catalog)."""
    served = await state.catalog.routable()
    return JSONResponse({"object": "list", "data": [_model_card(state, m) for m in served]})


def _model_card(state: GatewayState, served: ServedModel) -> dict[str, Any]:
    engine = served.engine
    info = engine.info
    return {
        "id": info.model_id,
        "object": "model",
        "created": state.started,
        "owned_by": "meshnet",
        "meshnet": {
            "architecture": info.architecture,
            "quantization": info.quantization,
            "layers": info.n_layers,
            "context_cap": engine.n_ctx,
            "trained_context": info.n_ctx_train,
        },
    }


async def chat_completions(state: GatewayState, request: Request) -> Response:
    body = parse_body(await read_body(request, state.max_body_bytes, "the gateway"), ChatCompletionRequest)
    state = state.for_model(body.model)  # the request's model picks the engine, and so the route
    tools = body.tool_plan(native=state.template.supports_tools)
    messages = [m.for_template() for m in body.messages]

    def render(chat: list[dict[str, Any]]) -> str:
        if tools is None:
            return state.template.render(chat)
        return state.template.render(tools.messages(chat), tools=tools.template_tools())

    def prepare() -> tuple[list[int], str, str]:
        grammar, param = body.output_grammar() if tools is None else (tools.grammar(), "tools")
        # the template's control tokens are control tokens; the messages' contents are text (gateway.prompt)
        tokens = chat_tokens(state.engine, render, messages, bos_token=state.engine.info.bos_token)
        return tokens, grammar, param

    # A long prompt takes a while to render and tokenize: off the event loop, so other streams keep flowing.
    tokens, grammar, param = await run_in_threadpool(prepare)
    gen = await _gen_request(state, body, tokens, grammar, param)
    return await _serve(state, request, body, gen, kind="chat", tools=tools)


async def completions(state: GatewayState, request: Request) -> Response:
    body = parse_body(await read_body(request, state.max_body_bytes, "the gateway"), CompletionRequest)
    state = state.for_model(body.model)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        tokens = [int(t) for t in prompt]
        bad = [t for t in tokens if not 0 <= t < state.engine.info.n_vocab]
        if bad:
            raise InvalidRequest(f"token ids out of the vocabulary [0, {state.engine.info.n_vocab}): {bad[:5]}")
    else:
        text = prompt if isinstance(prompt, str) else str(prompt[0])
        if not text:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        tokens = await run_in_threadpool(state.engine.tokenize, text, add_special=True)
    grammar, param = await run_in_threadpool(body.output_grammar)
    return await _serve(state, request, body, await _gen_request(state, body, tokens, grammar, param), kind="text")


async def _gen_request(
    state: GatewayState,
    body: ChatCompletionRequest | CompletionRequest,
    tokens: list[int],
    grammar: str = "",
    grammar_param: str = "grammar",
) -> GenerationRequest:
    """Apply the context cap before any compute: never a silent truncation; a grammar that does not
    compile against the model's vocabulary is a 400 here, before a route is planned."""
    engine = state.engine
    cap = engine.n_ctx
    why = (
        f"the context cap is {cap} tokens (the smaller of the product cap {PRODUCT_CONTEXT_CAP}, "
        f"the model's trained context {engine.info.n_ctx_train} and the server's --ctx)"
    )
    n = len(tokens)
    if n == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if n >= cap:
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise ContextOverflow(f"the prompt is {n} tokens but {why}; shorten the prompt", param=param)
    limit = body.token_limit
    if limit is not None and n + limit > cap:
        raise ContextOverflow(
            f"the prompt ({n} tokens) plus max_tokens ({limit}) is {n + limit} tokens but {why}; "
            f"lower max_tokens to at most {cap - n}",
            param="max_tokens",
        )
    sampling = body.sampling
    outside = [t for t, _ in sampling.logit_bias if t >= engine.info.n_vocab]
    if outside:
        raise InvalidRequest(
            f"logit_bias names token ids outside the vocabulary [0, {engine.info.n_vocab}): {outside[:5]}",
            param="logit_bias",
        )
    if grammar:  # compiled and timed off the event loop: a costly grammar is a 400 naming its parameter
        compile_it = functools.partial(engine.grammar, grammar, param=grammar_param)
        await run_in_threadpool(check_grammar_cost, compile_it, param=grammar_param)
    return GenerationRequest(
        prompt_tokens=tuple(tokens),
        # The gateway seeds every generation it does not get a seed for: a route's tail draws with it,
        # and the gateway re-derives each draw from the distribution the tail commits to (sampling.check_draw).
        sampling=dataclasses.replace(
            sampling,
            generated_from=n,
            grammar=grammar,
            seed=secrets.randbits(62) if sampling.seed is None else sampling.seed,
        ),
        max_tokens=limit if limit is not None else cap - n,
        stop=body.stop_sequences,
    )


def _generation_id(request: Request) -> GenerationId:
    proposed = request.headers.get(GENERATION_ID)
    try:
        return parse_generation_id(proposed) if proposed else new_generation_id()
    except ValueError as exc:
        raise InvalidRequest(f"header {GENERATION_ID}: {exc}", param=GENERATION_ID) from None


def _open_telemetry(state: GatewayState, gid: GenerationId, plan: RoutePlan, prompt_tokens: int) -> GenerationTelemetry:
    info = state.engine.info
    tel = state.hub.open(
        GenerationTelemetry(
            generation_id=gid,
            model=info.model_id,
            quantization=info.quantization,
            route=plan.hops,
            session_id=plan.session_id,
            route_id=plan.route_id,
            prompt_tokens=prompt_tokens,
        )
    )
    tel.emit(
        EventType.ROUTE_ACCEPTED,
        session_id=tel.session_id,
        route_id=tel.route_id,
        nodes=[hop.as_json() for hop in tel.route],
    )
    # A model split over several hops must be of a certified family (models.families); one node holds it whole.
    certified, why = certification(info.architecture) if len(tel.route) > 1 else (True, "")
    warning = {} if certified else {"warning": f"architecture {info.architecture!r} is not certified: {why}"}
    tel.emit(
        EventType.MODEL_SELECTED,
        model=info.model_id,
        quantization=info.quantization,
        architecture=info.architecture,
        layers=info.n_layers,
        context_cap=state.engine.n_ctx,
        certified=certified,
        # What each hop runs (one model identity per route): the tokenizer's quantization above is the gateway's.
        hops=[_runs(hop) for hop in tel.route],
        **warning,
    )
    return tel


def _runs(hop: Hop) -> dict[str, Any]:
    return {"node": hop.node, "layers": str(hop.layers), "identity": hop.identity, "quantization": hop.quantization}


async def _serve(
    state: GatewayState,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    gen: GenerationRequest,
    *,
    kind: str,
    tools: ToolPlan | None = None,
) -> Response:
    """Run the request's ``n`` choices, each a generation of its own (its own route, telemetry and
    id: the proposed or new one, then ``ID.1``, ``ID.2``...; a seeded choice ``i`` uses seed + i)."""
    gid = _generation_id(request)
    gids = [gid, *(GenerationId(f"{gid}.{i}") for i in range(1, body.n))]
    admit_generations(request.scope, body.n)  # a key's concurrency counts each choice (gateway.auth)
    policy = key_policy(request.scope)
    if policy is not None:  # its prompt's cached blocks are the key's own (protocol.prefix)
        gen = dataclasses.replace(gen, trusted_only=gen.trusted_only or policy.trusted_only,
                                  prefix_namespace=policy.prefix_namespace)  # fmt: skip
    for one in gids:
        state.hub.check_free(one)
    headers = {GENERATION_ID: str(gid)}
    shapes: list[_Shape] = []
    streams: list[AsyncIterator[StreamItem]] = []
    try:
        for index, one in enumerate(gids):
            choice = gen if index == 0 else dataclasses.replace(gen, sampling=_seeded(gen.sampling, index))
            shape, items = await _start(state, body, choice, one, kind=kind, index=index, tools=tools)
            shapes.append(shape)
            streams.append(items)
    except MeshnetError as exc:
        for shape, items in zip(shapes, streams, strict=True):
            await _abandon(state, shape, items, "another choice of the request could not start")
        if state.hub.known(gid):
            return error_response(exc, headers)
        raise
    if body.stream:
        return StreamingResponse(
            _sse_chunks(state, shapes, streams, body.include_usage),
            media_type="text/event-stream",
            headers={**headers, **_SSE_HEADERS},
        )
    return await _collect(state, shapes, streams, request, headers)


async def _start(
    state: GatewayState,
    body: ChatCompletionRequest | CompletionRequest,
    gen: GenerationRequest,
    gid: GenerationId,
    *,
    kind: str,
    index: int,
    tools: ToolPlan | None = None,
) -> tuple[_Shape, AsyncIterator[StreamItem]]:
    """Plan a route for one choice, open its telemetry and queue it."""
    # Planning may ask a tracker over the network (plan_route: a local engine's off the loop).
    # The route must hold the prompt plus the max_tokens the client asked for; without one it may stop
    # at the route's own context (finish_reason "length"), so none is asked of the route.
    size = {"prompt_tokens": len(gen.prompt_tokens), "max_tokens": body.token_limit or 0}
    plan = await plan_route(
        state.engine, **size, trusted_only=gen.trusted_only, prompt=gen.prompt_tokens, namespace=gen.prefix_namespace
    )
    try:
        tel = _open_telemetry(state, gid, plan, len(gen.prompt_tokens))
        state.service.admit(tel)
    except MeshnetError:
        await release_route(state.engine, plan)
        raise
    logprobs = LogprobsShape(kind, state.engine.token_bytes) if body.wants_logprobs else None
    shape = _Shape(kind, tel, state.engine.info.model_id, int(time.time()), logprobs, index, tools)
    return shape, state.service.stream(dataclasses.replace(gen, plan=plan), tel)


def _seeded(sampling: SamplingParams, index: int) -> SamplingParams:
    return sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + index)


async def _abandon(state: GatewayState, shape: _Shape, items: AsyncIterator[StreamItem], reason: str) -> None:
    await items.aclose()  # type: ignore[attr-defined]
    if not shape.tel.finished:
        state.service.abandon(shape.tel, reason)


# -- response shapes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Shape:
    kind: str  # "chat" | "text"
    tel: GenerationTelemetry
    model: str
    created: int
    logprobs: LogprobsShape | None = None  # when the request asked for logprobs
    index: int = 0  # the choice (n > 1); every choice's chunks carry the first choice's response id
    # tools the model may call: the reply is read whole (calls parsed out of it) before it goes out
    tools: ToolPlan | None = None

    @property
    def id(self) -> str:
        first = self.tel.generation_id.removesuffix(f".{self.index}") if self.index else self.tel.generation_id
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + first

    def usage(self) -> dict[str, Any]:
        p, c = self.tel.prompt_tokens, self.tel.completion_tokens
        details = {"cached_tokens": self.tel.cached_tokens}  # OpenAI's field: prompt tokens not recomputed
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": details}

    def _logprobs(self, deltas: Sequence[Delta]) -> dict[str, Any] | None:
        if self.logprobs is None or not deltas:
            return None
        return self.logprobs.build([(d.token, d.logprob, d.top) for d in deltas])

    def chunk(
        self, text: str | None, finish_reason: str | None, *, first: bool = False, tokens: Sequence[Delta] = ()
    ) -> dict[str, Any]:
        """A stream chunk releasing ``text``, with the logprobs of ``tokens`` (those whose text it releases)."""
        logprobs = self._logprobs(tokens)
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else {}
            if text and not first:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": self.index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion.chunk"
        else:
            choice = {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "meshnet": self.tel.snapshot(),
        }

    def _tool_reply(self, text: str, finish_reason: str) -> tuple[ParsedReply, str]:
        """A reply with tools: its content and calls; a reply that stopped on calls finishes as "tool_calls"."""
        assert self.tools is not None
        reply = self.tools.parse(text)
        return reply, ("tool_calls" if reply.calls and finish_reason == "stop" else finish_reason)

    def tool_chunks(self, text: str, finish_reason: str) -> list[dict[str, Any]]:
        """The end of a streamed reply with tools: its content, its calls, then the finish reason."""
        reply, finish_reason = self._tool_reply(text, finish_reason)
        chunks = [self.chunk(reply.content, None)] if reply.content else []
        if reply.calls:
            chunk = self.chunk(None, None)
            chunk["choices"][0]["delta"] = {"tool_calls": [c.as_json(i) for i, c in enumerate(reply.calls)]}
            chunks.append(chunk)
        return [*chunks, self.chunk(None, finish_reason)]

    def choice(self, text: str, finish_reason: str, tokens: Sequence[Delta] = ()) -> dict[str, Any]:
        """This choice in a non-streamed response."""
        logprobs = self._logprobs(tokens)
        if self.logprobs is not None and logprobs is None:
            logprobs = self.logprobs.build([])
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tools is not None:
                reply, finish_reason = self._tool_reply(text, finish_reason)
                message["content"] = reply.content
                if reply.calls:
                    message["tool_calls"] = [c.as_json() for c in reply.calls]
            return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _final(shapes: Sequence[_Shape], choices: list[dict[str, Any]]) -> dict[str, Any]:
    """A non-streamed response: every choice; usage adds the choices up (each prefilled the prompt)."""
    first = shapes[0]
    usage: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    for shape in shapes:
        for key, value in shape.usage().items():
            if key in usage:
                usage[key] += value
        cached += shape.tel.cached_tokens
    usage["prompt_tokens_details"] = {"cached_tokens": cached}
    extra = {"meshnet_choices": [s.tel.snapshot() for s in shapes]} if len(shapes) > 1 else {}
    return {
        "id": first.id,
        "object": "chat.completion" if first.kind == "chat" else "text_completion",
        "created": first.created,
        "model": first.model,
        "choices": choices,
        "usage": usage,
        "meshnet": first.tel.snapshot(),
        **extra,
    }


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def _sse_chunks(
    state: GatewayState, shapes: Sequence[_Shape], streams: Sequence[AsyncIterator[StreamItem]], include_usage: bool
) -> AsyncIterator[bytes]:
    """The choices' chunks as they come (each carries its choice's index), then usage and [DONE]."""
    # The first chunks go out at once: the client sees the routes accepted before any compute.
    for shape in shapes:
        yield _sse(shape.chunk("", None, first=True))
    held: list[list[Delta]] = [[] for _ in shapes]  # tokens whose text is not out yet: their logprobs go with it
    replies: list[list[str]] = [[] for _ in shapes]  # with tools: the reply so far, parsed when it ends
    try:
        async for index, item in _merged(streams):
            shape = shapes[index]
            if isinstance(item, Heartbeat):
                yield _sse(shape.chunk(None, None))
            elif isinstance(item, Delta) and shape.tools is not None:
                replies[index].append(item.text)  # progress still goes out: telemetry and logprobs, no text
                yield _sse(shape.chunk(None, None, tokens=[item]))
            elif isinstance(item, Delta):
                held[index].append(item)
                if item.text:
                    yield _sse(shape.chunk(item.text, None, tokens=held[index]))
                    held[index] = []
            elif isinstance(item, Finished) and shape.tools is not None:
                reply = "".join([*replies[index], item.text])
                for chunk in shape.tool_chunks(reply, _client_reason(item.finish_reason)):
                    yield _sse(chunk)
            elif isinstance(item, Finished):
                if item.text or held[index]:
                    yield _sse(shape.chunk(item.text, None, tokens=held[index]))
                yield _sse(shape.chunk(None, _client_reason(item.finish_reason)))
            elif isinstance(item, Failed):
                yield _sse(error_body(item.error))
                return
        if include_usage:
            yield _sse({**shapes[0].chunk(None, None), "choices": [], "usage": _final(shapes, [])["usage"]})
        yield _sse("[DONE]")
    finally:
        for shape, items in zip(shapes, streams, strict=True):
            await _abandon(state, shape, items, "the client disconnected")


async def _merged(streams: Sequence[AsyncIterator[StreamItem]]) -> AsyncIterator[tuple[int, StreamItem]]:
    """``(choice index, item)`` from every stream as they come; ends when every stream ended."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, StreamItem | None]] = asyncio.Queue()

    async def pump(index: int, items: AsyncIterator[StreamItem]) -> None:
        try:
            async for item in items:
                await queue.put((index, item))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, items)) for i, items in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, got = await queue.get()
            if got is None:
                running -= 1
            else:
                yield index, got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _client_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


async def _collect(
    state: GatewayState,
    shapes: Sequence[_Shape],
    streams: Sequence[AsyncIterator[StreamItem]],
    request: Request,
    headers: dict[str, str],
) -> Response:
    """Non-streaming: gather every choice's text; stop early if the client hangs up."""
    parts: list[list[str]] = [[] for _ in shapes]
    deltas: list[list[Delta]] = [[] for _ in shapes]
    choices: dict[int, dict[str, Any]] = {}
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        async for index, item in _merged(streams):
            if watcher.done():
                break  # leaving the loop closes the streams, which cancels the workers
            if isinstance(item, Delta):
                parts[index].append(item.text)
                deltas[index].append(item)
            elif isinstance(item, Finished):
                parts[index].append(item.text)
                reason = _client_reason(item.finish_reason)
                choices[index] = shapes[index].choice("".join(parts[index]), reason, deltas[index])
                if len(choices) == len(shapes):
                    return JSONResponse(_final(shapes, [choices[i] for i in range(len(shapes))]), headers=headers)
            elif isinstance(item, Failed):
                return error_response(item.error, headers)
    finally:
        watcher.cancel()
        for shape, items in zip(shapes, streams, strict=True):
            await _abandon(state, shape, items, "the client disconnected")
    return error_response(InvalidRequest("the client disconnected"), headers)


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)


# -- telemetry endpoints --------------------------------------------------------------------------
async def list_generations(state: GatewayState, _: Request) -> Response:
    return JSONResponse({"object": "list", "data": [g.snapshot() for g in state.hub.active()]})


async def get_generation(state: GatewayState, request: Request) -> Response:
    tel = state.hub.get(GenerationId(request.path_params["generation_id"]))
    return JSONResponse(tel.snapshot())


async def generation_events(state: GatewayState, request: Request) -> Response:
    gid = GenerationId(request.path_params["generation_id"])
    try:
        wait_s = float(request.query_params.get("wait", "0"))
    except ValueError:
        raise InvalidRequest("query parameter 'wait' must be a number of seconds", param="wait") from None
    if not 0 <= wait_s <= _MAX_ANNOUNCE_WAIT_S:
        raise InvalidRequest(f"'wait' must be within [0, {_MAX_ANNOUNCE_WAIT_S:g}] seconds", param="wait")
    tel = await state.hub.wait_for(gid, wait_s)
    skip = _last_event_id(request)

    async def events() -> AsyncIterator[bytes]:
        seq = 0
        async for event in tel.follow(keepalive_s=_EVENTS_KEEPALIVE_S):
            if event is None:
                yield b": keepalive\n\n"
                continue
            seq += 1
            if seq > skip:
                yield f"id: {seq}\ndata: {event.encode()}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream", headers=_SSE_HEADERS)


def _last_event_id(request: Request) -> int:
    raw = request.headers.get("last-event-id", "0")
    try:
        return max(0, int(raw))
    except ValueError:
        raise InvalidRequest("Last-Event-ID must be the integer id of an event") from None


async def health(state: GatewayState, _: Request) -> Response:
    info = state.engine.info
    return JSONResponse(
        {
            "status": "ok",
            "model": info.model_id,
            "layers": str(info.layers),
            "active_generations": len(state.hub.active()),
            "queue_depth": state.service.waiting,
            "billing_formula": FORMULA,
        }
    )


async def swarm(state: GatewayState, _: Request) -> Response:
    """The tracker, its nodes with their live health, and this gateway's active sessions."""
    sessions = [
        {"generation_id": g.generation_id, "session_id": g.session_id, "route_id": g.route_id,
         "phase": str(g.phase), "route": [h.as_json() for h in g.route]}
        for g in state.hub.active()
    ]  # fmt: skip
    if state.tracker is None:
        info = state.engine.info
        local = {"node": "local", "layers": str(info.layers), "health": {"status": "ok"}}
        return JSONResponse({"tracker": None, "nodes": [local], "sessions": sessions})
    # Members' answers are read bounded, typed and without their errors' text (gateway.swarm_view).
    async with httpx.AsyncClient(timeout=swarm_view.PROBE_S, verify=tls_or_default(state.tracker_tls)) as client:
        listed = await swarm_view.fetch_json(client, f"{state.tracker}/v1/nodes", swarm_view.MAX_NODES_BYTES)
        nodes = listed.get("nodes") if isinstance(listed, dict) else None
        if not isinstance(nodes, list):
            return JSONResponse({"tracker": state.tracker, "error": "tracker unreachable", "sessions": sessions})

        async def probe(node: dict[str, Any]) -> dict[str, Any]:
            url = node.get("url")
            answer = await swarm_view.fetch_json(client, f"{url}/v1/health", swarm_view.MAX_HEALTH_BYTES)
            return {**node, "health": swarm_view.node_health(answer)}

        probed = await asyncio.gather(
            *(probe(n) for n in nodes if isinstance(n, dict) and isinstance(n.get("url"), str))
        )
    return JSONResponse({"tracker": state.tracker, "nodes": list(probed), "sessions": sessions})


async def prometheus(state: GatewayState, _: Request) -> Response:
    if state.audits is not None:
        for verdict in ("pass", "fail", "skipped"):
            state.metrics.audits.labels(verdict=verdict).set(state.audits.counts[verdict])
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def list_audits(state: GatewayState, request: Request) -> Response:
    """``GET /v1/audits``: this gateway's audit verdicts, newest first (gateway.audits); filters
    ``node_id``, ``session_id``, ``verdict`` (pass | fail), ``limit`` (1..1000, default 100)."""
    query = request.query_params
    verdict = query.get("verdict")
    if verdict not in (None, "pass", "fail"):
        raise InvalidRequest(f"verdict is pass or fail, got {verdict!r}", param="verdict")
    try:
        limit = int(query.get("limit", "100"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_AUDITS_LISTED:
        raise InvalidRequest(f"limit is a whole number in 1..{MAX_AUDITS_LISTED}", param="limit")
    audits = state.audits
    if audits is None:
        return JSONResponse({"audit_rate": 0.0, "counts": {}, "audits": []})
    found = audits.records(node=query.get("node_id"), session=query.get("session_id"), verdict=verdict, limit=limit)
    return JSONResponse({"audit_rate": audits.rate, "counts": dict(audits.counts), "audits": found})
