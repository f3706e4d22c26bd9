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
BENCHES = {"serve": "bench_serve", "shards": "bench_shards", "torch": "bench_torch", "route": "bench_route"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=sorted(BENCHES), action="append", help="run only these benchmarks")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args()
    names = args.only or list(BENCHES)
    started = time.monotonic()
    sections = []
    for name in names:
        print(f"bench: {name} ...", flush=True)
        section = importlib.import_module(f"benchmarks.{BENCHES[name]}").run()
        print(section.markdown(), flush=True)
        sections.append(section.markdown())
    header = [
        "# Benchmark results",
        "",
        f"Written by `make bench` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC} "
        f"in {time.monotonic() - started:.0f} s.",
        "",
        f"Machine: {machine()}",
        "",
        "Every ratio compares two measurements taken in the same run on the same machine, one after the "
        "other, never concurrently.",
        "",
    ]
    args.out.write_text("\n".join(header) + "\n" + "\n".join(sections))
    print(f"bench: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
