"""Single-node llama.cpp engine: the whole GGUF in one ``llama_context``.

Ownership: one engine owns one context and its KV cache, so it runs one generation at a time
(``max_concurrency == 1``); a second concurrent ``generate`` raises ``Conflict`` instead of
corrupting the first one's KV. The gateway queues requests in front of it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshnet.backends.base import EngineStep, PrefillProgress, TokenStep, local_plan
from meshnet.backends.gpu import require_offload
from meshnet.backends.grammar import TokenGrammar
from meshnet.backends.llama_vocab import LlamaVocab
from meshnet.errors import Conflict, EngineError, InvalidRequest
from meshnet.routes import RoutePlan
from meshnet.sampling import Sampler

__all__ = ["LlamaFullEngine"]


class LlamaFullEngine:
    """llama-cpp-python ``Llama`` used at the level of eval + logits; Meshnet samples."""

    max_concurrency = 1

    def __init__(
        self,
        gguf: Path,
        *,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_batch: int = 512,
        model_id: str | None = None,
        context_cap: int = 131072,
        url: str = "local",
        gpu_layers: int = 0,
    ) -> None:
        """``gpu_layers``: layers offloaded to a GPU (backends.gpu): 0 none, -1 all, N the last N."""
        import llama_cpp

        if gpu_layers < -1:
            raise InvalidRequest(f"--gpu-layers is all, 0 or a layer count, not {gpu_layers}", param="gpu_layers")
        require_offload(llama_cpp, gpu_layers)  # before anything loads: a CPU build says what to rebuild
        self.url = url
        self.gpu_layers = gpu_layers
        self.vocab = LlamaVocab(gguf, model_id=model_id)
        self.info = self.vocab.info
        n_ctx_train = self.info.n_ctx_train
        cap = min(context_cap, n_ctx_train)
        if n_ctx is not None and n_ctx > cap:
            self.vocab.close()
            raise InvalidRequest(
                f"--ctx {n_ctx} exceeds the context cap {cap} "
                f"(min of the product cap {context_cap} and the model's trained context {n_ctx_train})",
                param="ctx",
            )
        self.n_ctx = n_ctx or cap
        self.n_threads = n_threads or os.cpu_count() or 1
        self._llm: Any = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=self.n_ctx,
            n_batch=min(n_batch, self.n_ctx),
            n_ubatch=min(n_batch, self.n_ctx),
            n_threads=self.n_threads,
            n_threads_batch=self.n_threads,
            n_gpu_layers=gpu_layers,
            logits_all=False,
            flash_attn=True,  # the shard backend uses the same kernels, so routes match serve exactly
            verbose=False,
        )
        self._n_vocab = int(self._llm.n_vocab())
        self._chunk = min(n_batch, self.n_ctx)
        self._busy = threading.Lock()

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.vocab.token_bytes(token)

    def is_end_of_generation(self, token: int) -> bool:
        return self.vocab.is_end_of_generation(token)

    def grammar(self, text: str, *, param: str = "grammar") -> TokenGrammar:
        return self.vocab.grammar(text, param=param)

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
            raise Conflict("this engine is already generating; requests must be queued in front of it")
        try:
            yield from self._generate(prompt, sampler, cancel)
        finally:
            self._busy.release()

    def _generate(
        self, prompt: Sequence[int], sampler: Sampler, cancel: threading.Event
    ) -> Generator[EngineStep, None, None]:
        llm = self._llm
        llm.reset()
        total = len(prompt)
        for start in range(0, total, self._chunk):
            if cancel.is_set():
                return
            self._eval(prompt[start : start + self._chunk])
            yield PrefillProgress(done=min(start + self._chunk, total), total=total)
        while not cancel.is_set():
            if llm.n_tokens >= self.n_ctx:
                return  # the caller sees the context end as finish_reason "length"
            logits = self._last_logits()
            token, logprob = sampler.sample(logits, position=llm.n_tokens)
            yield TokenStep(token=token, logprob=logprob, top=sampler.alternatives(logits))
            sampler.advance(token)
            self._eval([token])

    def _eval(self, tokens: Sequence[int]) -> None:
        try:
            self._llm.eval(tokens)
        except RuntimeError as exc:  # llama_decode returned an error code
            raise EngineError(f"llama.cpp decode failed: {exc}") from exc

    def _last_logits(self) -> np.ndarray[Any, np.dtype[np.float32]]:
        ptr = self._llm._ctx.get_logits_ith(-1)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def close(self) -> None:
        self._llm.close()
        self.vocab.close()
