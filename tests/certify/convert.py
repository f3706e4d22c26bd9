"""llama.cpp's own HF → GGUF converter, as llama-cpp-python 0.3.36 ships it, and tiny random models for it.

The converter comes out of the llama-cpp-python sdist (``vendor/llama.cpp/convert_hf_to_gguf.py``,
``conversion/``, ``gguf-py/``) — the same llama.cpp commit as the compiled library, so a converted
tiny model exercises exactly the graph a real model of that family runs. It is fetched once with
pip (pip's cache serves repeats) and kept under ``~/.cache/meshnet/certify``; a missing converter
is an error, never a skip. Converted models are cached there too, keyed by their spec.

Each conversion runs in its own process: the converter puts its own ``gguf-py`` first on
``sys.path``, which must not replace the ``gguf`` package Meshnet imports.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON = "0.3.36"
_VENDOR = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
_TAKE = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
HARNESS_VERSION = 2  # bump to rebuild every cached model
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Lighthouse keepers watch the sea at night. "
    "Rivers carve canyons over many years. Bread needs flour, water, salt and time. "
    "Numbers: 0 1 2 3 4 5 6 7 8 9. Punctuation: , . ; : ! ? ( ) [ ] { } - + = / * & % $ # @. "
) * 20
# The GLM converters look their special tokens up by name.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "[gMASK]",
    "<sop>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshnet" / "certify"


def converter_dir() -> Path:
    """The converter's folder (``convert_hf_to_gguf.py`` beside ``conversion/`` and ``gguf-py/``)."""
    target = cache_root() / f"llama-convert-{LLAMA_CPP_PYTHON}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp]
        done = subprocess.run(
            [*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=False, capture_output=True, text=True
        )
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not sdists:
            raise RuntimeError(f"could not fetch the llama-cpp-python {LLAMA_CPP_PYTHON} sdist: {done.stderr[-2000:]}")
        staging = Path(tmp) / "converter"
        with tarfile.open(sdists[0]) as tar:
            for member in tar.getmembers():
                inner = member.name.removeprefix(_VENDOR)
                if inner != member.name and inner.startswith(_TAKE) and (member.isfile() or member.isdir()):
                    member.name = inner
                    tar.extract(member, staging, filter="data")
        staging.rename(target)  # atomic: a half-extracted converter is never found
    return target


_BOOT = r"""
import runpy, sys
conv = sys.argv[1]
sys.path.insert(0, conv)
sys.path.insert(1, conv + "/gguf-py")
import conversion.base as base
# A tiny tokenizer trained here has a BPE pre-tokenizer hash llama.cpp does not list: call it "default".
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "f32", *sys.argv[4:]]
runpy.run_path(conv + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(hf_dir: Path, out: Path, args: tuple[str, ...] = ()) -> Path:
    """Convert a saved HF model to a float32 GGUF with llama.cpp's converter; written atomically."""
    partial = out.with_suffix(".partial.gguf")
    done = subprocess.run(
        [sys.executable, "-c", _BOOT, str(converter_dir()), str(hf_dir), str(partial), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's converter failed on {hf_dir.name}:\n{done.stderr[-3000:]}")
    partial.rename(out)
    return out


@dataclass(frozen=True)
class TinyModel:
    """A tiny random model of one family: its GGUF architecture, transformers ``model_type`` and config."""

    arch: str
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    layers: int = 6
    tokenizer: str = "bpe"  # or "spm": a SentencePiece model (tokenizer.model), which some converters require
    convert_args: tuple[str, ...] = ()  # extra converter flags (e.g. --no-mtp)
    # keys added to the saved config.json: some converters read a checkpoint's own (legacy) keys
    # that transformers folds into others and does not write back
    raw_config: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        blob = json.dumps({"v": HARNESS_VERSION, **asdict(self)}, sort_keys=True).encode()
        return f"{self.arch}-{hashlib.sha256(blob).hexdigest()[:12]}"


def gguf_for(model: TinyModel) -> tuple[Path, Path]:
    """``(GGUF, HF folder)`` of ``model``: built and converted on first use, then cached."""
    base = cache_root() / "models" / model.key()
    gguf, hf_dir = base.with_suffix(".gguf"), base
    if gguf.is_file() and hf_dir.is_dir():
        return gguf, hf_dir
    base.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base.parent) as tmp:
        staging = Path(tmp) / model.arch
        save_tiny_model(model, staging)
        convert(staging, gguf, model.convert_args)
        shutil.rmtree(hf_dir, ignore_errors=True)
        staging.rename(hf_dir)
    return gguf, hf_dir


def save_tiny_model(model: TinyModel, out: Path) -> None:
    """A random model (weights ~ N(0, 0.08), seed 0) with a ~400-token tokenizer trained here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True)
    n_vocab = _save_sentencepiece(out) if model.tokenizer == "spm" else _save_tokenizer(out)
    config: dict[str, Any] = {
        "vocab_size": n_vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": model.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        **model.config,
    }
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model.model_type, **config))
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.08)
    hf.save_pretrained(out)
    if model.raw_config:
        saved = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**saved, **model.raw_config}, indent=2))
    if not any(out.glob("*.safetensors")):
        shutil.rmtree(out)
        raise RuntimeError(f"transformers saved no weights for {model.model_type}")


def _save_tokenizer(out: Path, vocab: int = 400) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], bos_token=SPECIAL_TOKENS[0])
    fast.save_pretrained(out)
    return len(tok.get_vocab())


def _save_sentencepiece(out: Path, vocab: int = 512) -> int:
    """A SentencePiece BPE model (``tokenizer.model``) trained on the corpus; ids 0-2 are unk, bos, eos,
    then the 256 byte pieces llama.cpp's SentencePiece vocabulary requires (``<0x0A>``...)."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.split(". ")),
        model_writer=model,
        vocab_size=vocab,
        model_type="bpe",
        character_coverage=1.0,
        hard_vocab_limit=False,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=["<|endoftext|>"],  # llama.cpp's phi3 vocabulary looks it up by name
        minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    return int(spm.SentencePieceProcessor(model_proto=model.getvalue()).vocab_size())
