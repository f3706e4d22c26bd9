"""A GGUF's tokenizer and model facts, from a vocab-only llama.cpp load (no weights, no KV).

Used by the single-node engine and by a gateway that drives a route: the gateway holds the
tokenizer and the chat template, the nodes hold the layers.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnet.artifacts.gguf_source import model_stem
from meshnet.artifacts.shard_file import trunk_layers
from meshnet.backends.base import ModelInfo
from meshnet.errors import InvalidRequest

if TYPE_CHECKING:
    from meshnet.backends.grammar import TokenGrammar

__all__ = ["LlamaVocab", "check_gguf_file", "model_meta", "quantization_name"]

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


def model_meta(llama_cpp: Any, model: Any, key: str, *, limit: int = 4096) -> str:
    """A GGUF metadata value of a loaded ``llama_model``, as text ("" when absent)."""
    buf = ctypes.create_string_buffer(limit)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""


class LlamaVocab:
    """Owns a vocab-only ``llama_model``. Thread-safe for reads (llama.cpp's vocab is immutable)."""

    def __init__(self, gguf: Path, *, model_id: str | None = None) -> None:
        check_gguf_file(gguf)
        import llama_cpp
        from llama_cpp._utils import suppress_stdout_stderr

        self._ll = llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        with suppress_stdout_stderr(disable=False):
            self._model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
        if self._model is None:
            raise InvalidRequest(f"llama.cpp could not load {gguf} (unsupported architecture or corrupt file)")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self._pieces: dict[int, bytes] = {}
        arch = self.meta("general.architecture") or "unknown"
        context = self.meta(f"{arch}.context_length")
        if not context.isdigit():
            self.close()
            raise InvalidRequest(f"{gguf} has no {arch}.context_length metadata; it is not a usable model GGUF")
        file_type = self.meta("general.file_type")
        bos, eos = int(llama_cpp.llama_vocab_bos(self._vocab)), int(llama_cpp.llama_vocab_eos(self._vocab))
        self.info = ModelInfo(
            model_id=model_id or model_stem(gguf),
            architecture=arch,
            quantization=quantization_name(int(file_type) if file_type.isdigit() else None),
            n_layers=trunk_layers(lambda key: self.meta(key) or None, arch),
            n_ctx_train=int(context),
            n_vocab=int(llama_cpp.llama_vocab_n_tokens(self._vocab)),
            hidden_size=int(self.meta(f"{arch}.embedding_length") or 0),
            chat_template=self.meta("tokenizer.chat_template", limit=1 << 20) or None,
            bos_token=self._text(bos),
            eos_token=self._text(eos),
            source=str(gguf),
        )

    def meta(self, key: str, *, limit: int = 4096) -> str:
        return model_meta(self._ll, self._model, key, limit=limit)

    def _text(self, token: int) -> str:
        if token < 0:
            return ""
        raw = self._ll.llama_vocab_get_text(self._vocab, token)
        return raw.decode("utf-8", "replace") if raw else ""

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 8
        while True:
            buf = (self._ll.llama_token * size)()
            n = int(self._ll.llama_tokenize(self._vocab, data, len(data), buf, size, add_special, parse_special))
            if n >= 0:
                return list(buf[:n])
            size = -n  # a negative result is the number of tokens needed

    def token_bytes(self, token: int) -> bytes:
        """The token's text bytes; control tokens render as nothing."""
        piece = self._pieces.get(token)
        if piece is None:
            size = 64
            while True:
                buf = ctypes.create_string_buffer(size)
                n = int(self._ll.llama_token_to_piece(self._vocab, token, buf, size, 0, False))
                if n >= 0:
                    break
                size = -n
            piece = self._pieces[token] = buf.raw[:n]
        return piece

    def is_end_of_generation(self, token: int) -> bool:
        return bool(self._ll.llama_vocab_is_eog(self._vocab, token))

    def grammar(self, text: str, *, param: str = "grammar") -> TokenGrammar:
        """A GBNF grammar compiled against this vocabulary (a 400 naming ``param`` when it does not parse)."""
        from meshnet.backends.grammar import TokenGrammar

        return TokenGrammar(self, self._vocab, self.info.n_vocab, text, param=param)

    def close(self) -> None:
        if self._model is not None:
            self._ll.llama_model_free(self._model)
            self._model = None

    def __getstate__(self) -> Any:
        raise TypeError("LlamaVocab wraps a native model and cannot be pickled")
