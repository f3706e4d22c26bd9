"""The text-engine interface the gateway drives, and the records it yields.

An engine owns model weights and KV. ``generate`` is a *blocking* generator meant to run in a
worker thread; it yields prefill progress, then one ``TokenStep`` per decoded token. The caller
decides when to stop (end-of-generation token, stop string, max tokens) simply by not asking for
the next step and closing the generator. ``max_concurrency`` tells the caller how many
``generate`` calls may be in flight at once; an engine raises ``Conflict`` beyond it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from meshnet.ids import new_route_id, new_session_id
from meshnet.layers import LayerRange
from meshnet.routes import Hop, RoutePlan
from meshnet.sampling import Alternatives, Sampler

if TYPE_CHECKING:
    from meshnet.backends.grammar import TokenGrammar

__all__ = [
    "AnyEngine",
    "AsyncTextEngine",
    "Emit",
    "EngineStep",
    "ModelInfo",
    "PrefillProgress",
    "RouteChange",
    "Stop",
    "TextEngine",
    "TokenStep",
    "local_plan",
]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a client and the tracker may know about a loaded model."""

    model_id: str
    architecture: str
    quantization: str
    n_layers: int
    n_ctx_train: int
    n_vocab: int
    hidden_size: int
    chat_template: str | None
    bos_token: str
    eos_token: str
    source: str

    @property
    def layers(self) -> LayerRange:
        return LayerRange.full(self.n_layers)


def local_plan(info: ModelInfo, url: str = "local") -> RoutePlan:
    """The one-hop route of an engine that holds every layer itself."""
    return RoutePlan(new_session_id(), new_route_id(), (Hop("local", url, info.layers),))


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """``done`` of ``total`` prompt tokens are in the KV cache; ``cached`` of them came from prefix
    caches instead of being computed for this generation."""

    done: int
    total: int
    cached: int = 0


@dataclass(frozen=True, slots=True)
class TokenStep:
    """One decoded token; ``hop_ms`` is each hop's compute time for it (routes only). The first token
    of a speculative verify chunk's answer says how many tokens were ``drafted`` and ``accepted``."""

    token: int
    logprob: float
    hop_ms: tuple[float, ...] = ()
    drafted: int = 0
    accepted: int = 0
    top: Alternatives = ()  # the most likely tokens at this position, when the request asked (top_logprobs)


@dataclass(frozen=True, slots=True)
class RouteChange:
    """The route changed mid-generation because a hop failed (routes only).

    ``kind`` is ``"repair"`` (the failed hop was replaced and rebuilt; generation goes on where it
    was), ``"reroute"`` (a fresh route, prefilled from scratch) or ``"wait"`` (a hop had no room for
    the session before its first token: first on the old ``plan``, the wait begins; then on the
    fresh one planned after it, which the generation goes on with; nothing failed). ``replayed`` positions were
    recomputed on the new hops; ``seconds`` is from the failure to the route serving again.
    """

    kind: str
    reason: str
    failed_node: str
    plan: RoutePlan
    attempt: int
    replayed: int = 0
    seconds: float = 0.0


EngineStep = PrefillProgress | TokenStep | RouteChange
Emit = Callable[[EngineStep], Awaitable[None]]  # an async engine hands each step to its consumer so


class Stop(Exception):
    """Raised by an ``Emit``: the consumer wants no more steps (a stop sequence, ``max_tokens``, a
    client gone). The engine ends the generation as completed, as a sync engine does when its
    generator is closed."""


class TextEngine(Protocol):
    info: ModelInfo
    n_ctx: int
    max_concurrency: int

    def plan(
        self, *, prompt_tokens: int = 0, max_tokens: int = 0, trusted_only: bool = False, prompt: Sequence[int] = (),
        namespace: bytes = b"",
    ) -> RoutePlan:  # fmt: skip
        """Pick (and pin) the route a generation of this size will use (``trusted_only``: over nodes
        of the trusted tier only; ``prompt``: its token ids, so a route whose prefix caches hold its
        start may win; ``namespace``: the prefix-cache namespace its blocks are hashed in, one per API
        key, so no key finds another's prompts cached). May block: call it off the event loop."""
        ...

    def release(self, plan: RoutePlan) -> None:
        """Give back a planned route that will never run (the request was refused after planning)."""
        ...

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special``: with the model's BOS); ``parse_special``: the text of a
        control token (``<|im_end|>``) becomes that token, else it is tokenized as plain text."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token contributes to the output text (empty for control tokens)."""
        ...

    def is_end_of_generation(self, token: int) -> bool: ...

    def grammar(self, text: str, *, param: str = "grammar") -> TokenGrammar:
        """A GBNF grammar compiled against the model's vocabulary: a 400 naming ``param`` when it does not parse."""
        ...

    def generate(
        self, prompt: Sequence[int], sampler: Sampler, cancel: threading.Event, plan: RoutePlan | None = None
    ) -> Generator[EngineStep, None, None]: ...

    def close(self) -> None: ...


class AsyncTextEngine(Protocol):
    """A ``TextEngine`` whose calls that wait on the network are coroutines on the caller's event
    loop (the gateway's route engine): ``plan``, ``release``, ``generate`` and ``aclose``."""

    info: ModelInfo
    n_ctx: int
    max_concurrency: int

    async def plan(
        self, *, prompt_tokens: int = 0, max_tokens: int = 0, trusted_only: bool = False, prompt: Sequence[int] = (),
        namespace: bytes = b"",
    ) -> RoutePlan: ...  # fmt: skip

    async def release(self, plan: RoutePlan) -> None: ...

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def is_end_of_generation(self, token: int) -> bool: ...

    def grammar(self, text: str, *, param: str = "grammar") -> TokenGrammar: ...

    async def generate(
        self, prompt: Sequence[int], sampler: Sampler, cancel: asyncio.Event, plan: RoutePlan | None, emit: Emit
    ) -> None:
        """Generate on ``plan``'s route, handing every step to ``emit`` until the text ends, the
        context is full, ``cancel`` is set, or ``emit`` raises ``Stop``."""
        ...

    async def aclose(self) -> None: ...

    def close(self) -> None: ...


AnyEngine = TextEngine | AsyncTextEngine  # what the gateway serves: a local model, or a swarm's route engine
