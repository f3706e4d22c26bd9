"""Model families: which architectures a layer-split route serves correctly — one table, one place.

A route splits a model's blocks between nodes; whatever an architecture's graph does at a seam
(scales the input embeddings, picks attention type or rope by layer index, reads token ids inside
layers, keeps recurrent state) can make the split route compute something other than the whole
model — fluent text, wrong, with no error. So an architecture is served only once its
certification has passed: the whole GGUF in one llama.cpp context and the same GGUF cut into a
route (2 and 3 shards, cuts that fall on no layer pattern, odd prefill chunks, two interleaved
sessions) give bit-identical logits and identical greedy tokens (``tests/backends/
test_certification.py``, on tiny random models converted by llama.cpp's own converter; the table
in docs/models.md). Everything else is refused by ``meshnet shard make``, ``publish``, ``node`` and
``up`` unless the operator passes ``--allow-uncertified``.

Where a family needs handling at a seam, it goes into its ``Family`` record here — never into an
``if arch == ...`` elsewhere.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshnet.errors import InvalidRequest

__all__ = [
    "FAMILIES",
    "KNOWN_ARCHITECTURES",
    "LLAMA_CERTIFIED_ON",
    "Family",
    "UncertifiedArchitecture",
    "certification",
    "family",
    "family_of_model_type",
    "installed_llama_cpp",
    "require_certified",
]


@dataclass(frozen=True, slots=True)
class Family:
    """One GGUF architecture (``general.architecture``) and what is known about splitting it.

    ``llama_route`` / ``torch_route``: certified on that backend's layer-split route. ``why`` says
    what the certification found, or what stands in its way. The other fields are the family's seam
    handling, applied by the shard writer (``artifacts.shard_file``) and the llama.cpp shard:

    - ``rescaled_input``: the graph multiplies every shard's input — token embeddings and inbound
      hidden states alike — and names the product thus; a non-head shard overwrites that tensor
      with the inbound hidden state, so the scale applies once, at the head.
    - ``token_seam``: the graph refuses embeddings as input (llama.cpp aborts), or treats them as
      media (multimodal rope positions); a shard is given placeholder token ids and overwrites the
      looked-up rows (``input_name``; past the head ``rescaled_input`` if the family has one) with
      its input.
    - ``input_name``: the graph's name for the looked-up embedding rows.
    - ``recurrent``: a hybrid family — some layers keep a fixed-size recurrent state per session
      instead of KV. Every range must hold layers of both kinds; a rewind restores the state
      saved before the last chunk (truncating positions cannot undo a recurrence).
      ``recurrent_by``: how llama.cpp tells the kinds apart — ``"interval"`` (``recurrent_layers``, or
      all but every ``full_attention_interval``-th), ``"kv_heads"`` (layers with no KV head are
      recurrent), ``"kv_heads_and_ff"`` (and no feed-forward either: the rest with no KV head are
      MLP-only), ``"all"`` (a pure state-space model: no KV, no rule on ranges) or ``"parallel"``
      (every layer keeps both a state and KV).
    - ``head_scale``: the graph scales token embeddings but not embeddings fed in as vectors; the
      head (which looks embeddings up itself) multiplies them by this factor (``"sqrt_n_embd"``).
    - ``swa_period`` / ``swa_dense_first``: the sliding-window layer pattern llama.cpp derives from
      the layer index inside the file; the shard writer writes it out per layer, then slices it.
      ``swa_empty``: what a range without sliding-window layers gets — ``"disable"`` (window 0
      turns sliding off), ``"unbounded"`` (the graph insists on sliding layers: all slide, with a
      window that masks nothing) or ``"refuse"`` (full-attention layers differ from sliding ones by more
      than the mask, e.g. no rope: such a range is refused).
    - ``leading_layer_keys``: metadata counting the model's first N layers (dense before MoE);
      made relative to the range.
    - ``start_flags``: a per-layer metadata array (of the llama.cpp defaults, if absent) whose entry
      must be true at a range's first layer: e.g. GLM-5.2's layers that reuse the previous layer's
      top-k selection instead of computing their own cannot open a range (the selection would have
      to cross the seam).
    - ``cut_multiple``: llama.cpp picks a per-layer behaviour by the layer index modulo this (e.g.
      which layers skip rope); ranges must start at a multiple of it.
    - ``rope_free_every``: every N-th layer (index % N == N - 1) skips rope and reads an input of its
      own (Llama 4's attention temperature); llama.cpp leaves that input unallocated, and aborts, in a
      graph without such a layer, so every range must hold one.
    - ``layer_output``: the graph's name for a layer's output; a non-tail shard sends its last
      layer's. ``rows_after_layers``: the graph picks its output rows after the last layer (not in
      it), so a non-tail shard asks llama.cpp for one output row and still captures every row.
    - ``streams``: metadata key of the number of residual streams the seam carries (DeepSeek-V4's
      hyper-connections: the seam is ``[streams, n_embd]`` per position).
    - ``token_layers``: metadata key counting the model's first N layers that read token ids inside
      them (DeepSeek-V4's hash-routed MoE); made relative to the range. llama.cpp looks the ids up
      in tables as wide as the vocabulary, so those layers stay on the head, which keeps its
      vocabulary and runs on token ids: ranges past the head start at layer N or later.
    - ``range_kinds``: ``(key, values)``: a per-layer metadata array every range must hold each of
      ``values`` in (llama.cpp builds one cache per kind and fails on an empty one). Ranges open
      only where the two layers before the cut and the two from it hold every kind, so any range
      of two or more layers holds them all.
    - ``layer_key_prefixes``: metadata outside ``{arch}.`` that holds per-layer arrays (sliced with
      the layers like the architecture's own, e.g. apertus's ``xielu.*`` activation parameters).
    - ``rollback``: the layers keep compressor states that llama.cpp rolls back from per-position
      snapshots (``n_rs_seq``): a rewind reaches at most this many positions back, once per step.
    - ``unsplittable_layer_counts``: whole-model layer counts for which llama.cpp picks a
      hyperparameter by the file's layer count; a shard of such a model would compute another
      model, so cutting one is refused.
    """

    arch: str
    llama_route: bool
    torch_route: bool
    why: str
    rescaled_input: str | None = None
    token_seam: bool = False
    input_name: str = "embd"
    recurrent: bool = False
    recurrent_by: str = "interval"
    head_scale: str | None = None
    swa_period: int | None = None
    swa_dense_first: bool = False
    swa_empty: str = "disable"
    leading_layer_keys: tuple[str, ...] = ()
    cut_multiple: int = 1
    rope_free_every: int = 0
    start_flags: str | None = None
    layer_output: str = "l_out"
    rows_after_layers: bool = False
    streams: str | None = None
    token_layers: str | None = None
    range_kinds: tuple[str, tuple[int, ...]] | None = None
    rollback: int = 0
    layer_key_prefixes: tuple[str, ...] = ()
    hf_types: tuple[str, ...] = ()  # transformers model_type(s) of the family (PyTorch nodes load those)
    unsplittable_layer_counts: Mapping[int, str] = field(default_factory=dict)


# The llama-cpp-python release (and so the llama.cpp commit it vendors) the llama.cpp route was
# certified on: a node on another one refuses to serve a split unless allowed. `make certify` writes
# it here from a run in which every certified family passed.
LLAMA_CERTIFIED_ON = "0.3.36"
# Architectures llama.cpp runs that a route refuses, and what stands in the way.
_REFUSED = {
    "minicpm3": "llama.cpp scales each residual by scale_depth / sqrt(n_layer), taking n_layer from the file: a "
    "shard computes another model",
    "minicpm": "llama.cpp scales each residual by scale_depth / sqrt(n_layer), taking n_layer from the file: a shard "
    "computes another model",
    "phimoe": "the whole GGUF already differs from transformers' forward (relative logit gap 0.12 on the tiny model): "
    "there is no model to certify a split against",
    "laguna": "the whole GGUF already differs from transformers' forward (relative logit gap 0.11 on the tiny model: "
    "rope and windows by layer kind), and splits differ from it in the last bits at some cuts; not understood yet",
    "nemotron_h": "llama.cpp 0.3.36's converter reads a transformers 5.24 Nemotron-H config (which always names "
    "num_experts_per_tok) as the MoE variant: no dense tiny model converts (nemotron_h_moe is certified)",
    "gemma3n": "per-layer embeddings are looked up from token ids inside every layer: each node would need the "
    "vocabulary-wide table",
    "gemma4": "llama.cpp 0.3.36's converter cannot read a transformers 5.24 Gemma 4 text config",
    "bitnet": "llama.cpp 0.3.36's converter cannot map transformers 5.24 BitNet tensor names (ffn_sub_norm)",
    "hunyuan-moe": "llama.cpp 0.3.36's converter needs Hunyuan's tiktoken tokenizer files",
    "kimi-linear": "llama.cpp 0.3.36's converter cannot map transformers 5.24 Kimi-Linear tensor names",
    "deepseek32": "llama.cpp 0.3.36's converter insists the tokenizer adds a BOS token (add_bos_token), which "
    "transformers 5.24's tokenizers no longer say: no tiny DeepSeek-V3.2 converts",
    "internlm2": "transformers has no InternLM2 class to build the tiny certification model from",
    "baichuan": "transformers has no Baichuan class to build the tiny certification model from",
    "bailingmoe": "transformers has no Bailing MoE class to build the tiny certification model from",
}
_CERTIFIED = "token- and bit-identical to the whole GGUF at every cut (tests/backends/test_certification.py)"
_DENSE_LEAD = ("leading_dense_block_count",)

FAMILIES: dict[str, Family] = {
    f.arch: f
    for f in (
        Family(
            "llama",
            True,
            True,
            _CERTIFIED + "; the bundled SmolLM2 over the network on both backends",
            hf_types=("llama",),
        ),
        Family("qwen2", True, False, _CERTIFIED),
        Family("qwen3", True, False, _CERTIFIED),
        Family("qwen3moe", True, False, _CERTIFIED),
        Family("olmo2", True, False, _CERTIFIED),
        Family(
            "granite",
            True,
            False,
            _CERTIFIED + "; every shard's input is multiplied by the embedding scale, undone past the head",
            rescaled_input="embd",
        ),
        Family(
            "gemma",
            True,
            False,
            _CERTIFIED + "; every shard's input is scaled by sqrt(n_embd), undone past the head",
            rescaled_input="inp_scaled",
        ),
        Family(
            "gemma2",
            True,
            False,
            _CERTIFIED + "; input scale undone past the head; sliding-window pattern written per layer",
            rescaled_input="inp_scaled",
            swa_period=2,
            swa_empty="unbounded",
            unsplittable_layer_counts={46: "llama.cpp picks the 27B's attention scale by the layer count (46)"},
        ),
        Family(
            "gemma3",
            True,
            False,
            _CERTIFIED + "; the head scales embeddings by sqrt(n_embd); sliding-window pattern written per layer",
            head_scale="sqrt_n_embd",
            swa_period=6,
            unsplittable_layer_counts={62: "llama.cpp picks the 27B's attention scale by the layer count (62)"},
        ),
        Family("phi3", True, False, _CERTIFIED),
        Family("qwen2moe", True, False, _CERTIFIED),
        Family(
            "qwen3next",
            True,
            False,
            _CERTIFIED + "; hybrid: each range holds linear- and full-attention layers; a rewind restores the "
            "recurrent state saved before the last chunk",
            recurrent=True,
        ),
        Family(
            "qwen35moe",
            True,
            True,
            _CERTIFIED + "; hybrid as qwen3next; placeholder token rows replaced by the hidden state (llama.cpp "
            "gives embeddings input multimodal rope positions). PyTorch route: token-identical over node processes "
            "(tests/integration/test_torch_seed_routes.py)",
            token_seam=True,
            input_name="model.input_embed",
            recurrent=True,
            hf_types=("qwen3_5_moe_text", "qwen3_5_moe"),
        ),
        Family("mistral3", True, False, _CERTIFIED + " (Ministral 3: yarn rope with attention temperature)"),
        Family(
            "deepseek2",
            True,
            False,
            _CERTIFIED + "; MLA; the count of leading dense layers is made relative to each range",
            leading_layer_keys=_DENSE_LEAD,
            # llama.cpp tells the lite variants (no q_lora) by the file's layer count
            unsplittable_layer_counts={
                n: f"llama.cpp reads a {n}-layer DeepSeek-V2 as a lite one (DeepSeek-V2-Lite, GigaChat3: no query "
                "compression) by its layer count, and a shard of other length as the full layout"
                for n in (26, 27)
            },
        ),
        Family(
            "glm-dsa",
            True,
            True,
            _CERTIFIED + " (GLM-5.x: MLA + DSA lightning indexer); a range starts only at a layer that computes its "
            "own top-k selection, so no selection crosses a seam; dense-lead count relative. PyTorch route: "
            "token-identical over node processes (tests/integration/test_torch_seed_routes.py)",
            leading_layer_keys=_DENSE_LEAD,
            start_flags="attention.indexer.types",
            hf_types=("glm_moe_dsa",),
        ),
        Family(
            "glm4",
            True,
            False,
            _CERTIFIED + "; past the head the hidden state replaces placeholder token rows (llama.cpp refuses "
            "embeddings input for this family)",
            token_seam=True,
        ),
        Family(
            "glm4moe",
            True,
            False,
            _CERTIFIED + "; past the head the hidden state replaces placeholder token rows (llama.cpp refuses "
            "embeddings input for this family); multi-token-prediction blocks are not routed",
            token_seam=True,
            leading_layer_keys=_DENSE_LEAD,
        ),
        Family(
            "deepseek4",
            True,
            True,
            _CERTIFIED + " (DeepSeek-V4: hc_mult residual streams cross each seam; placeholder token rows replaced "
            "by them; the hash-routed layers, which read token ids, stay on the head; every range holds a CSA and an "
            "HCA layer; rewinds reach 8 positions back (llama.cpp's compressor-state snapshots). PyTorch route: "
            "token-identical over node processes, the token ids travelling beside the [hc_mult, hidden] seam "
            "(tests/integration/test_torch_seed_routes.py)",
            token_seam=True,
            input_name="hc_init",
            layer_output="l_last",
            rows_after_layers=True,
            streams="hyper_connection.count",
            token_layers="hash_layer_count",
            leading_layer_keys=("hash_layer_count",),
            range_kinds=("attention.compress_ratios", (4, 128)),
            rollback=8,
            hf_types=("deepseek_v4",),
        ),
        Family(
            "smollm3",
            True,
            False,
            _CERTIFIED + "; every 4th layer skips rope, picked by the index inside the file: ranges start at a "
            "multiple of 4",
            cut_multiple=4,
        ),
        # Families whose graph needs nothing at a seam.
        *(
            Family(arch, True, False, _CERTIFIED + note)
            for arch, note in (
                ("stablelm", ""),
                ("starcoder2", ""),
                ("olmo", ""),
                ("olmoe", ""),
                ("arcee", ""),
                ("seed_oss", ""),
                ("hunyuan-dense", ""),
                ("hy_v3", " (Hunyuan 3 MoE)"),
                ("falcon", " (new decoder architecture: parallel attention and MLP)"),
                ("chatglm", " (GLM-4 9B, transformers' GlmForCausalLM)"),
                ("jais2", ""),
                ("ernie4_5", ""),
                ("nemotron", ""),
                ("command-r", " (Cohere Command-R: parallel attention and MLP, logit scale)"),
                ("gptneox", " (parallel residual, partial rotary)"),
                ("phi2", " (a head's cut lm_head bias keeps one row, as its weight)"),
                ("minimax-m2", " (sigmoid expert routing)"),
            )
        ),
        Family(
            "apertus",
            True,
            False,
            _CERTIFIED + "; its xIELU activation parameters are per-layer arrays outside the architecture's keys, "
            "sliced with the layers",
            layer_key_prefixes=("xielu.",),
        ),
        Family(
            "mellum",
            True,
            False,
            _CERTIFIED + "; sliding-window pattern stored per layer in the file, sliced with the layers; a range "
            "without sliding layers turns sliding off",
            swa_period=4,
        ),
        Family(
            "granitemoe",
            True,
            False,
            _CERTIFIED + "; every shard's input is multiplied by the embedding scale, undone past the head",
            rescaled_input="embd",
        ),
        Family(
            "granite_swa",
            True,
            False,
            _CERTIFIED + "; input scale undone past the head as granite; sliding-window pattern per layer",
            rescaled_input="embd",
            swa_period=4,
            swa_empty="unbounded",
        ),
        Family(
            "gpt2",
            True,
            False,
            _CERTIFIED + "; learned position embeddings are added to every shard's input: past the head the sum "
            "is overwritten by the hidden state, so they are added once",
            rescaled_input="inpL",
        ),
        Family(
            "starcoder",
            True,
            False,
            _CERTIFIED + " (GPT-BigCode); learned position embeddings added once, as gpt2",
            rescaled_input="inpL",
        ),
        Family(
            "bloom",
            True,
            False,
            _CERTIFIED + "; the graph normalizes every shard's input (the embedding norm): past the head the "
            "normalized input is overwritten by the hidden state",
            rescaled_input="inp_norm-0",
        ),
        Family(
            "gpt-oss",
            True,
            False,
            _CERTIFIED + "; sliding windows on every other layer, written out per layer; a range with none "
            "slides with a window that masks nothing",
            swa_period=2,
            swa_empty="unbounded",
        ),
        Family(
            "cohere2",
            True,
            False,
            _CERTIFIED + "; sliding windows on 3 layers of 4, written out per layer; a range of full-attention "
            "layers only is refused (they skip rope: no window setting makes them sliding layers)",
            swa_period=4,
            swa_empty="refuse",
        ),
        Family(
            "cohere2moe",
            True,
            False,
            _CERTIFIED + "; sliding-window pattern and its rule as cohere2 (without a pattern in the file, "
            "llama.cpp puts full attention first)",
            swa_period=4,
            swa_dense_first=True,
            swa_empty="refuse",
        ),
        Family(
            "exaone-moe",
            True,
            False,
            _CERTIFIED + "; leading dense-layer count relative to each range; sliding windows on 3 layers of 4, "
            "a range of full-attention layers only refused",
            leading_layer_keys=_DENSE_LEAD,
            swa_period=4,
            swa_empty="refuse",
        ),
        Family(
            "afmoe",
            True,
            False,
            _CERTIFIED + " (Arcee AFM MoE); every shard's input is scaled by sqrt(n_embd) (muP), undone past the head; "
            "every 4th layer skips rope, picked by the index inside the file: ranges start at a multiple of 4; "
            "sliding windows on the others; leading dense-layer count relative",
            rescaled_input="inp_embd_scaled",
            cut_multiple=4,
            swa_period=4,
            leading_layer_keys=_DENSE_LEAD,
        ),
        Family(
            "llama4",
            True,
            False,
            _CERTIFIED + " (Llama 4 text); every 4th layer skips rope and is global, picked by the index inside "
            "the file: ranges start at a multiple of 4 and each holds such a layer (llama.cpp aborts without one)",
            cut_multiple=4,
            rope_free_every=4,
        ),
        Family(
            "exaone4",
            True,
            False,
            _CERTIFIED + " (EXAONE 4.0 1.2B's graph); llama.cpp gives the 32B sliding windows by its layer count "
            "(64), which a shard would lose: cutting a 64-layer model is refused",
            unsplittable_layer_counts={64: "llama.cpp gives EXAONE 4 sliding windows by the layer count (64)"},
        ),
        *(
            Family(
                arch,
                True,
                False,
                _CERTIFIED + "; the count of leading dense layers is made relative to each range",
                leading_layer_keys=_DENSE_LEAD,
            )
            for arch in ("dots1", "ernie4_5-moe")
        ),
        Family(
            "qwen35",
            True,
            False,
            _CERTIFIED + " (Qwen3.5 dense); hybrid and token rows as qwen35moe",
            token_seam=True,
            input_name="model.input_embed",
            recurrent=True,
            hf_types=("qwen3_5_text", "qwen3_5"),
        ),
        *(
            Family(
                arch,
                True,
                False,
                _CERTIFIED + f"; {what}: a rewind restores the state saved before the last chunk",
                recurrent=True,
                recurrent_by=rule,
            )
            for arch, rule, what in (
                ("mamba", "all", "a state-space model (every layer recurrent, no KV)"),
                ("mamba2", "all", "a state-space model (every layer recurrent, no KV)"),
                ("falcon-h1", "parallel", "Mamba-2 heads beside attention in every layer"),
                ("lfm2", "kv_heads", "hybrid short convolutions and attention; each range holds both"),
                ("jamba", "kv_heads", "hybrid Mamba and attention; each range holds both"),
                ("granitehybrid", "kv_heads", "hybrid Mamba-2 and attention (Granite 4, Bamba); each range holds both"),
            )
        ),
        Family(
            "lfm2moe",
            True,
            False,
            _CERTIFIED + "; hybrid short convolutions and attention, each range holds both; a rewind restores the "
            "state saved before the last chunk; leading dense-layer count relative",
            recurrent=True,
            recurrent_by="kv_heads",
            leading_layer_keys=_DENSE_LEAD,
        ),
        Family(
            "nemotron_h_moe",
            True,
            False,
            _CERTIFIED + " (Nemotron-H MoE); Mamba-2, attention and MoE layers: each range holds a Mamba-2 and an "
            "attention layer; a layer's output is the graph's block output",
            recurrent=True,
            recurrent_by="kv_heads_and_ff",
            layer_output="nemotron_h_block_out",
        ),
        Family(
            "exaone",
            False,
            False,
            "refused: transformers has no EXAONE 3 model class to build the tiny certification model from",
        ),
        *(Family(arch, False, False, "refused: " + why) for arch, why in _REFUSED.items()),
    )
}
# The architectures a manifest may name: the table above, never a hand-kept list elsewhere.
KNOWN_ARCHITECTURES: tuple[str, ...] = tuple(FAMILIES)


class UncertifiedArchitecture(InvalidRequest):
    code = "uncertified_architecture"


def installed_llama_cpp() -> str | None:
    """The installed llama-cpp-python release (None when it is not installed)."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def certification(arch: str, backend: str = "llama") -> tuple[bool, str]:
    """``(certified, why)`` for ``arch`` on ``backend`` ("llama" or "torch")."""
    record = family(arch)
    return (record.llama_route if backend == "llama" else record.torch_route), record.why


def require_certified(arch: str, *, backend: str = "llama", allow_uncertified: bool = False) -> str | None:
    """Raise ``UncertifiedArchitecture`` unless ``arch`` is certified on ``backend``'s route; with
    ``allow_uncertified`` return the warning to show instead (None when certified)."""
    certified, why = certification(arch, backend)
    installed = installed_llama_cpp() if backend == "llama" else None
    if certified and installed not in (None, LLAMA_CERTIFIED_ON):
        # the graphs, and the struct layouts a shard reads, are those of one llama.cpp commit
        certified = False
        why = (
            f"certified on llama-cpp-python {LLAMA_CERTIFIED_ON}, and this is {installed}: run `make certify` "
            "on it, or install llama-cpp-python==" + LLAMA_CERTIFIED_ON
        )
    if certified:
        return None
    message = (
        f"architecture {arch!r} is not certified for a layer-split route on the {backend} backend ({why}); "
        "a split route could produce wrong text without any error. See docs/models.md; pass "
        "--allow-uncertified to run it anyway"
    )
    if not allow_uncertified:
        raise UncertifiedArchitecture(message, param="architecture")
    return message.removesuffix("; pass --allow-uncertified to run it anyway") + " (running it: --allow-uncertified)"


def family(arch: str) -> Family:
    """The family record of ``arch`` (a GGUF architecture, or a transformers ``model_type`` a PyTorch
    node names); an unknown architecture gets one with no seam handling (it is refused unless the
    operator allows uncertified architectures)."""
    known = FAMILIES.get(arch) or FAMILIES.get(family_of_model_type(arch))
    return known or Family(arch, False, False, f"architecture {arch!r} has never been checked")


def family_of_model_type(model_type: str) -> str:
    """The GGUF architecture name of a transformers ``model_type`` (itself when the table has none)."""
    return next((f.arch for f in FAMILIES.values() if model_type in f.hf_types), model_type)
