"""Meshnet: a distributed GGUF runtime.

Package map (one role per package): ``protocol`` (wire format) · ``session`` (per-session KV
ownership) · ``backends`` (llama.cpp, PyTorch; the only importers of either) · ``node`` (a shard
server) · ``tracker`` (registry, routes, billing) · ``gateway`` (OpenAI API + Generation
Telemetry) · ``artifacts`` (GGUF files, manifests, distribution) · ``cli`` (composition root).
"""

import sys

# httpx's package imports its command-line tool (click, rich, pygments) whenever those are
# installed (transformers' dependencies install them); Meshnet never runs it. Marked absent, httpx
# keeps a stub instead: every meshnet process starts ~0.2 s sooner and holds ~4 MiB less.
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]

from meshnet.errors import MeshnetError  # noqa: E402
from meshnet.layers import LayerRange  # noqa: E402

__all__ = ["LayerRange", "MeshnetError", "__version__"]

__version__ = "0.1.0"
