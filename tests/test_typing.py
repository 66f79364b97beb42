"""The package's type hints as a user's type checker sees them (``py.typed``).

``mypy --strict`` on tests/_typing_user.py, a user's code: the correct uses must pass and each
line marked ``# error: [code]`` must give exactly that error. Without ``py.typed`` mypy would
skip the package (every use ``Any``, no error found); with wrong hints it would flag the
correct uses.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mypy import api as mypy_api

USER_CODE = Path(__file__).with_name("_typing_user.py")


def test_user_code_type_checks(tmp_path):
    expected = {
        (number, code)
        for number, line in enumerate(USER_CODE.read_text().splitlines(), 1)
        for code in re.findall(r"  # error: \[([a-z-]+)\]$", line)
    }
    assert len(expected) >= 6
    stdout, stderr, _ = mypy_api.run([
        "--strict", "--no-error-summary", "--show-error-codes", "--no-color-output",
        "--python-executable", sys.executable, "--cache-dir", str(tmp_path / "cache"),
        str(USER_CODE),
    ])
    reported = {
        (int(number), code)
        for number, code in re.findall(r":(\d+): error: .*\[([a-z-]+)\]$", stdout, re.MULTILINE)
    }
    assert reported == expected, f"mypy:\n{stdout}{stderr}"
