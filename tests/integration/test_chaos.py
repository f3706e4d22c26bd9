"""Chaos over route repair in ``make test``: up to 30 faulted greedy generations on a real swarm.

Every generation must end identical to its prompt's undisturbed text or fail with a stated reason;
none may diverge silently or hang (``tests/chaos.py`` explains the faults). A failure prints the
seed; ``MESHNET_CHAOS_SEED=N`` replays that run. ``make chaos`` runs hundreds more.

The slice is bounded by time as well as by count: a stopped hop costs its nested timeouts (14-24 s)
and a killed one a restart, so on a slow 2-core runner fewer generations fit; at least
``MIN_GENERATIONS`` must.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.chaos import chaos_swarm, run_chaos

pytestmark = pytest.mark.real

GENERATIONS = 30
MIN_GENERATIONS = 10
BUDGET_S = 180.0  # no new generation starts after this; the test's own limit is 600 s


def test_route_repair_never_changes_the_text_under_random_kills_and_stops() -> None:
    seed = int(os.environ.get("MESHNET_CHAOS_SEED") or random.SystemRandom().randrange(2**31))
    with chaos_swarm(max_tokens=48) as swarm:
        report = run_chaos(
            swarm, seed=seed, generations=GENERATIONS, budget_s=BUDGET_S, log=lambda line: print(line, flush=True)
        )
    summary = report.summary()
    print(summary)
    ran = len(report.outcomes)
    assert ran >= MIN_GENERATIONS, f"only {ran} generations fit in {BUDGET_S:.0f}s\n{summary}"
    assert report.count("diverged") == 0, summary
    assert report.count("hung") == 0, summary
    # The faults really hit routes, and most generations came through them unchanged: a harness that
    # only ever saw failures (or no faults at all) would prove nothing.
    assert sum(report.recoveries.values()) >= ran // 3, summary
    assert report.count("identical") >= ran * 3 // 4, summary
