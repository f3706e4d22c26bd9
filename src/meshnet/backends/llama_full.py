"""Single-node llama.cpp engine: the whole GGUF in one ``llama_context``.

Ownership: one engine owns one context and its KV cache, so it runs one generation at a time
(``max_concurrency == 1``); a second concurrent ``generate`` raises ``Conflict`` instead of
corrupting the first one's KV. The gateway queues requests in front of it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshnet.backends.base import EngineStep, ModelInfo, PrefillProgress, TokenStep
from meshnet.errors import Conflict, EngineError, InvalidRequest
from meshnet.sampling import Sampler

__all__ = ["LlamaFullEngine", "quantization_name"]

_GGUF_MAGIC = b"GGUF"


def quantization_name(file_type: int | None) -> str:
    """``general.file_type`` (llama.cpp's ``LLAMA_FTYPE_*``) → a short name such as ``Q4_1``."""
    if file_type is None:
        return "unknown"
    from gguf import LlamaFileType

    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return f"ftype-{file_type}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def check_gguf_file(path: Path) -> None:
    """Fail with a message that says what to fix before llama.cpp prints a wall of logs."""
    if not path.exists():
        raise InvalidRequest(f"GGUF file not found: {path}", param="gguf")
    if not path.is_file():
        raise InvalidRequest(f"{path} is not a file; pass the path of a .gguf file", param="gguf")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise InvalidRequest(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')", param="gguf")


def _trained_context(llama_cpp: Any, gguf: Path) -> int:
    """Read ``{arch}.context_length`` from a vocab-only load: no weights, no KV cache allocated."""
    from llama_cpp._utils import suppress_stdout_stderr

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with suppress_stdout_stderr(disable=False):
        model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
    if model is None:
        raise InvalidRequest(f"llama.cpp could not load {gguf} (unsupported architecture or corrupt file)")
    try:
        arch = _meta(llama_cpp, model, "general.architecture")
        value = _meta(llama_cpp, model, f"{arch}.context_length")
        if not value.isdigit():
            raise InvalidRequest(
                f"{gguf} has no {arch}.context_length metadata; it is not a usable model GGUF"
            )
        return int(value)
    finally:
        llama_cpp.llama_model_free(model)


def _token_piece(llama_cpp: Any, vocab: Any, token: int) -> bytes:
    """The token's text bytes; control tokens (special=False) render as nothing."""
    size = 64
    while True:
        buf = ctypes.create_string_buffer(size)
        n = int(llama_cpp.llama_token_to_piece(vocab, token, buf, size, 0, False))
        if n >= 0:
            return buf.raw[:n]
        size = -n  # a negative result is the size the piece needs


def _meta(llama_cpp: Any, model: Any, key: str) -> str:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""


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
    ) -> None:
        check_gguf_file(gguf)
        import llama_cpp

        threads = n_threads or os.cpu_count() or 1
        n_ctx_train = _trained_context(llama_cpp, gguf)
        cap = min(context_cap, n_ctx_train)
        if n_ctx is not None and n_ctx > cap:
            raise InvalidRequest(
                f"--ctx {n_ctx} exceeds the context cap {cap} "
                f"(min of the product cap {context_cap} and the model's trained context {n_ctx_train})",
                param="ctx",
            )
        self.n_ctx = n_ctx or cap
        self._llm: Any = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=self.n_ctx,
            n_batch=min(n_batch, self.n_ctx),
            n_ubatch=min(n_batch, self.n_ctx),
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            flash_attn=True,  # the shard backend uses the same kernels, so routes match serve exactly
            verbose=False,
        )
        self._llama_cpp = llama_cpp
        self._vocab = self._llm._model.vocab
        self._n_vocab = int(self._llm.n_vocab())
        self._chunk = min(n_batch, self.n_ctx)
        self._busy = threading.Lock()
        self._pieces: dict[int, bytes] = {}
        meta: dict[str, str] = dict(self._llm.metadata)
        arch = meta.get("general.architecture", "unknown")
        file_type = meta.get("general.file_type")
        model = self._llm._model
        self.info = ModelInfo(
            model_id=model_id or gguf.name.removesuffix(".gguf"),
            architecture=arch,
            quantization=quantization_name(int(file_type) if file_type is not None else None),
            n_layers=int(meta.get(f"{arch}.block_count", "0")),
            n_ctx_train=n_ctx_train,
            n_vocab=self._n_vocab,
            hidden_size=int(self._llm.n_embd()),
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=model.token_get_text(model.token_bos()) if model.token_bos() >= 0 else "",
            eos_token=model.token_get_text(model.token_eos()) if model.token_eos() >= 0 else "",
            source=str(gguf),
        )
        self.n_threads = threads

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True))

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = _token_piece(self._llama_cpp, self._vocab, token)
        return piece

    def is_end_of_generation(self, token: int) -> bool:
        return bool(self._llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def generate(
        self, prompt: Sequence[int], sampler: Sampler, cancel: threading.Event
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
            token, logprob = sampler.sample(self._last_logits())
            yield TokenStep(token=token, logprob=logprob)
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
