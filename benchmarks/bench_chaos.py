"""`make chaos`: hundreds of greedy generations under random kill -9 / SIGSTOP of random hops.

The swarm and the faults are ``tests/chaos.py``'s (the same harness as the suite's slice, which runs
50 generations); every generation must end identical to its undisturbed text or fail with a stated
reason. Numbers: how many generations and faults, how each ended, how routes recovered.
"""

from __future__ import annotations

import collections
import random
import re
import statistics

from tests.chaos import Report, chaos_swarm, run_chaos

from benchmarks.common import Section

GENERATIONS = 300


def run() -> Section:
    seed = random.SystemRandom().randrange(2**31)
    with chaos_swarm(max_tokens=64) as swarm:
        report = run_chaos(swarm, seed=seed, generations=GENERATIONS, log=lambda line: print(line, flush=True))
    section = Section(
        "Chaos: route repair under random kill -9 / SIGSTOP",
        f"make chaos  (python benchmarks/run.py --only chaos: {GENERATIONS} greedy generations of 64 tokens, "
        f"seed {seed}; tracker, 2 heads 0:10, middle 10:20, tail 20:30, spare 10:30, 1 llama.cpp thread each)",
    )
    n = len(report.outcomes)
    section.add("generations", str(n))
    section.add("faults injected while a generation ran", str(report.faults))
    section.add("identical to the undisturbed text", str(report.count("identical")))
    section.add("failed with a stated reason", str(report.count("failed")))
    section.add("diverged silently", str(report.count("diverged")), "0", report.count("diverged") == 0)
    section.add("hung", str(report.count("hung")), "0", report.count("hung") == 0)
    for kind, count in sorted(report.recoveries.items()):
        section.add(f"recovered with identical text by a {kind}", str(count))
    seconds = [o.seconds for o in report.outcomes]
    section.add("generation time, median / max", f"{statistics.median(seconds):.1f} / {max(seconds):.1f} s")
    section.notes += [
        "Faults: one per generation at a random moment of its undisturbed span (30%: a second one 0.05-1 s "
        "later, often while the first repair replays); 85% a hop of the generation's route, else any node; "
        "15% SIGSTOP (resumed after the generation, stale requests and all), else kill -9 (restarted).",
        "Stated failures by reason: "
        + (", ".join(f"{n} x {why}" for why, n in _reasons(report).most_common()) or "none"),
    ]
    return section


def _reasons(report: Report) -> collections.Counter[str]:
    """The stated failures grouped by their last clause (what finally stopped the generation)."""
    reasons: collections.Counter[str] = collections.Counter()
    for outcome in report.outcomes:
        if outcome.result == "failed":
            last = outcome.detail.rsplit("; ", 1)[-1]
            last = re.sub(r"http://[\w.:]+", "URL", re.sub(r"ses-[0-9a-f]+", "SESSION", last))
            reasons[re.sub(r" from failed node \S+.*", "", last)[:90]] += 1
    return reasons
