"""The helper scripts' Python parts: scripts/pytest_failures_now.py (used by gpu_check.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_failures_now_plugin_writes_each_failure_once(tmp_path: Path) -> None:
    (tmp_path / "test_mixed.py").write_text(
        "def test_ok():\n    assert True\n\n"
        "def test_bad():\n    assert 1 + 1 == 3, 'arithmetic'\n"
    )
    out = tmp_path / "failures.txt"
    env = {**os.environ, "RELPOS_FAILURES_FILE": str(out), "PYTHONPATH": str(SCRIPTS)}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "pytest_failures_now", "test_mixed.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    text = out.read_text()
    assert text.count("==== ") == 1
    assert "==== test_mixed.py::test_bad (call)" in text
    assert "arithmetic" in text
    assert "test_ok" not in text
