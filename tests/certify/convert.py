"""llama.cpp's own HF → GGUF converter, as the installed llama-cpp-python ships it, and tiny random models for it.

The converter comes out of the llama-cpp-python sdist (``vendor/llama.cpp/convert_hf_to_gguf.py``,
``conversion/``, ``gguf-py/``) — the same llama.cpp commit as the compiled library, so a converted
tiny model exercises exactly the graph a real model of that family runs. It is fetched once with
pip (pip's cache serves repeats) and kept under ``~/.cache/meshnet/certify``; a missing converter
is an error, never a skip. Converted models are cached there too, keyed by their spec.

Conversions run in a process of their own (several models to one process: its imports take
seconds): the converter puts its own ``gguf-py`` first on ``sys.path``, which must not replace the
``gguf`` package Meshnet imports.
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

from meshnet.cli.paths import cache_home
from meshnet.models.families import LLAMA_CERTIFIED_ON, installed_llama_cpp

# The converter of the llama.cpp the shards run: that of the installed llama-cpp-python release.
LLAMA_CPP_PYTHON = installed_llama_cpp() or LLAMA_CERTIFIED_ON
_VENDOR = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
_TAKE = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
HARNESS_VERSION = 3  # bump to rebuild every cached model
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
    return cache_home() / "certify"


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


# Converts a list of (HF folder, output, extra flags) jobs in one process (the converter's imports take
# seconds; a certification run converts dozens of models), printing "meshnet-converted N" after each.
_BOOT = r"""
import json, runpy, sys, traceback
conv, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, conv)
sys.path.insert(1, conv + "/gguf-py")
import conversion.base as base
# A tiny tokenizer trained here has a BPE pre-tokenizer hash llama.cpp does not list: call it "default".
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
# Some converters read a checkpoint's own config.json keys (rotary_pct, n_ctx, ...) that transformers
# folds into others and leaves out of the config it loads: give them the file's keys too.
import pathlib
_load = base.ModelBase.load_hparams
def _hparams(dir_model, is_mistral_format):
    loaded = _load(dir_model, is_mistral_format)
    raw = pathlib.Path(dir_model) / "config.json"
    saved = json.loads(raw.read_text()) if raw.is_file() and not is_mistral_format else {}
    return {**saved, **loaded}
base.ModelBase.load_hparams = staticmethod(_hparams)
for index, (hf_dir, out, args) in enumerate(jobs):
    # flags a job's arguments set on a model class (--no-mtp) must not carry over to the next job
    for classes in base.ModelBase._model_classes.values():
        for cls in classes.values():
            for flag in ("no_mtp", "mtp_only"):
                if flag in vars(cls):
                    delattr(cls, flag)
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", "f32", *args]
    try:
        runpy.run_path(conv + "/convert_hf_to_gguf.py", run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            print(f"meshnet-failed {index}", flush=True)
            continue
    except Exception:
        traceback.print_exc()
        print(f"meshnet-failed {index}", flush=True)
        continue
    print(f"meshnet-converted {index}", flush=True)
"""


def convert_many(jobs: list[tuple[Path, Path, tuple[str, ...]]]) -> tuple[set[int], str]:
    """Convert saved HF models to float32 GGUFs with llama.cpp's converter, all in one process; each
    output is written atomically. Returns the indices converted and the converter's log (a job that
    fails, or crashes the process, is left out)."""
    if not jobs:
        return set(), ""
    partials = [out.with_suffix(f".partial-{os.getpid()}.gguf") for _, out, _ in jobs]  # test workers share the cache
    spec = [(str(hf), str(partial), list(args)) for (hf, _, args), partial in zip(jobs, partials, strict=True)]
    try:
        done = subprocess.run(
            [sys.executable, "-c", _BOOT, str(converter_dir()), json.dumps(spec)],
            check=False,
            capture_output=True,
            text=True,
            timeout=120 + 60 * len(jobs),
        )
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:  # what finished before it stalled still counts
        stdout, stderr = _text(exc.stdout), _text(exc.stderr) + f"\n(the converter stalled past {exc.timeout} s)"
    converted = {int(line.split()[1]) for line in stdout.splitlines() if line.startswith("meshnet-converted ")}
    for index, ((_, out, _), partial) in enumerate(zip(jobs, partials, strict=True)):
        if index in converted and partial.is_file():
            partial.rename(out)
        else:
            converted.discard(index)
            partial.unlink(missing_ok=True)
    return converted, stderr


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def convert(hf_dir: Path, out: Path, args: tuple[str, ...] = ()) -> Path:
    """Convert one saved HF model to a float32 GGUF with llama.cpp's converter; written atomically."""
    converted, log = convert_many([(hf_dir, out, args)])
    if not converted:
        raise RuntimeError(f"llama.cpp's converter failed on {hf_dir.name}:\n{log[-3000:]}")
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
    # "hf": transformers' own save_pretrained; "deepseek4": DeepSeek's native checkpoint layout
    # (``layers.N.attn.wq_a.weight``, MXFP4 routed experts), the only one llama.cpp's converter reads
    layout: str = "hf"

    def key(self) -> str:
        blob = json.dumps({"v": HARNESS_VERSION, **asdict(self)}, sort_keys=True).encode()
        return f"{self.arch}-{hashlib.sha256(blob).hexdigest()[:12]}"


REFERENCE = "reference"  # the transformers checkpoint beside a native-layout one


def gguf_for(model: TinyModel) -> tuple[Path, Path]:
    """``(GGUF, HF folder)`` of ``model``: built and converted on first use, then cached. The HF
    folder is the one transformers loads (a native-layout checkpoint keeps it in ``reference/``)."""
    base, gguf, hf_dir = _paths(model)
    if gguf.is_file() and hf_dir.is_dir():
        return gguf, hf_dir
    base.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base.parent) as tmp:
        staging = Path(tmp) / model.arch
        save_tiny_model(model, staging)
        convert(staging, gguf, model.convert_args)
        _settle(staging, base)
    return gguf, hf_dir


def _settle(staging: Path, base: Path) -> None:
    """Move a built model's folder into the cache; another test worker may have put it there first."""
    try:
        staging.rename(base)
    except OSError:
        if not base.is_dir():
            raise


def prepare(models: list[TinyModel]) -> None:
    """Build and convert every model of ``models`` not cached yet, in one converter process. A model
    whose conversion fails is left for ``gguf_for``, which converts it alone and raises its error."""
    missing = {model.key(): model for model in models if not gguf_for_cached(model)}
    if not missing:
        return
    root = cache_root() / "models"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        jobs, staged = [], []
        for key, model in missing.items():
            staging = Path(tmp) / key
            try:
                save_tiny_model(model, staging)
            except Exception:  # gguf_for builds it again, alone, and raises the error in its own test
                continue
            jobs.append((staging, (root / key).with_suffix(".gguf"), model.convert_args))
            staged.append((staging, root / key))
        converted, _ = convert_many(jobs)
        for index in converted:
            _settle(*staged[index])


def _paths(model: TinyModel) -> tuple[Path, Path, Path]:
    """``(cache folder, GGUF, HF folder transformers loads)`` of ``model``."""
    base = cache_root() / "models" / model.key()
    return base, base.with_suffix(".gguf"), base / REFERENCE if model.layout != "hf" else base


def gguf_for_cached(model: TinyModel) -> bool:
    """Whether ``model``'s GGUF and HF folder are cached already."""
    _, gguf, hf_dir = _paths(model)
    return gguf.is_file() and hf_dir.is_dir()


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
    if model.layout == "deepseek4":
        _native_deepseek4(hf, out)  # rounds hf's experts to what the GGUF will hold
        hf.save_pretrained(out / REFERENCE)
        shutil.copy(out / REFERENCE / "config.json", out / "config.json")
    else:
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


# transformers' DeepSeek-V4 names → DeepSeek's native ones (the inverse of transformers'
# ``conversion_mapping`` for ``deepseek_v4``); applied in order, the first full match wins.
_DSV4_ROOT = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_DSV4_LAYER = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
}
# OCP MX FP4 (E2M1) values in code order; codes 8-15 are the negatives.
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _mxfp4(weight: Any) -> tuple[Any, Any, Any]:
    """``weight`` [rows, cols] rounded onto the MXFP4 grid: ``(packed uint8 [rows, cols/2],
    E8M0 scales uint8 [rows, cols/32], the dequantized values)`` — the model then uses exactly what
    the GGUF will hold."""
    import torch

    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // 32, 32).double()
    peak = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    grid = torch.tensor(_FP4, dtype=torch.float64)
    codes = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)
    values = grid[codes] * torch.exp2(exponent)
    negative = (scaled < 0) & (codes > 0)
    codes = codes + 8 * negative
    values = torch.where(negative, -values, values)
    flat = codes.reshape(rows, cols).to(torch.uint8)
    packed = flat[:, 0::2] | (flat[:, 1::2] << 4)
    scales = (exponent.squeeze(-1) + 127).to(torch.uint8)
    return packed.contiguous(), scales.contiguous(), values.reshape(rows, cols).float()


def _native_deepseek4(hf: Any, out: Path) -> None:
    """Rewrite ``out``'s weights in DeepSeek's native layout, routed experts as MXFP4 (packed E2M1
    codes + E8M0 scales, as DeepSeek ships them). The experts of ``hf`` are rounded to the same values
    in place, so transformers' forward stays the reference for the GGUF."""
    import re

    import torch
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, table in hf.named_buffers():
            if name.endswith("tid2eid"):  # hash routing: distinct random experts per token id
                n_experts = hf.config.n_routed_experts
                picks = torch.rand(table.shape[0], n_experts, generator=generator).argsort(dim=-1)
                table.copy_(picks[:, : table.shape[1]])
        for name, value in hf.state_dict().items():
            if name in _DSV4_ROOT:
                tensors[_DSV4_ROOT[name]] = value.contiguous()
                continue
            match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            if match is None:
                raise RuntimeError(f"no native DeepSeek-V4 name for {name}")
            layer, rest = match.groups()
            if rest in _DSV4_LAYER:
                tensors[f"layers.{layer}.{_DSV4_LAYER[rest]}"] = value.contiguous()
                continue
            if rest not in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                raise RuntimeError(f"no native DeepSeek-V4 name for {name}")
            param = hf.get_parameter(name)
            for expert in range(value.shape[0]):
                if rest.endswith("down_proj"):
                    parts = {"w2": (slice(None),)}
                else:
                    half = value.shape[1] // 2
                    parts = {"w1": (slice(0, half),), "w3": (slice(half, None),)}
                for proj, (rows,) in parts.items():
                    packed, scales, values = _mxfp4(value[expert, rows])
                    param[expert, rows] = values
                    tensors[f"layers.{layer}.ffn.experts.{expert}.{proj}.weight"] = packed
                    tensors[f"layers.{layer}.ffn.experts.{expert}.{proj}.scale"] = scales
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
