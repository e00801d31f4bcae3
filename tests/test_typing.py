"""The package stays fully typed and lint-clean (setup.cfg [mypy])."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import ROOT


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_mypy_finds_no_untyped_or_wrong_code():
    result = run("mypy", "dramatiq_unique")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_finds_nothing():
    result = run("ruff", "check", "--select", "E,F,W,B", "--line-length", "120", "--ignore", "B905", "dramatiq_unique")
    assert result.returncode == 0, result.stdout + result.stderr
