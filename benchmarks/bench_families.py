"""Per certified family, on its tiny model: route decode ÷ whole-model decode, and seam bytes ÷ formula.

For each family of ``tests/backends/test_certification.py`` the llama.cpp route is certified for, the
same GGUF runs whole (one context) and cut into 3 shards at the family's last certification cut
(an in-process chain: only one shard computes at a time, each with all cores, so the ratio is the
cost of splitting the graph, not of the network). Rounds alternate between the two. The seam bytes
are the wire frames a decode step sends across each seam (``protocol.wire.encode_tensor`` at the
node's default float32) against the formula: the seam's shape (``ShardInfo.seam``) x 4 bytes, plus
4 per token id where the family's seam carries them. It must be exactly 1.00.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import numpy as np
from tests.certify.convert import gguf_for, prepare
from tests.certify.parity import prompt_for
from tests.certify.tiny import CUTS, CUTS_FOR, TINY

from benchmarks.common import Section, median, timed_decode
from meshnet.backends.llama_shard import LlamaShard, LlamaShardConfig
from meshnet.ids import SessionId
from meshnet.models.families import FAMILIES
from meshnet.protocol.wire import encode_tensor

CONFIG = LlamaShardConfig(n_ctx=1024, max_sessions=1, n_threads=os.cpu_count() or 2)
DECODE = 64
ROUNDS = 3


def _decode_rate(chain: list[LlamaShard], prompt: list[int], round_no: int) -> tuple[float, list[int]]:
    """Tokens per second over DECODE greedy steps, and the wire bytes each seam carried per step."""
    sid = SessionId(f"bench-{round_no}")
    for shard in chain:
        shard.open_session(sid)
    rate, logits, position = timed_decode(chain, sid, prompt, DECODE)
    seam_bytes = []
    token = np.array([int(np.argmax(logits))], dtype=np.int32)
    hidden = None
    for shard in chain[:-1]:  # one more step, shard by shard, to weigh what crosses each seam
        needs_ids = shard.info.layers.is_head or shard.info.seam.carries_token_ids
        out = shard.prefill(sid, position, tokens=token if needs_ids else None, hidden=hidden)
        hidden = out.hidden
        assert hidden is not None
        frame = encode_tensor(hidden, "float32")
        ids = len(encode_tensor(token, "int32").body) if shard.info.seam.carries_token_ids else 0
        seam_bytes.append(len(frame.body) + ids)
    for shard in chain:
        shard.close_session(sid)
    return rate, seam_bytes


def _family(arch: str, cache: Path) -> tuple[float, float, str]:
    gguf, _ = gguf_for(TINY[arch])
    cuts = CUTS_FOR.get(arch, CUTS)
    three = next((c for c in reversed(cuts) if len(c) == 2), cuts[-1])
    whole = LlamaShard(gguf, config=CONFIG)
    total = whole.info.layers.total
    prompt = prompt_for(whole.info.n_vocab)
    bounds = [0, *three, total]
    route = [
        LlamaShard.from_model(gguf, f"{a}:{b}", cache_dir=cache, config=CONFIG) for a, b in itertools.pairwise(bounds)
    ]
    try:
        whole_rates, route_rates, seams = [], [], []
        for r in range(ROUNDS):
            whole_rates.append(_decode_rate([whole], prompt, r)[0])
            rate, seams = _decode_rate(route, prompt, r)
            route_rates.append(rate)
        info = route[0].info
        formula = int(np.prod(info.seam.shape)) * 4 + (4 if info.seam.carries_token_ids else 0)
        ratio = max(seams) / formula if seams else 1.0
        assert min(seams) == max(seams)
        cut_text = ",".join(map(str, three))
        return median(route_rates) / median(whole_rates), ratio, f"{cut_text} of {total}"
    finally:
        whole.close()
        for shard in route:
            shard.close()


def run() -> Section:
    section = Section(
        "Model families: route ÷ whole decode, seam bytes ÷ formula (tiny models)",
        "python benchmarks/run.py --only families",
    )
    prepare([TINY[arch] for arch, family in FAMILIES.items() if family.llama_route and arch in TINY])
    with tempfile.TemporaryDirectory() as tmp:
        for arch, family in FAMILIES.items():
            if not family.llama_route or arch not in TINY:
                continue
            decode, seam, cuts = _family(arch, Path(tmp))
            section.add(f"`{arch}` route (cut {cuts}) ÷ whole, decode", f"{decode:.2f}", "report", None)
            section.add(f"`{arch}` seam bytes per decode step ÷ formula", f"{seam:.2f}", "1.00", seam == 1.0)
    section.notes.append(
        f"Each family's tiny random model (hidden 64, 6 to 12 layers, float32 GGUF from llama.cpp's converter); "
        f"{DECODE} greedy decode steps after a 37-token prompt, median of {ROUNDS} alternating rounds, "
        f"{CONFIG.n_threads} threads. On models this small the route's cost is per-shard overhead (one "
        "llama_decode, one eval-callback copy and a Python hop per shard), which a real model's layers dwarf; "
        "the bundled model's ratio is in the shards section."
    )
    return section
