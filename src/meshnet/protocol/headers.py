"""HTTP header names of the Meshnet protocol, named once.

The ``X-Meshnet-*`` hop headers are the seed's protocol sketch (architecture.md); the gateway
uses ``GENERATION_ID`` on its OpenAI responses.
"""

from __future__ import annotations

__all__ = [
    "CHUNKS",
    "DRAFT",
    "DTYPE",
    "GENERATION_ID",
    "GUESS",
    "MODEL",
    "NEXT_HOPS",
    "POSITION",
    "PREFIX",
    "REPLAY",
    "REPLAY_FROM",
    "RESEND",
    "REUSE",
    "REWIND",
    "ROUTE_ID",
    "SAMPLE",
    "SAMPLING",
    "SHAPE",
    "TICKET",
    "TOKEN_IDS",
    "TOKEN_RANGE",
]

GENERATION_ID = "X-Meshnet-Generation-Id"
MODEL = "X-Meshnet-Model"
ROUTE_ID = "X-Meshnet-Route-Id"
TOKEN_RANGE = "X-Meshnet-Token-Range"
SHAPE = "X-Meshnet-Shape"
DTYPE = "X-Meshnet-Dtype"
POSITION = "X-Meshnet-Position"

# Meshnet additions to the seed's sketch (docs/protocol.md):
NEXT_HOPS = "X-Meshnet-Next-Hops"  # URLs of the hops after the receiver, comma-separated (first chunk)
SAMPLING = "X-Meshnet-Sampling"  # sampling parameters for the tail, JSON (first chunk)
SAMPLE = "X-Meshnet-Sample"  # "1" on the last prefill chunk: the tail must answer with a token
REPLAY = "X-Meshnet-Replay"  # route repair: rebuild KV on this many hops from here, answer no token
REWIND = "X-Meshnet-Rewind"  # "1" on a repair's resent step: a hop already past it drops it first
# beside activations: the body starts with this many int32 token ids, one per position of the chunk
# (models whose later layers read them: DeepSeek-V4's hash-routed MoE, SeamSpec.carries_token_ids)
TOKEN_IDS = "X-Meshnet-Token-Ids"
# speculative decoding (POST .../verify): the drafted token ids after the step's own token, comma-separated
DRAFT = "X-Meshnet-Draft"
# pipelined speculation: the step's own token is itself a draft (a round sent before the verdict on the
# round before it): the tail keeps the step only if it sampled exactly this token at this position
GUESS = "X-Meshnet-Guess"
# the tracker-signed route ticket (a repair ticket on reroute/replay), verbatim (protocol.tickets)
TICKET = "X-Meshnet-Ticket"
CHUNKS = "X-Meshnet-Chunks"  # prefill: how to split the body into compute calls ("128x2,37,1x3"); default one
# prefix caching: a session's prompt blocks ("BLOCK:HASH,HASH,...", protocol.prefix), on its first request
PREFIX = "X-Meshnet-Prefix"
REUSE = "X-Meshnet-Reuse"  # POST .../prefix: the most leading blocks the receiver may take from its cache
# reroute: the replacement restored a KV snapshot of this many positions; replay only those after it
REPLAY_FROM = "X-Meshnet-Replay-From"
# a reroute with "0": the hop drops the interrupted step too and replays only what came before it; the
# gateway resends the step through the whole route (its own copy of the step may be stale: a pipelined
# round that was voided, or a rejected draft, computed there last)
RESEND = "X-Meshnet-Resend"
