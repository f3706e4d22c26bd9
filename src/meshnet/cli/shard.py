"""``meshnet shard make``: cut one layer range of a GGUF into a file the llama.cpp shard backend loads."""

from __future__ import annotations

import argparse
import sys
import time

from meshnet.cli.serve import check_certified, resolve_gguf
from meshnet.errors import InvalidRequest, MeshnetError

__all__ = ["run_plan", "run_shard_make"]


def run_shard_make(args: argparse.Namespace) -> int:
    from meshnet.artifacts.shard_file import write_shard

    source = resolve_gguf(args.gguf, "shard make")
    if not check_certified(source, "shard make", allow=args.allow_uncertified):
        return 2
    if args.out.suffix != ".gguf":
        print(f"meshnet shard make: --out must end in .gguf, got {args.out}", file=sys.stderr)
        return 2
    print(f"meshnet: reading {source} ...", flush=True)
    started = time.monotonic()
    try:
        files = write_shard(source, args.layers, args.out, cut_vocab=False if args.keep_vocab else None)
    except MeshnetError as exc:
        print(f"meshnet shard make: {exc.message}", file=sys.stderr)
        return 2
    kind = "head" if files.layers.is_head else "tail" if files.layers.is_tail else "middle"
    print(
        f"meshnet: wrote {files.path} — {kind} shard, layers {files.layers} of {files.layers.total}, "
        f"{files.tensors} tensors, {files.tensor_bytes / 2**20:.1f} MiB"
        f"{', vocabulary cut to 1 token' if files.vocab_cut else ''} in {time.monotonic() - started:.1f}s"
    )
    if files.embeddings is not None:
        print(f"meshnet: wrote {files.embeddings} — the head's embedding table (keep it beside the shard)")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from meshnet.artifacts.plan import dtype_bytes, format_plan, plan, read_shape
    from meshnet.backends.audit import audit, format_audit, is_model_config
    from meshnet.layers import LayerRange

    try:
        if is_model_config(args.config):
            # A config transformers can build: weights counted per layer, KV by layer type.
            if args.layers:
                raise InvalidRequest("--layers applies to a GGUF or manifest; a config.json is audited per node")
            found = audit(
                args.config,
                context=args.context,
                nodes=args.nodes or 1,
                weight_bits=args.weight_bits,
                seam_dtype_bytes=dtype_bytes(args.seam_dtype, "seam dtype"),
            )
            print(format_audit(found))
            return 0
        if args.nodes is not None:
            raise InvalidRequest("--nodes audits a Hugging Face config.json that names its model_type")
        shape = read_shape(args.config, cache_dtype=args.cache_dtype, seam_dtype=args.seam_dtype)
        layers = LayerRange.parse(args.layers, shape.layers) if args.layers else None
        print(format_plan(plan(shape, context=args.context, layers=layers, prefill_chunk=args.prefill_chunk)))
    except MeshnetError as exc:
        print(f"meshnet plan: {exc.message}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"meshnet plan: {exc}", file=sys.stderr)
        return 2
    return 0
