"""Lint is part of the suite: ruff's checks and formatting over the package, tests and examples."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args):
    ruff = shutil.which("ruff") or pytest.fail("ruff is not installed: pip install -e '.[test]'")
    proc = subprocess.run([ruff, *args, "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_python_is_supported():
    assert sys.version_info >= (3, 10)


@pytest.mark.timeout(600)
def test_mypy():
    """The package type-checks (settings in pyproject.toml)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "lightning_titan"],
        cwd=ROOT, capture_output=True, text=True, timeout=560,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
