"""The code as the project keeps it: `ruff format` and `ruff check` clean (pyproject.toml's rules), and a
repository that stands alone (nothing points outside it)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff_is_clean(command):
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_nothing_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    files = [ROOT / f for f in tracked if f.endswith((".py", ".md", ".toml"))] or list(ROOT.rglob("*.py"))
    notes = ("../" + "shared", "shared/" + "docs")  # the team's planning notes, which a clone does not have
    outside = [f"{f.relative_to(ROOT)}" for f in files if any(n in f.read_text() for n in notes)]
    assert outside == []
