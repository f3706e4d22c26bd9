"""HTTP header names of the Meshnet protocol, named once.

The ``X-Meshnet-*`` hop headers are the seed's protocol sketch (architecture.md); the gateway
uses ``GENERATION_ID`` on its OpenAI responses.
"""

from __future__ import annotations

__all__ = [
    "DTYPE",
    "GENERATION_ID",
    "MODEL",
    "POSITION",
    "ROUTE_ID",
    "SHAPE",
    "TOKEN_RANGE",
]

GENERATION_ID = "X-Meshnet-Generation-Id"
MODEL = "X-Meshnet-Model"
ROUTE_ID = "X-Meshnet-Route-Id"
TOKEN_RANGE = "X-Meshnet-Token-Range"
SHAPE = "X-Meshnet-Shape"
DTYPE = "X-Meshnet-Dtype"
POSITION = "X-Meshnet-Position"
