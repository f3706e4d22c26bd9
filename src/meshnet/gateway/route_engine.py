"""A ``TextEngine`` that generates over a route of shard nodes instead of a local model.

The gateway keeps the tokenizer; the tracker pins a route per generation; the head node gets
token ids and every later hop gets only activations. Prefill goes chunk by chunk — a node answers
a non-final chunk as soon as it has computed it and queued the forward, so the head works on
chunk k+1 while the next hop works on chunk k — and the tail answers the last chunk and each
decode step with the sampled token. Only a one-token step crosses each seam in decode.

Threading: ``generate`` runs on a gateway worker thread; each worker thread keeps its own
kept-alive HTTP client (a per-token TCP handshake would dominate decode latency).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from collections.abc import Generator, Sequence
from typing import Any, Protocol

import httpx
import numpy as np

from meshnet.backends.base import EngineStep, ModelInfo, PrefillProgress, TokenStep
from meshnet.errors import BadGateway, EngineError, InvalidRequest, MeshnetError, Overloaded
from meshnet.httputil import error_message
from meshnet.ids import RouteId, SessionId
from meshnet.layers import LayerRange
from meshnet.protocol import headers as H
from meshnet.protocol.wire import encode_tensor, format_shape
from meshnet.routes import Hop, RoutePlan
from meshnet.sampling import Sampler

__all__ = ["RouteEngine", "Tokenizer"]


class Tokenizer(Protocol):
    info: ModelInfo

    def tokenize(self, text: str, *, add_special: bool) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def is_end_of_generation(self, token: int) -> bool: ...


class RouteEngine:
    def __init__(
        self,
        tokenizer: Tokenizer,
        tracker_url: str,
        *,
        n_ctx: int,
        max_concurrency: int = 4,
        prefill_chunk: int = 128,
        timeout_s: float = 120.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.info = tokenizer.info
        self.tracker_url = tracker_url.rstrip("/")
        self.n_ctx = n_ctx
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        self._timeout = httpx.Timeout(timeout_s, connect=5.0)
        self._local = threading.local()

    # -- tokenizer ---------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special)

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.token_bytes(token)

    def is_end_of_generation(self, token: int) -> bool:
        return self.tokenizer.is_end_of_generation(token)

    # -- routes ------------------------------------------------------------------------------
    def _client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(timeout=self._timeout, limits=httpx.Limits(keepalive_expiry=300))
            self._local.client = client
        return client

    def _tracker(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._client().request(method, f"{self.tracker_url}{path}", **kwargs)
        except httpx.HTTPError as exc:
            raise Overloaded(f"the tracker at {self.tracker_url} is unreachable: {exc}", retry_after_s=5) from None

    def plan(self) -> RoutePlan:
        body = {"model": self.info.model_id, "total_layers": self.info.n_layers}
        response = self._tracker("POST", "/v1/sessions", json=body)
        if response.status_code == 503:
            raise Overloaded(f"no route: {error_message(response)}", retry_after_s=5)
        if response.status_code >= 400:
            raise EngineError(f"the tracker refused a route: {error_message(response)}")
        data = response.json()
        total = self.info.n_layers
        hops = tuple(Hop(h["node_id"], h["url"], LayerRange.parse(h["layers"], total)) for h in data["hops"])
        return RoutePlan(SessionId(data["session_id"]), RouteId(data["route_id"]), hops)

    def release(self, plan: RoutePlan) -> None:
        with contextlib.suppress(MeshnetError):  # best effort: nothing was reserved on any node
            self._tracker("DELETE", f"/v1/sessions/{plan.session_id}")

    # -- generation --------------------------------------------------------------------------
    def generate(
        self, prompt: Sequence[int], sampler: Sampler, cancel: threading.Event, plan: RoutePlan | None = None
    ) -> Generator[EngineStep, None, None]:
        if plan is None:
            raise InvalidRequest("a route engine generates only on a planned route")
        if not prompt:
            raise InvalidRequest("the prompt is empty after tokenization")
        head = plan.hops[0].url
        base = {H.MODEL: self.info.model_id, H.ROUTE_ID: plan.route_id, "Content-Type": "application/octet-stream"}
        try:
            answer = yield from self._prefill(plan, prompt, sampler, cancel, base)
            position = len(prompt)
            while answer is not None and not cancel.is_set():
                yield TokenStep(int(answer["token"]), float(answer["logprob"]), _hop_ms(answer))
                if position + 1 > self.n_ctx:
                    return
                frame = encode_tensor(np.asarray([[answer["token"]]], dtype=np.int32), "int32")
                send = {**base, H.POSITION: str(position), H.SHAPE: format_shape(frame.shape), H.DTYPE: "int32"}
                answer = self._post(f"{head}/v1/sessions/{plan.session_id}/decode-step", frame.body, send)
                position += 1
        finally:
            self._close(plan)

    def _prefill(
        self,
        plan: RoutePlan,
        prompt: Sequence[int],
        sampler: Sampler,
        cancel: threading.Event,
        base: dict[str, str],
    ) -> Generator[EngineStep, None, dict[str, Any] | None]:
        tokens = np.asarray(prompt, dtype=np.int32)
        total = len(tokens)
        url = f"{plan.hops[0].url}/v1/sessions/{plan.session_id}/prefill"
        first = {
            H.NEXT_HOPS: ",".join(h.url for h in plan.hops[1:]),
            H.SAMPLING: json.dumps(dataclasses.asdict(sampler.params)),
        }
        for begin in range(0, total, self.prefill_chunk):
            if cancel.is_set():
                return None
            end = min(total, begin + self.prefill_chunk)
            frame = encode_tensor(tokens[begin:end].reshape(1, -1), "int32")
            send = {
                **base,
                **(first if begin == 0 else {}),
                H.TOKEN_RANGE: f"{begin}-{end - 1}",
                H.SHAPE: format_shape(frame.shape),
                H.DTYPE: "int32",
            }
            if end == total:
                send[H.SAMPLE] = "1"
            answer = self._post(url, frame.body, send)
            yield PrefillProgress(done=end, total=total)
        return answer

    def _post(self, url: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
        try:
            response = self._client().post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise BadGateway(f"head node {url} failed: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 400:
            raise BadGateway(f"route hop answered {response.status_code}: {error_message(response)}")
        return dict(response.json())

    def _close(self, plan: RoutePlan) -> None:
        """Free the session's KV on every hop (the head forwards the delete) and on the tracker."""
        with contextlib.suppress(httpx.HTTPError):  # an unreachable node frees it by its idle TTL
            self._client().delete(f"{plan.hops[0].url}/v1/sessions/{plan.session_id}")
        self.release(plan)

    def close(self) -> None:
        client = getattr(self._local, "client", None)
        if client is not None:
            client.close()


def _hop_ms(answer: dict[str, Any]) -> tuple[float, ...]:
    return tuple(float(h.get("compute_ms", 0.0)) for h in answer.get("hops", []))
