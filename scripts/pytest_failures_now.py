"""pytest plugin for scripts/gpu_check.sh: append each failing test's report to a file as it fails.

pytest prints its failure summary only when the session ends, so a run stopped by a time limit
(the lent GPU's minutes are few) says that a test failed but not which one. With this plugin
(``-p pytest_failures_now``, scripts/ on PYTHONPATH) each failure is written at once to
``$RELPOS_FAILURES_FILE``. Under pytest-xdist the controller gets every worker's reports, so the
file is complete however the run ends.
"""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 (pytest's TestReport)
    """Append the report of a failed setup, call or teardown to $RELPOS_FAILURES_FILE."""
    path = os.environ.get("RELPOS_FAILURES_FILE")
    # Under xdist a worker's reports reach the controller too: write there only, once.
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n\n")
