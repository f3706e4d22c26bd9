"""A deterministic byte-level engine for fast unit tests of everything above the backends.

It is *beside* the real engines, never instead of them: the gateway's integration tests drive
real llama.cpp. Tokens 0-255 are bytes; ``EOS`` ends a generation. The "model" continues a
prompt by cycling through ``reply`` and then emits ``EOS``; logits put all mass on that choice,
so greedy and seeded sampling agree, which is all the gateway needs to be tested against.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Sequence

import numpy as np

from meshnet.backends.base import EngineStep, ModelInfo, PrefillProgress, RouteChange, TokenStep, local_plan
from meshnet.backends.grammar import TokenGrammar
from meshnet.errors import Conflict, InvalidRequest
from meshnet.ids import new_route_id, new_session_id
from meshnet.routes import Hop, RoutePlan
from meshnet.sampling import Sampler

__all__ = ["FakeEngine"]

BOS = 256
EOS = 257
VOCAB = 258

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class FakeEngine:
    max_concurrency = 1

    def __init__(
        self,
        reply: str = "Hello from the fake engine.",
        *,
        n_ctx: int = 512,
        n_ctx_train: int = 1024,
        prefill_chunk: int = 8,
        step_delay_s: float = 0.0,
        repair_at: int | None = None,
    ) -> None:
        self.url = "local"
        self.reply = reply.encode("utf-8")
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self.step_delay_s = step_delay_s
        self.repair_at = repair_at  # before this decode step, report a route repair (as routes do)
        self.prefill_calls = 0
        self._busy = threading.Lock()
        self.info = ModelInfo(
            model_id="fake-model",
            architecture="fake",
            quantization="F32",
            n_layers=4,
            n_ctx_train=n_ctx_train,
            n_vocab=VOCAB,
            hidden_size=8,
            chat_template=CHAT_TEMPLATE,
            bos_token="<s>",
            eos_token="</s>",
            source="memory://fake",
        )

    def grammar(self, text: str, *, param: str = "grammar") -> TokenGrammar:
        raise InvalidRequest("the fake engine has no vocabulary to compile a grammar against", param=param)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        body = list(text.encode("utf-8"))
        return [BOS, *body] if add_special else body

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else b""

    def is_end_of_generation(self, token: int) -> bool:
        return token == EOS

    def plan(
        self, *, prompt_tokens: int = 0, max_tokens: int = 0, trusted_only: bool = False, prompt: Sequence[int] = (),
        namespace: bytes = b"",
    ) -> RoutePlan:  # fmt: skip
        return local_plan(self.info, self.url)  # one process holds the whole model: nothing leaves it

    def release(self, plan: RoutePlan) -> None:
        pass  # nothing was reserved for a local route

    def generate(
        self, prompt: Sequence[int], sampler: Sampler, cancel: threading.Event, plan: RoutePlan | None = None
    ) -> Generator[EngineStep, None, None]:
        if not prompt:
            raise InvalidRequest("the prompt is empty after tokenization")
        if not self._busy.acquire(blocking=False):
            raise Conflict("the fake engine is already generating")
        try:
            self.prefill_calls += 1
            total = len(prompt)
            for start in range(0, total, self.prefill_chunk):
                time.sleep(self.step_delay_s)
                yield PrefillProgress(done=min(start + self.prefill_chunk, total), total=total)
            position = total
            step = 0
            while not cancel.is_set() and position < self.n_ctx:
                if step == self.repair_at:
                    moved = RoutePlan(
                        new_session_id(), new_route_id(), (Hop("spare", "local-spare", self.info.layers),)
                    )
                    yield RouteChange("repair", "node local failed: simulated", "local", moved, 1, position, 0.01)
                target = self.reply[step] if step < len(self.reply) else EOS
                logits = np.full(VOCAB, -30.0, dtype=np.float32)
                logits[target] = 30.0
                token, logprob = sampler.sample(logits, position=position)
                time.sleep(self.step_delay_s)
                yield TokenStep(token=token, logprob=logprob, top=sampler.alternatives(logits))
                sampler.generated[token] += 1
                step += 1
                position += 1
        finally:
            self._busy.release()

    def close(self) -> None:
        pass
