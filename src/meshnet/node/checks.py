"""What a node checks of a hop request against its own shard before anything changes: the model,
the next hops, the drafts of a verify chunk, and the inputs (token ids at the head, activations of
the seam's shape past it, and the token ids beside them). Every failure is a 4xx with what to fix."""

from __future__ import annotations

import json

import numpy as np

from meshnet.backends.shard import ShardInfo
from meshnet.errors import Conflict, InvalidRequest, SeamMismatch
from meshnet.protocol import headers as H
from meshnet.protocol.messages import HopRequest
from meshnet.protocol.wire import checked_values, format_shape
from meshnet.sampling import SamplingParams

__all__ = ["check_drafts", "check_model", "check_next_hops", "sampling_params", "shard_inputs"]


def check_model(info: ShardInfo, model: str | None) -> None:
    if model is not None and model != info.model_id:
        raise Conflict(f"this node serves model {info.model_id!r}, the request is for {model!r}")


def check_drafts(info: ShardInfo, node_id: str, drafts: tuple[int, ...]) -> None:
    limit = info.max_verify
    if len(drafts) > limit:
        why = f"at most {limit} per verify chunk" if limit else "none: it cannot drop rejected drafts"
        raise InvalidRequest(f"{len(drafts)} drafted tokens, but node {node_id} verifies {why}")
    if info.layers.is_tail and max(drafts) >= info.n_vocab:
        raise InvalidRequest(f"drafted token ids must lie in 0..{info.n_vocab - 1}")


def check_next_hops(info: ShardInfo, node_id: str, hops: tuple[str, ...]) -> tuple[str, ...]:
    if info.layers.is_tail and hops:
        raise InvalidRequest(f"the tail node has no next hop; drop the {H.NEXT_HOPS} header")
    if not info.layers.is_tail and not hops:
        raise InvalidRequest(f"node {node_id} ({info.layers}) needs {H.NEXT_HOPS}")
    return hops


def shard_inputs(info: ShardInfo, request: HopRequest) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(tokens, hidden) for this shard, checking the seam shape; past the head, the token ids
    travel beside the activations when the model or the session needs them."""
    n, payload = request.n, request.payload
    ids: np.ndarray | None = None
    if payload.token_ids is not None:
        if info.layers.is_head:
            raise SeamMismatch(f"the head takes its token ids as the body: drop {H.TOKEN_IDS}")
        ids = np.frombuffer(payload.token_ids, dtype="<i4").astype(np.int32)
        # checked where they are used: a shard that reads them, or the tail (a middle shard may hold no vocabulary)
        used = info.seam.carries_token_ids or info.layers.is_tail
        if used and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= info.n_vocab):
            raise SeamMismatch(f"token ids must lie in 0..{info.n_vocab - 1}")
    elif not info.layers.is_head and info.seam.carries_token_ids:
        raise SeamMismatch(
            f"this model's layers read the token ids at every hop: send the chunk's {n} int32 ids first in the "
            f"body, with {H.TOKEN_IDS}: {n}"
        )
    frame = payload.frame
    if request.guess is not None and info.layers.is_tail and request.guess >= info.n_vocab:
        raise InvalidRequest(f"{H.GUESS} {request.guess} is not a token id of this model (0..{info.n_vocab - 1})")
    if info.layers.is_head:
        if frame.dtype != "int32" or frame.shape != (1, n):
            raise SeamMismatch(f"the head takes int32 token ids of shape 1,{n}, got {frame.dtype} {list(frame.shape)}")
        tokens = checked_values(frame).reshape(n)
        if request.guess is not None and int(tokens[0]) != request.guess:
            raise InvalidRequest(f"{H.GUESS} {request.guess} is not the step's own token {int(tokens[0])}")
        return tokens, None
    want = (1, n, *info.seam.shape)
    if frame.dtype == "int32" or frame.shape != want:
        raise SeamMismatch(f"this node takes activations of shape {format_shape(want)}, got {list(frame.shape)}")
    return ids, checked_values(frame).reshape(want[1:])


def sampling_params(raw: str | None) -> SamplingParams:
    """The session's sampling parameters: the tail samples with them; every hop reads whether
    the token ids must travel to the tail (penalties, grammar)."""
    try:
        return SamplingParams(**json.loads(raw)) if raw else SamplingParams(temperature=0.0)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"{H.SAMPLING} must be JSON sampling parameters: {exc}") from None
