"""Billing on evidence: each node's signed receipt for the work a gateway bills (docs/billing.md,
"Receipts: billing on evidence").

A receipt is the latest entry a node signed in an answer of the session that the gateway verified
(protocol.signing: the node's layers, the positions it holds, the running digests of what it
computed from and sent on), with the answer it vouched for when it is the tail. The gateway sends
one per billed node with its billing report (``receipts``); the tracker takes a report only if:

- every billed node has a receipt, signed by the hop key it was pinned with when it joined the
  session's route (``sessions.hop_keys``; a repair keeps a replaced node's key);
- no node is billed more positions than its receipt shows it holding;
- the receipts of the route the session ended on tile the model's layers and chain hop to hop:
  each hop holds the same positions and computed them from exactly what the hop before it sent.

A node pinned without a key (an older node of an open swarm) is billed as before, without one; a
private swarm's nodes all have keys, and its sessions are billed only with receipts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from meshnet.errors import InvalidRequest
from meshnet.protocol.messages import HopEntry
from meshnet.protocol.signing import signed_by
from meshnet.tracker.db import BillingRow, member

__all__ = ["Receipt", "check_receipts"]


class Receipt(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    entry: dict[str, Any]
    answer: dict[str, Any] | None = None


def _refused(message: str) -> InvalidRequest:
    return InvalidRequest(f"receipts: {message}", param="receipts")


def check_receipts(
    session: dict[str, Any], records: Sequence[BillingRow], receipts: Sequence[Receipt]
) -> dict[str, str]:
    """The receipt (as JSON) of every billed node of ``session`` that has a key; ``InvalidRequest``
    naming the first record the receipts do not bear out."""
    keys: dict[str, str] = session.get("hop_keys") or {}
    private = session.get("owner") is not None
    by_node: dict[str, tuple[HopEntry, Receipt]] = {}
    for receipt in receipts:
        try:
            entry = HopEntry.from_json(receipt.entry)
        except ValueError as exc:
            raise _refused(str(exc)) from None
        if entry.node in by_node:
            raise _refused(f"two receipts of node {entry.node}")
        by_node[entry.node] = (entry, receipt)
    proofs = {}
    for work in records:
        node, layers = work.node_id, work.layers
        key = keys.get(member(node, layers))
        if key is None:
            if private:
                raise _refused(f"node {node} was pinned to session {session['session_id']} without a hop key")
            continue  # an older node of an open swarm: billed on the gateway's count alone
        found = by_node.get(node)
        if found is None:
            raise _refused(f"node {node} is billed without its receipt")
        entry, receipt = found
        if entry.layers != layers:
            raise _refused(f"node {node} is billed for layers {layers}; its receipt is for {entry.layers}")
        if not signed_by(key, session["session_id"], entry, receipt.answer):
            raise _refused(
                f"the receipt of node {node} does not carry its signature over session {session['session_id']}"
            )
        billed = work.prefill_tokens + work.decode_tokens
        if billed > entry.held:
            raise _refused(f"node {node} is billed {billed} positions; its receipt shows it holding {entry.held}")
        proofs[node] = json.dumps(receipt.model_dump(), separators=(",", ":"))
    _check_route(session, {node: entry for node, (entry, _) in by_node.items() if node in proofs})
    return proofs


def _check_route(session: dict[str, Any], entries: dict[str, HopEntry]) -> None:
    """The route the session ended on: if any of its hops is billed with a receipt, every hop with a
    key has one (together they cover the model's layers), and neighbours chain."""
    hops = [h for h in session["hops"] if isinstance(h.get("hop_key"), str)]
    missing = [h["node_id"] for h in hops if h["node_id"] not in entries]
    if len(missing) == len(hops):
        return  # none of the final route's hops is billed (it computed nothing): nothing to chain
    if missing:
        raise _refused(f"the receipts leave layers of the route uncovered: no receipt of {missing}")
    pairs = zip(session["hops"], session["hops"][1:], strict=False)
    for before, after in ((entries.get(a["node_id"]), entries.get(b["node_id"])) for a, b in pairs):
        if before is None or after is None:
            continue  # beside a hop without a key
        if after.held != before.held:
            raise _refused(f"node {after.node} holds {after.held} positions, the hop before it {before.held}")
        if after.input_digest != before.output_digest:
            raise _refused(f"node {after.node} computed from other inputs than node {before.node} sent it")
