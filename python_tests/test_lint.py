"""The repository's lint and the README's size, as tests, so that the README's test command and CI
check them: ``ruff check`` with the rules in pyproject.toml ([tool.ruff]: pycodestyle errors and
warnings, pyflakes, lines of at most 120 characters), and the README kept a user's page (at most 160
lines, none over 200 characters; figures belong in docs/benchmarks.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff():
    exe = Path(sys.executable).with_name("ruff")
    return str(exe) if exe.exists() else shutil.which("ruff")


def test_ruff_check_passes():
    ruff = _ruff()
    if ruff is None:
        pytest.fail("ruff is not installed: scripts/bootstrap.sh installs it from requirements.txt")
    r = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_the_readme_is_a_users_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines, at most 160: move figures to docs/benchmarks.md"
    long = [(i + 1, len(line)) for i, line in enumerate(lines) if len(line) > 200]
    assert not long, f"README.md lines over 200 characters (line, length): {long}"
