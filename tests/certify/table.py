"""Run the certification of every family and write docs/models.md's support table from what it found.

``python -m tests.certify.table`` (``make certify``): for each tiny model of ``tests/certify/tiny.py``
(converted together first) — whole GGUF against the split route (bit-identical logits
and tokens at every cut and chunk size), a one-step rewind replayed bit-identically, the gap to
transformers — plus what the shards report: the seam's shape, what crosses it besides the hidden
state, KV bytes per token per layer by layer type and the recurrent state per session. Families the
table lists with no tiny model are written as refused, with the reason from ``models.families``.
The table goes between the markers in docs/models.md, under the llama-cpp-python release it ran
on; the rest of the file is left as it is. When every certified family passed, that release is
written into ``models.families.LLAMA_CERTIFIED_ON``: nodes on any other refuse to serve a split.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import meshnet.models.families
from meshnet.backends.llama_shard import LlamaShard
from meshnet.models.families import FAMILIES, installed_llama_cpp
from tests.certify.convert import gguf_for, prepare
from tests.certify.parity import CONFIG, compare, rewind_replays_exactly, transformers_gap
from tests.certify.tiny import CHUNKS, CUTS, CUTS_FOR, GAP_MODEL, TINY

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
FAMILIES_SOURCE = Path(meshnet.models.families.__file__)
BEGIN, END = "<!-- table: python -m tests.certify.table -->", "<!-- end of table -->"
HEADER = (
    "| architecture | llama.cpp route | PyTorch route | cuts tried | seam per position | beside the hidden state "
    "| KV per token per layer (by layer type) | recurrent state per session | whole GGUF vs transformers |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def _kinds(values: tuple[int, ...]) -> str:
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return ", ".join(f"{v:,} B x {n}" for v, n in counts.items())


def row(arch: str, cache: Path) -> str:
    family = FAMILIES[arch]
    torch = "**certified**" if family.torch_route else "no"
    if arch not in TINY:
        return f"| `{arch}` | refused | {torch} | | | | | | {family.why} |"
    gguf, hf_dir = gguf_for(TINY[arch])
    cuts = CUTS_FOR.get(arch, CUTS)
    results = compare(gguf, cuts, CHUNKS, cache)
    exact = all(r.tokens_equal and r.bits_equal for r in results) and rewind_replays_exactly(gguf, cuts[-1], cache)
    if arch in GAP_MODEL:
        gap_gguf, gap_dir = gguf_for(GAP_MODEL[arch](TINY[arch]))
    else:
        gap_gguf, gap_dir = gguf, hf_dir
    gap = transformers_gap(gap_gguf, gap_dir)
    whole = LlamaShard(gguf, config=CONFIG)
    try:
        info = whole.info
    finally:
        whole.close()
    verdict = ("**certified**" if family.llama_route else "exact, but not in the table") if exact else "**FAILED**"
    seam = " x ".join(str(n) for n in info.seam.shape) + " x f32"
    extra = "token ids" if info.seam.carries_token_ids else "nothing"
    # the shard keeps copies of it: a hybrid's checkpoint, DeepSeek-V4's rollback snapshots
    copies = 2 if family.recurrent else 1 + family.rollback
    state = f"{info.kv.fixed_bytes // copies:,} B" if info.kv.fixed_bytes else "none"
    tried = " \\| ".join(",".join(map(str, c)) for c in cuts)
    return (
        f"| `{arch}` | {verdict} | {torch} | {tried} of {info.layers.total} | {seam} | {extra} | "
        f"{info.kv.kind}: {_kinds(info.kv.per_layer_bytes_per_token)} | {state} | {gap:.1e} |"
    )


def main() -> int:
    version = installed_llama_cpp()
    if version is None:
        print("llama-cpp-python is not installed: nothing to certify on", file=sys.stderr)
        return 1
    prepare([*TINY.values(), *(GAP_MODEL[arch](TINY[arch]) for arch in GAP_MODEL)])
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for arch in FAMILIES:
            rows.append(row(arch, Path(tmp)))
            print(rows[-1], flush=True)
    failed = [r for r in rows if "**FAILED**" in r]
    certified = sum(1 for arch in FAMILIES if FAMILIES[arch].llama_route)
    summary = (
        f"Certified on llama-cpp-python {version} (the llama.cpp commit it vendors) by `make certify`: "
        f"{certified} architectures certified on the llama.cpp route, {len(rows) - certified} refused."
    )
    table = "\n".join([BEGIN, summary, "", HEADER, *rows, END])
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOC} has no table markers ({BEGIN} ... {END})", file=sys.stderr)
        return 1
    DOC.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: table, text, flags=re.S))
    if not failed:  # the runtime refuses the certified families on any other llama.cpp
        source = FAMILIES_SOURCE.read_text()
        FAMILIES_SOURCE.write_text(re.sub(r'^LLAMA_CERTIFIED_ON = ".*"$', f'LLAMA_CERTIFIED_ON = "{version}"', source,
                                          count=1, flags=re.M))  # fmt: skip
    print(f"wrote {DOC}: {len(rows)} families, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
