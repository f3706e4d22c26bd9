"""`make bench`: run every benchmark alone, one after another, and write benchmarks/RESULTS.md.

Run it on an otherwise idle machine: llama.cpp threads spin, and a second busy process on 2 cores
slows decode by orders of magnitude.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import importlib

from benchmarks.common import ROOT, machine

# name -> module under benchmarks/ exposing run() -> Section; imported only when it runs.
BENCHES = {
    "serve": "bench_serve",
    "shards": "bench_shards",
    "torch": "bench_torch",
    "route": "bench_route",
    "batch": "bench_batch",
    "speculative": "bench_speculative",
    "grammar": "bench_grammar",
    "wan": "bench_wan",
    "routing": "bench_routing",
    "repair": "bench_repair",
    "prefix": "bench_prefix",
    "snapshot": "bench_snapshot",
    "artifacts": "bench_artifacts",
    "chaos": "bench_chaos",
    "families": "bench_families",
    "real": "bench_real",
    "audits": "bench_audits",
}
# Run only when asked for by name (`make chaos`): they take most of an hour.
SLOW = {"chaos"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=sorted(BENCHES), action="append", help="run only these benchmarks")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args()
    names = args.only or [name for name in BENCHES if name not in SLOW]
    started = time.monotonic()
    # Keep the sections of benchmarks not run now (`--only`), each with the stamp of its own run.
    sections = _existing_sections(args.out) if args.only else {}
    stamp = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}, {machine()}"
    for name in names:
        print(f"bench: {name} ...", flush=True)
        section = importlib.import_module(f"benchmarks.{BENCHES[name]}").run()
        print(section.markdown(), flush=True)
        sections[name] = f"{_MARK.format(name)}\n{section.markdown()}\nMeasured {stamp}.\n"
    header = [
        "# Benchmark results",
        "",
        f"Written by `make bench` (`python benchmarks/run.py`; `--only NAME` re-runs one section). "
        f"Last run took {time.monotonic() - started:.0f} s.",
        "",
        "Every ratio compares two measurements taken in the same run on the same machine, one after the "
        "other, never concurrently. Run benchmarks alone on the machine: llama.cpp threads spin.",
        "",
    ]
    ordered = [sections[n] for n in BENCHES if n in sections]
    args.out.write_text("\n".join(header) + "\n" + "\n".join(ordered))
    print(f"bench: wrote {args.out}")
    return 0


_MARK = "<!-- bench: {} -->"


def _existing_sections(path: Path) -> dict[str, str]:
    """Sections of a previous RESULTS.md, keyed by benchmark name (from the marker before each)."""
    if not path.is_file():
        return {}
    found: dict[str, str] = {}
    text = path.read_text()
    for name in BENCHES:
        marker = _MARK.format(name)
        if marker in text:
            body = text.split(marker, 1)[1]
            ends = [i for n in BENCHES if (i := body.find(_MARK.format(n))) >= 0]
            kept = marker + body[: min(ends)] if ends else marker + body
            found[name] = kept.rstrip() + "\n"  # one blank line between sections, however often rewritten
    return found


if __name__ == "__main__":
    sys.exit(main())
