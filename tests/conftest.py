"""Test tiers: every test carries the markers of what it needs, so ``make test-fast`` can leave out
everything that is not in-process and quick.

The tiers (``pytest --markers`` lists them):

- ``real``: real processes or real llama.cpp on a real GGUF (set by each such module's
  ``pytestmark``; everything under ``tests/integration``, ``tests/backends`` and ``tests/browser``);
- ``slow``: takes more than a few seconds even in process;
- ``postgres``: runs against a real PostgreSQL server (a ``postgresql`` parameter, or the
  ``postgres_url`` fixture);
- ``browser``: drives headless Chromium (``tests/browser``);
- ``netns``: builds Linux network namespaces;
- ``torch``: imports PyTorch / transformers.

The marks are set here, from one table, rather than scattered over the modules, so the fast tier's
definition is one place a reader can check. ``make test`` runs every tier; ``make test-fast`` runs
the tests with none of these markers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("real", "slow", "postgres", "browser", "netns", "torch")

_ROOT = Path(__file__).resolve().parent

# What a test needs, by file or by single test (node ids relative to tests/, a prefix matches). Everything
# under integration/, backends/ and browser/ is ``real`` already. An entry that names no existing file is
# a failure at collection, so the table cannot rot silently.
TABLE: dict[str, tuple[str, ...]] = {
    "integration/test_multihost.py": ("netns",),
    "integration/test_multihost_real_model.py": ("netns",),
    "integration/test_chaos.py": ("slow",),
    "integration/test_torch_seed_routes.py": ("torch",),
    "integration/test_route_choice.py": ("torch",),
    "backends/test_torch_shard.py": ("torch",),
    "backends/test_torch_archs.py": ("torch",),
    "backends/test_certification.py": ("torch",),
    "browser/test_dashboard.py": ("browser",),
    # unit tests on llama.cpp's real vocabulary of the bundled GGUF
    "unit/test_grammar.py": ("real",),
    "unit/test_tools.py::test_every_plan_grammar_compiles": ("real",),
    "unit/test_plan.py::test_bundled_model_from_its_gguf": ("real",),
    # transformers' configs and tiny models
    "backends/test_tiny_model_audit.py": ("torch",),
    "unit/test_audit.py::test_the_seed_audits_in_the_docs_are_what_plan_prints": ("torch",),
    # the CLI or other Python processes as subprocesses
    "unit/test_audit.py::test_bad_input_is_a_clear_error": ("real",),
    "unit/test_swarm_admin.py::test_plain_http_off_loopback_needs_insecure": ("real",),
    "unit/test_cores.py::test_processes_sharing_a_lease": ("real",),
    "unit/test_cores.py::test_a_holder_killed_with_sigkill": ("real",),
    # in process, but seconds each (statistical tests over many draws; a concurrency test that waits)
    "unit/test_sampling.py::test_sampled_verify_keeps_the_target_distribution": ("slow",),
    "unit/test_auth.py::test_a_key_past_its_concurrency_gets_429_and_others_are_served": ("slow",),
}


def _check_table() -> None:
    for entry in TABLE:
        rel = entry.split("::", 1)[0]
        if not (_ROOT / rel).is_file():
            raise pytest.UsageError(f"tests/conftest.py names {rel}, which does not exist: update the tier table")


def pytest_configure(config: pytest.Config) -> None:
    _check_table()
    for name, why in (
        ("slow", "takes more than a few seconds even in process (left out of make test-fast)"),
        ("postgres", "needs a real PostgreSQL server (tests/postgres.py)"),
        ("browser", "drives headless Chromium (tests/browser)"),
        ("netns", "builds Linux network namespaces (needs root)"),
        ("torch", "imports PyTorch / transformers"),
    ):
        config.addinivalue_line("markers", f"{name}: {why}")


def _tiers(item: pytest.Item) -> set[str]:
    rel = Path(str(item.path)).resolve().relative_to(_ROOT).as_posix()
    found = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
    if rel.startswith(("integration/", "backends/", "browser/")):
        found.add("real")
    node = f"{rel}::{item.nodeid.split('::', 1)[1]}" if "::" in item.nodeid else rel
    for entry, tiers in TABLE.items():
        if node == entry or node.startswith(entry if "::" in entry else f"{entry}::"):
            found.update(tiers)
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "postgres_url" in getattr(item, "fixturenames", ()) or "postgresql" in params.values():
        found.add("postgres")
    return found


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for tier in sorted(_tiers(item)):
            item.add_marker(tier)
