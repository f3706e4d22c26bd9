"""A node process that lies in its computation, for the audit tests (tests/integration/test_audits.py).

``python -m tests.liar_node LIE -- ARGS`` runs ``meshnet ARGS`` (a ``node``) whose shard lies:

- ``noise:EPS``: adds noise of ``EPS`` times each row's RMS to what it hands on — the activations it
  sends the next hop, or the tail's logits (it then samples and commits to that distribution
  consistently, so the gateway's draw check passes);
- ``lossy``: rounds what it hands on to bfloat16, as a cheaper number format would;
- ``skip``: computes one layer fewer than it advertises (its range's last layer is skipped);
- ``quant:PATH``: serves another quantization of the model (its ``--gguf``) and advertises the one
  at ``PATH`` (its identity, hence the routes and auditors of that one);
- ``withhold``: computes honestly but does not hand over its seam log for an audit.

Its KV, ledger, signatures and seam log are all consistent with what it sent: only a re-execution
of its layers (audit sampling) can tell.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np


def _lied(values: np.ndarray | None, lie: str, rng: np.random.Generator) -> np.ndarray | None:
    if values is None:
        return None
    if lie == "lossy":
        wide = np.ascontiguousarray(values, dtype=np.float32)
        return ((wide.view(np.uint32) + 0x8000) & 0xFFFF0000).view(np.float32).reshape(values.shape)
    eps = float(lie.split(":", 1)[1])
    rms = np.sqrt(np.mean(np.square(values, dtype=np.float64), axis=-1, keepdims=True))
    return (values + eps * rms * rng.standard_normal(values.shape)).astype(np.float32)


def _install_output_lie(lie: str) -> None:
    from meshnet.backends import shard as shard_module
    from meshnet.errors import MeshnetError

    rng = np.random.default_rng(7)
    base = shard_module.ShardBase

    def lie_about(out: Any) -> Any:
        return shard_module.ShardOutput(hidden=_lied(out.hidden, lie, rng), logits=_lied(out.logits, lie, rng))

    prefill, decode_many = base.prefill, base.decode_many

    def lying_prefill(self: Any, *args: Any, **kwargs: Any) -> Any:
        return lie_about(prefill(self, *args, **kwargs))

    def lying_decode_many(self: Any, steps: Any) -> Any:
        return [o if isinstance(o, MeshnetError) else lie_about(o) for o in decode_many(self, steps)]

    base.prefill = lying_prefill  # type: ignore[method-assign]
    base.decode_many = lying_decode_many  # type: ignore[method-assign]


def _install_skip() -> None:
    from meshnet.backends import llama_shard
    from meshnet.layers import LayerRange

    from_model = llama_shard.LlamaShard.from_model.__func__  # type: ignore[attr-defined]

    def skipping(cls: Any, gguf: Any, layers: LayerRange, **kwargs: Any) -> Any:
        fewer = LayerRange(layers.start, layers.stop - 1, layers.total)
        shard = from_model(cls, gguf, fewer, **kwargs)
        shard.info = dataclasses.replace(shard.info, layers=layers)  # advertised: every layer of the range
        return shard

    llama_shard.LlamaShard.from_model = classmethod(skipping)  # type: ignore[method-assign,assignment]


def _install_quant(advertised: str) -> None:
    from pathlib import Path

    from meshnet.cli import node_run

    facts = node_run._model_facts

    def claimed(gguf: Any, layers: Any) -> Any:
        return facts(Path(advertised), layers)  # the other quantization's identity and shape

    node_run._model_facts = claimed


def _install_withhold() -> None:
    from meshnet.errors import Conflict
    from meshnet.node.service import NodeService

    def withheld(self: Any, sid: Any, caller: Any = None) -> Any:
        raise Conflict(f"session {sid} has no complete seam log on this node", code="no_seam_log")

    NodeService.seam_log = withheld  # type: ignore[method-assign]


def main() -> int:
    lie, separator, *args = sys.argv[1:]
    assert separator == "--", "usage: python -m tests.liar_node LIE -- meshnet ARGS"
    if lie == "skip":
        _install_skip()
    elif lie == "withhold":
        _install_withhold()
    elif lie.startswith("quant:"):
        _install_quant(lie.split(":", 1)[1])
    else:
        _install_output_lie(lie)
    from meshnet.cli.main import main as meshnet_main

    return int(meshnet_main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
