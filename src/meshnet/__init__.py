"""Meshnet: a distributed GGUF runtime.

Package map (one role per package): ``protocol`` (wire format) · ``session`` (per-session KV
ownership) · ``backends`` (llama.cpp, PyTorch; the only importers of either) · ``node`` (a shard
server) · ``tracker`` (registry, routes, billing) · ``gateway`` (OpenAI API + Generation
Telemetry) · ``artifacts`` (GGUF files, manifests, distribution) · ``cli`` (composition root).
"""

from meshnet.errors import MeshnetError
from meshnet.layers import LayerRange

__all__ = ["LayerRange", "MeshnetError", "__version__"]

__version__ = "0.1.0"
