"""Write a llama.cpp-loadable GGUF holding one layer range of a full GGUF (gguf-py, no llama.cpp).

The recipe (docs/backends.md; verified on llama-cpp-python 0.3.36):

- copy every metadata key, set ``{arch}.block_count`` to the range's length and slice per-layer
  arrays (``{arch}.*`` arrays with one entry per block) to the range;
- keep ``blk.{i}.*`` for ``i`` in the range, renamed ``blk.{i - start}.*``; a model's multi-token
  prediction blocks (``{arch}.nextn_predict_layers``, stored after the trunk) are not part of any
  route: shards drop them and say ``nextn_predict_layers = 0``;
- apply the family's seam handling (``meshnet.models.families``): write a sliding-window pattern
  that llama.cpp would derive from the layer index out per layer before slicing it, make counts of
  leading layers relative to the range, refuse models whose hyperparameters llama.cpp picks by
  layer count;
- keep the non-block tensors the loader requires (``token_embd``, ``output_norm``) and the ones
  every block needs (``rope_freqs`` — Llama 3.x silently loses its rope factors without it);
- a non-tail shard never needs logits: its vocabulary is cut to one dummy token
  (``tokenizer.ggml.model = "no_vocab"``, ``vocab_size`` 1) and ``token_embd`` / ``output`` to
  one row, so the lm_head llama.cpp runs on every output row costs nothing;
- the head's real embedding table goes to a small sidecar GGUF (``*.embd.gguf``): the head looks
  embeddings up itself (``gguf.quants.dequantize`` matches llama.cpp exactly) and feeds them in
  as hidden states.

Adjacent shard files merge into one (``merge_shards``): blocks renumbered, per-layer arrays
concatenated, everything else from the last part (the tail's vocabulary if it is one).

The source may be a llama.cpp split set (``meshnet.artifacts.gguf_source``): every part is read,
and tensor bytes are streamed from the parts with bounded reads, never mapped or held whole, so
cutting a model costs a few MiB of memory whatever its size. Writes are atomic: a temporary file
is renamed into place only when complete.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from meshnet.artifacts.gguf_header import read_header
from meshnet.artifacts.gguf_source import GGUFSource, TensorBytes, open_gguf
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange
from meshnet.models.families import Family, family

__all__ = [
    "SHARD_START_KEY",
    "ShardFiles",
    "embeddings_path",
    "hybrid_layers",
    "layer_flags",
    "layer_values",
    "merge_shards",
    "range_starts",
    "read_architecture",
    "read_shard_range",
    "trunk_layers",
    "write_shard",
]

SHARD_START_KEY = "meshnet.shard.start"
SHARD_STOP_KEY = "meshnet.shard.stop"
SHARD_TOTAL_KEY = "meshnet.shard.total"
SHARD_VOCAB_CUT_KEY = "meshnet.shard.vocab_cut"

# Non-block tensors every shard keeps whole (besides token_embd/output_norm, handled apart).
_KEEP_WHOLE = ("rope_freqs.weight",)
_VOCAB_ONLY_KEYS = ("tokenizer.ggml.model",)


@dataclass(frozen=True, slots=True)
class ShardFiles:
    path: Path
    embeddings: Path | None  # the head's embedding table (None unless the shard is a cut-vocab head)
    layers: LayerRange
    vocab_cut: bool
    tensor_bytes: int  # bytes of tensor data in ``path``
    tensors: int


def read_architecture(path: Path) -> str:
    """A GGUF's ``general.architecture`` (a split set's: its first file holds the metadata);
    ``InvalidRequest`` for a file that is not a GGUF."""
    if not path.is_file():
        raise InvalidRequest(f"GGUF file not found: {path}", param="gguf")
    try:
        return str(_field_value(read_header(path).fields["general.architecture"]))
    except KeyError as exc:
        raise InvalidRequest(f"cannot read the architecture of {path}: {exc}", param="gguf") from None


def trunk_layers(fields: Any, arch: str) -> int:
    """Layers a route runs: ``{arch}.block_count`` less the multi-token-prediction blocks stored after
    the trunk (``{arch}.nextn_predict_layers``). ``fields``: a GGUF reader's fields, or a function
    from a metadata key to its value (None when absent)."""
    get = fields if callable(fields) else (lambda key: _field_value(fields[key]) if key in fields else None)
    total = int(get(f"{arch}.block_count") or 0)
    return total - int(get(f"{arch}.nextn_predict_layers") or 0)


def _layer_array(fields: Any, key: str, n_layer: int, default: int) -> list[int]:
    """A per-layer integer metadata value, stored as an array or as one number for every layer."""
    if key not in fields:
        return [default] * n_layer
    value = _field_value(fields[key])
    return [int(v) for v in value][:n_layer] if isinstance(value, list) else [int(value)] * n_layer


def _hybrid_flags(fields: Any, arch: str, n_layer: int) -> tuple[list[bool], list[bool]]:
    """``(recurrent, attention)`` per layer, by the family's ``recurrent_by`` rule, as llama.cpp
    derives them: which layers keep a recurrent state, which keep KV (a layer may do both, or
    neither: an MLP-only layer)."""
    rule = family(arch).recurrent_by
    if rule in ("all", "parallel"):
        return [True] * n_layer, [rule == "parallel"] * n_layer
    if rule in ("kv_heads", "kv_heads_and_ff"):
        heads = _layer_array(fields, f"{arch}.attention.head_count_kv", n_layer, 0)
        ffn = _layer_array(fields, f"{arch}.feed_forward_length", n_layer, 0)
        attention = [h > 0 for h in heads]
        if rule == "kv_heads":
            return [not a for a in attention], attention
        return [h == 0 and f == 0 for h, f in zip(heads, ffn, strict=True)], attention
    key = f"{arch}.attention.recurrent_layers"
    if key in fields:
        recurrent = [bool(v) for v in _field_value(fields[key])][:n_layer]
    else:  # every layer but each full_attention_interval-th (4 unless stated)
        interval_key = f"{arch}.full_attention_interval"
        interval = int(_field_value(fields[interval_key])) if interval_key in fields else 4
        recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
    return recurrent, [not r for r in recurrent]


def _split_kinds(recurrent: list[bool], attention: list[bool]) -> bool:
    """Whether the model's layers are of two kinds that llama.cpp keeps in two memories (recurrent
    states and KV): then every range must hold both, or llama.cpp aborts on the empty one."""
    return any(recurrent) and any(attention) and recurrent != attention


def range_starts(path: Path) -> list[int]:
    """Layers at which a range of this GGUF's model may start, by its family's rules (every layer
    when the family has none): a multiple of its cut step, a layer that computes its own sparse
    selection, and for a hybrid model a layer right after a full-attention one (so that every
    range ends with attention and, cut on the pattern, holds both kinds)."""

    return range_starts_of(read_header(path).fields)


def range_starts_of(fields: Any) -> list[int]:
    """``range_starts`` of a GGUF already open (its reader's fields)."""
    arch = str(_field_value(fields["general.architecture"]))
    total, seams = trunk_layers(fields, arch), family(arch)
    starts = [s for s in range(total) if s % seams.cut_multiple == 0]
    flags = _start_flags(fields, arch, seams, total)
    if flags is not None:
        starts = [s for s in starts if flags[s]]
    if seams.recurrent:
        recurrent, attention = _hybrid_flags(fields, arch, total)
        if _split_kinds(recurrent, attention):
            starts = [s for s in starts if s == 0 or attention[s - 1]]
    token_layers = _token_layers(fields, arch, seams)
    starts = [s for s in starts if s == 0 or s >= token_layers]
    if seams.rope_free_every:  # the last range, from s to the end, must hold a rope-free layer too
        starts = [s for s in starts if s == 0 or _rope_free(seams, s, total)]
    kinds = _layer_kinds(fields, arch, seams, total)
    if kinds is not None:
        wanted = set(kinds[1])
        starts = [
            s for s in starts if s == 0 or (wanted <= set(kinds[0][s - 2 : s]) and wanted <= set(kinds[0][s : s + 2]))
        ]
    return starts


def _layer_kinds(fields: Any, arch: str, seams: Family, total: int) -> tuple[list[int], tuple[int, ...]] | None:
    """Each layer's kind by the family's ``range_kinds`` array, and the kinds every range must hold
    (None when the family has no such rule)."""
    if seams.range_kinds is None:
        return None
    name, wanted = seams.range_kinds
    key = f"{arch}.{name}"
    if key not in fields:
        raise InvalidRequest(f"this {arch} GGUF has no {key}; cannot tell where it may be cut")
    return [int(v) for v in _field_value(fields[key])][:total], wanted


def _rope_free(seams: Family, start: int, stop: int) -> bool:
    """Whether layers ``start:stop`` hold one of the family's rope-free layers."""
    step = seams.rope_free_every
    return any((i + 1) % step == 0 for i in range(start, stop))


def _token_layers(fields: Any, arch: str, seams: Family) -> int:
    """How many leading layers read token ids inside them (``Family.token_layers``); 0 for none."""
    key = f"{arch}.{seams.token_layers}" if seams.token_layers else None
    return int(_field_value(fields[key])) if key is not None and key in fields else 0


# llama.cpp gives a GLM-5.x GGUF without per-layer indexer types its GLM-5.2 sharing pattern when
# the model's context is at least this long, and a full indexer on every layer otherwise.
_SHARED_INDEXER_CONTEXT = 1 << 20


def _start_flags(fields: Any, arch: str, seams: Family, total: int) -> list[bool] | None:
    """Per layer, whether a range may open there by the family's ``start_flags`` (None: no such rule).
    A GGUF that does not store the flags gets what llama.cpp assumes: every layer when its context is
    short; when llama.cpp would apply a built-in pattern we do not reproduce, no cut at all."""
    if not seams.start_flags:
        return None
    key = f"{arch}.{seams.start_flags}"
    if key in fields:
        return [bool(v) for v in _field_value(fields[key])][:total]
    context_key = f"{arch}.context_length"
    context = int(_field_value(fields[context_key])) if context_key in fields else 0
    return [True] * total if context < _SHARED_INDEXER_CONTEXT else [True] + [False] * (total - 1)


def layer_flags(path: Path, key: str, n_layer: int, *, default: bool) -> list[bool]:
    """A per-layer boolean array of a GGUF's metadata; ``default`` for every layer when absent."""
    return [bool(v) for v in layer_values(path, key, n_layer, default=int(default))]


def layer_values(path: Path, key: str, n_layer: int, *, default: int) -> list[int]:
    """A per-layer integer array of a GGUF's metadata (one number stands for every layer);
    ``default`` for every layer when absent."""

    return _layer_array(read_header(path).fields, key, n_layer, default)


def hybrid_layers(path: Path, arch: str, n_layer: int) -> tuple[list[bool], list[bool]]:
    """``(recurrent, attention)`` flags per layer of a GGUF (a full model or a shard file) of a
    family with recurrent layers."""

    return _hybrid_flags(read_header(path).fields, arch, n_layer)


def embeddings_path(shard_path: Path) -> Path:
    return shard_path.with_name(shard_path.name.removesuffix(".gguf") + ".embd.gguf")


def _field_value(field: Any) -> Any:
    return field.contents()


def _block_index(name: str) -> int | None:
    if not name.startswith("blk."):
        return None
    return int(name.split(".", 2)[1])


def _refuse_a_bad_range(fields: Any, arch: str, seams: Family, layers: LayerRange, total: int) -> None:
    """Raise ``InvalidRequest``, saying what to change, unless ``layers`` is a range the family's
    rules allow (``range_starts`` lists where ranges may open)."""
    if layers.start % seams.cut_multiple:
        raise InvalidRequest(
            f"{arch} picks a per-layer behaviour by the layer index modulo {seams.cut_multiple}, so a range "
            f"must start at a multiple of {seams.cut_multiple} (not {layers.start})",
            param="layers",
        )
    if seams.rope_free_every and not _rope_free(seams, layers.start, layers.stop):
        raise InvalidRequest(
            f"layers {layers} of this {arch} model hold none of its rope-free layers (every "
            f"{seams.rope_free_every}th), and llama.cpp aborts on a graph without one. Ranges may start at layers "
            f"{range_starts_of(fields)}",
            param="layers",
        )
    flags = _start_flags(fields, arch, seams, total)
    if flags is not None and layers.start > 0 and not flags[layers.start]:
        raise InvalidRequest(
            f"layer {layers.start} of this {arch} model cannot open a range: it does not compute its own "
            f"{seams.start_flags} selection but reuses the previous layer's, which would have to cross the seam. "
            f"Ranges may start at layers {[i for i, f in enumerate(flags) if f]}",
            param="layers",
        )
    token_layers = _token_layers(fields, arch, seams)
    if 0 < layers.start < token_layers:
        raise InvalidRequest(
            f"layer {layers.start} of this {arch} model cannot open a range: its first {token_layers} layers read "
            "token ids from vocabulary-wide tables (hash-routed experts), so they stay on the head. Ranges past "
            f"the head start at layer {token_layers} or later",
            param="layers",
        )
    by_kind = _layer_kinds(fields, arch, seams, total)
    if by_kind is not None and seams.range_kinds is not None and len(layers) != total:
        missing = sorted(set(by_kind[1]) - set(by_kind[0][layers.start : layers.stop]))
        if missing:
            raise InvalidRequest(
                f"layers {layers} of this {arch} model hold no layer with {seams.range_kinds[0]} = {missing}; "
                f"llama.cpp needs every range to hold each of {list(by_kind[1])} (it crashes on an empty cache). "
                f"Ranges may start at layers {range_starts_of(fields)}",
                param="layers",
            )
    if seams.recurrent and len(layers) != total:
        recurrent, attention = _hybrid_flags(fields, arch, total)
        if _split_kinds(recurrent, attention):
            span = slice(layers.start, layers.stop)
            absent = "an attention" if not any(attention[span]) else "a recurrent" if not any(recurrent[span]) else ""
            if absent:
                allowed = range_starts_of(fields)
                raise InvalidRequest(
                    f"layers {layers} of this {arch} model hold no {absent} layer; llama.cpp needs a range of a "
                    "hybrid model to hold layers of both kinds (its memory for the missing kind would be empty). "
                    f"Move the cut so the range includes both: ranges may start at layers {allowed}",
                    param="layers",
                )
    unsplittable = seams.unsplittable_layer_counts.get(total)
    if unsplittable and len(layers) != total:
        raise InvalidRequest(
            f"a {total}-layer {arch} model cannot be split: {unsplittable}, so a shard with fewer layers "
            f"would compute another model. Serve it whole on one node (--layers 0:{total})",
            param="layers",
        )


def write_shard(
    source: Path,
    layers: LayerRange | str,
    out: Path,
    *,
    cut_vocab: bool | None = None,
    opened: GGUFSource | None = None,
) -> ShardFiles:
    """Write the shard GGUF for ``layers`` of ``source`` (a GGUF or a split set's first file) to
    ``out`` (and the head's sidecar).

    ``opened``: ``open_gguf(source)`` already done (parsing a big vocabulary takes seconds; a
    caller cutting several ranges parses once).
    """
    reader = opened if opened is not None else open_gguf(source)
    arch = str(_field_value(reader.fields["general.architecture"]))
    total = trunk_layers(reader.fields, arch)
    if isinstance(layers, str):
        try:
            layers = LayerRange.parse(layers, total)
        except ValueError as exc:
            raise InvalidRequest(f"{exc} (the model has {total} layers)", param="layers") from None
    elif layers.total != total:
        raise InvalidRequest(f"the layer range assumes {layers.total} layers but {source.name} has {total}")
    if SHARD_START_KEY in reader.fields:
        raise InvalidRequest(f"{source} is already a shard; cut shards from the full model GGUF")
    seams = family(arch)
    _refuse_a_bad_range(reader.fields, arch, seams, layers, total)
    token_layers = _token_layers(reader.fields, arch, seams)
    # A head whose layers read token ids runs on them, with its vocabulary (Family.token_layers).
    keeps_vocab = layers.is_tail or (layers.is_head and token_layers > 0)
    cut = (not keeps_vocab) if cut_vocab is None else cut_vocab
    if cut and keeps_vocab:
        why = "computes logits" if layers.is_tail else f"runs on token ids (its first {token_layers} layers read them)"
        raise InvalidRequest(f"the {'tail' if layers.is_tail else 'head'} shard {why} and must keep its vocabulary")

    tensors = list(_shard_tensors(reader.tensors, layers, cut))
    _write_gguf(
        out,
        arch,
        lambda writer: _copy_metadata(reader, writer, arch=arch, layers=layers, total=total, cut=cut),
        tensors,
        reader.endianess,
    )

    sidecar = None
    if cut and layers.is_head:
        sidecar = embeddings_path(out)
        _write_embeddings(reader, arch, sidecar)
    return ShardFiles(
        path=out,
        embeddings=sidecar,
        layers=layers,
        vocab_cut=cut,
        tensor_bytes=sum(t.nbytes for _, t in tensors),
        tensors=len(tensors),
    )


def _shard_tensors(source: tuple[TensorBytes, ...], layers: LayerRange, cut: bool) -> Iterator[tuple[str, TensorBytes]]:
    for tensor in source:
        name = tensor.name
        block = _block_index(name)
        if block is not None:
            if layers.start <= block < layers.stop:  # never a prediction block: stop <= trunk
                rest = name.split(".", 2)[2]
                yield f"blk.{block - layers.start}.{rest}", tensor
            continue
        if cut and name in ("token_embd.weight", "output.weight", "output.bias"):
            # One row: the loader requires the tensor; llama.cpp's lm_head then costs nothing.
            yield name, tensor.first_rows(1)
            continue
        # output_norm (required by the loader), rope_freqs (needed by every block), and any other
        # model-wide tensor: kept whole; they are small.
        yield name, tensor


def _copy_metadata(reader: Any, writer: Any, *, arch: str, layers: LayerRange, total: int, cut: bool) -> None:
    import gguf

    seams = family(arch)
    relative = {f"{arch}.{key}" for key in seams.leading_layer_keys}
    swa_key, window_key = f"{arch}.attention.sliding_window_pattern", f"{arch}.attention.sliding_window"
    swa = _swa_pattern(reader.fields, swa_key, seams, total)
    window: int | None = None  # a new sliding window, for a range without sliding-window layers
    if swa is not None:
        swa = swa[layers.start : layers.stop]
        if not any(swa):
            window, swa = _no_sliding_layer(reader.fields, arch, seams, len(swa))
    blocks = int(_field_value(reader.fields[f"{arch}.block_count"]))  # trunk + prediction blocks
    for field in reader.fields.values():
        name: str = field.name
        if name.startswith(("GGUF.", "split.")) or name == "general.architecture":
            continue  # written by GGUFWriter itself; a shard is one file, never part of a split set
        if cut and name.startswith("tokenizer.") and name not in _VOCAB_ONLY_KEYS:
            continue
        value = _field_value(field)
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        if name == swa_key and swa is not None:
            continue  # written per layer below
        if name == window_key and window is not None:
            value = window
        if name == f"{arch}.block_count":
            value = len(layers)
        elif name == f"{arch}.nextn_predict_layers":
            value = 0
        elif name in relative:
            value = max(0, min(len(layers), int(value) - layers.start))
        elif name == f"{arch}.vocab_size" and cut:
            value = 1
        elif name == "tokenizer.ggml.model" and cut:
            value = "no_vocab"
        elif _per_layer_key(name, arch) and isinstance(value, list) and len(value) in (total, blocks):
            value = value[layers.start : layers.stop]  # a per-layer array (e.g. head counts per block)
        writer.add_key_value(name, value, val_type, sub_type=sub_type)
    if swa is not None:
        writer.add_array(swa_key, swa)
    if window is not None and window_key not in reader.fields:
        writer.add_uint32(window_key, window)
    if cut and f"{arch}.vocab_size" not in reader.fields:
        writer.add_uint32(f"{arch}.vocab_size", 1)
    if cut and "tokenizer.ggml.model" not in reader.fields:
        writer.add_string("tokenizer.ggml.model", "no_vocab")
    writer.add_uint32(SHARD_START_KEY, layers.start)
    writer.add_uint32(SHARD_STOP_KEY, layers.stop)
    writer.add_uint32(SHARD_TOTAL_KEY, layers.total)
    writer.add_bool(SHARD_VOCAB_CUT_KEY, cut)


def _per_layer_key(name: str, arch: str) -> bool:
    """Whether metadata ``name`` may be a per-layer array: the architecture's own keys, and those
    its family names outside them (``Family.layer_key_prefixes``)."""
    return name.startswith((f"{arch}.", *family(arch).layer_key_prefixes))


def _swa_pattern(fields: Any, key: str, seams: Family, total: int) -> list[bool] | None:
    """The whole model's sliding-window layers, as llama.cpp derives them (``set_swa_pattern``),
    for a family whose pattern depends on the layer index; None when there is nothing to rewrite."""
    if seams.swa_period is None:
        return None
    stored = _field_value(fields[key]) if key in fields else None
    if isinstance(stored, list):
        return [bool(v) for v in stored][:total]
    period = seams.swa_period if stored is None else int(stored)
    if seams.swa_dense_first:
        return [period == 0 or il % period != 0 for il in range(total)]
    return [period == 0 or il % period < period - 1 for il in range(total)]


# A window no sequence reaches: a sliding-window layer with it masks nothing.
UNBOUNDED_WINDOW = 1 << 30


def _no_sliding_layer(fields: Any, arch: str, seams: Family, n: int) -> tuple[int, list[bool]]:
    """``(sliding window, pattern)`` for a range none of whose layers slides. Some families' graphs
    then turn sliding windows off (window 0); others insist on at least one sliding layer, so every
    layer is declared sliding with a window that masks nothing — exact only where sliding layers
    differ from full ones by the mask alone (the same rope base)."""
    if seams.swa_empty == "disable":
        return 0, [False] * n
    if seams.swa_empty == "refuse":
        raise InvalidRequest(
            f"this {arch} model's full-attention layers differ from its sliding-window layers by more than the "
            "window (they skip rope), and llama.cpp cannot load a range without a sliding-window layer; choose a "
            "range that includes one",
            param="layers",
        )
    base, swa_base = (fields.get(f"{arch}.rope.{k}") for k in ("freq_base", "freq_base_swa"))
    if swa_base is not None and (base is None or _field_value(swa_base) != _field_value(base)):
        raise InvalidRequest(
            f"this {arch} model gives sliding-window layers their own rope base, so a range holding only "
            "full-attention layers cannot be loaded by llama.cpp; choose a range that includes a sliding-window "
            "layer",
            param="layers",
        )
    return UNBOUNDED_WINDOW, [True] * n


def _write_embeddings(source: GGUFSource, arch: str, path: Path) -> None:
    tensor = source.tensor("token_embd.weight")
    if tensor is None:
        raise InvalidRequest("the model has no token_embd.weight; cannot build a head shard")
    _write_gguf(path, arch, lambda writer: None, [(tensor.name, tensor)], source.endianess)


def read_shard_range(path: Path) -> tuple[LayerRange, bool] | None:
    """The layer range and vocab-cut flag a shard file was written for (None for a full model)."""

    fields = read_header(path).fields
    if SHARD_START_KEY not in fields:
        return None
    start, stop, total = (int(_field_value(fields[k])) for k in (SHARD_START_KEY, SHARD_STOP_KEY, SHARD_TOTAL_KEY))
    return LayerRange(start, stop, total), bool(_field_value(fields[SHARD_VOCAB_CUT_KEY]))


def merge_shards(parts: list[Path], out: Path) -> ShardFiles:
    """Write one shard GGUF holding the adjacent ranges of ``parts`` (shard files, in layer order).

    Metadata and non-block tensors come from the last part: if it is the tail, the merged shard
    keeps its full vocabulary; otherwise the vocabulary stays cut and the head (if the first part is
    one) keeps using its ``*.embd.gguf`` sidecar — unless the first part is a head that kept its
    vocabulary (it runs on token ids), whose vocabulary the merged shard keeps.
    """
    import gguf

    if not parts:
        raise InvalidRequest("nothing to merge")
    readers = sources = [open_gguf(p) for p in parts]
    ranges: list[LayerRange] = []
    for path, reader in zip(parts, readers, strict=True):
        if SHARD_START_KEY not in reader.fields:
            raise InvalidRequest(f"{path} is not a shard file")
        start, stop, total = (
            int(_field_value(reader.fields[k])) for k in (SHARD_START_KEY, SHARD_STOP_KEY, SHARD_TOTAL_KEY)
        )
        if ranges and (ranges[-1].stop != start or ranges[-1].total != total):
            raise InvalidRequest(f"{path} (layers {start}:{stop}) does not continue layers {ranges[-1]}")
        ranges.append(LayerRange(start, stop, total))
    layers = LayerRange(ranges[0].start, ranges[-1].stop, ranges[0].total)
    # The part whose vocabulary the merged shard keeps: the tail's, else a head's that runs on
    # token ids (Family.token_layers), else the last part's (cut).
    kept = [not _field_value(r.fields[SHARD_VOCAB_CUT_KEY]) for r in readers]
    last = readers[-1] if kept[-1] or not (kept[0] and ranges[0].is_head) else readers[0]
    arch = str(_field_value(last.fields["general.architecture"]))
    cut = bool(_field_value(last.fields[SHARD_VOCAB_CUT_KEY]))
    tensors: list[tuple[str, TensorBytes]] = []
    for part, source in zip(ranges, sources, strict=True):
        offset = part.start - layers.start
        for tensor in source.tensors:
            block = _block_index(tensor.name)
            if block is not None:
                rest = tensor.name.split(".", 2)[2]
                tensors.append((f"blk.{block + offset}.{rest}", tensor))
    tensors += [(t.name, t) for t in last.tensors if _block_index(t.name) is None]

    relative = {f"{arch}.{key}" for key in family(arch).leading_layer_keys}
    window_key = f"{arch}.attention.sliding_window"
    windows = {int(_field_value(r.fields[window_key])) for r in readers if window_key in r.fields}
    if len(windows) > 1:  # a range without sliding layers got its own window (_no_sliding_layer)
        raise InvalidRequest(
            f"{', '.join(p.name for p in parts)} were cut with different sliding windows {sorted(windows)}; "
            "cut the merged range from the full model GGUF instead"
        )

    def metadata(writer: Any) -> None:
        for field in last.fields.values():
            name: str = field.name
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            value = _field_value(field)
            val_type = field.types[0]
            sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
            if name == f"{arch}.block_count":
                value = len(layers)
            elif name in (SHARD_START_KEY, SHARD_STOP_KEY):
                value = layers.start if name == SHARD_START_KEY else layers.stop
            elif name in relative:
                value = _leading(name, readers, ranges)
            elif _per_layer_key(name, arch) and isinstance(value, list) and _per_layer(name, readers, ranges):
                value = [v for reader in readers for v in _field_value(reader.fields[name])]
            writer.add_key_value(name, value, val_type, sub_type=sub_type)

    _write_gguf(out, arch, metadata, tensors, last.endianess)
    return ShardFiles(
        path=out,
        embeddings=None,
        layers=layers,
        vocab_cut=cut,
        tensor_bytes=sum(t.nbytes for _, t in tensors),
        tensors=len(tensors),
    )


def _leading(name: str, readers: list[Any], ranges: list[LayerRange]) -> int:
    """A count of leading layers, each part's relative to its own start, for the merged range."""
    count = 0
    for reader, part in zip(readers, ranges, strict=True):
        field = reader.fields.get(name)
        here = int(_field_value(field)) if field is not None else 0
        count += here
        if here < len(part):
            break
    return count


def _per_layer(name: str, readers: list[Any], ranges: list[LayerRange]) -> bool:
    """A per-layer array: present in every part with one entry per block of that part."""
    for reader, part in zip(readers, ranges, strict=True):
        field = reader.fields.get(name)
        if field is None:
            return False
        value = _field_value(field)
        if not isinstance(value, list) or len(value) != len(part):
            return False
    return True


def _write_gguf(
    out: Path,
    arch: str,
    metadata: Callable[[Any], None],
    tensors: list[tuple[str, TensorBytes]],
    endianess: Any,
) -> None:
    """Write a GGUF atomically: to a hidden partial file, renamed over ``out`` only when complete.
    Tensor bytes are copied from their files in bounded reads (``TensorBytes.tofile``), in the
    byte order they were written in (the writer takes the source's, so nothing is swapped)."""
    import gguf

    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer = gguf.GGUFWriter(str(tmp), arch, endianess=endianess)
        metadata(writer)
        for name, tensor in tensors:
            writer.add_tensor_info(name, tensor.shape, tensor.dtype, tensor.nbytes, tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, tensor in tensors:
            # GGUFWriter asks its argument only for ``nbytes`` and ``tofile``: a TensorBytes streams.
            writer.write_tensor_data(cast(Any, tensor), tensor_endianess=endianess)
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
