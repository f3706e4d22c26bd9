"""``meshnet plan CONFIG --nodes N``: the three seed audits in docs/configs reproduced, and bad input
(the counts against real tiny models: tests/backends/test_tiny_model_audit.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshnet.backends.audit import audit, format_audit, is_model_config
from meshnet.errors import InvalidRequest

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configs"
SEED_AUDITS = {"deepseek-v4-flash": 8, "glm-5.2": 20, "qwen3.5-35b-a3b": 2}


@pytest.mark.parametrize(("name", "nodes"), sorted(SEED_AUDITS.items()))
def test_the_seed_audits_in_the_docs_are_what_plan_prints(name: str, nodes: int) -> None:
    config = DOCS / f"{name}.json"
    assert is_model_config(config)
    expected = (DOCS / f"{name}.plan.txt").read_text()
    assert format_audit(audit(config, context=131072, nodes=nodes)) + "\n" == expected


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "no_such_model", "hidden_size": 8}')
    with pytest.raises(InvalidRequest, match="no_such_model"):
        audit(tmp_path, context=10, nodes=1)
    with pytest.raises(InvalidRequest, match="--nodes must be positive"):
        audit(DOCS / "qwen3.5-35b-a3b.json", context=10, nodes=0)
    done = subprocess.run(
        [sys.executable, "-m", "meshnet.cli.main", "plan", str(tmp_path / "x.gguf"), "--nodes", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "meshnet plan:" in done.stderr and "Traceback" not in done.stderr
