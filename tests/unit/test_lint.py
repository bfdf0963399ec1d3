"""Lint is part of the suite: ruff's checks and formatting over the package, tests and examples; the
layer contracts (import-linter); mypy; every planted-bug target of tests/mutants.py still in place."""

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_layers_hold_and_no_import_cycle():
    """pyproject.toml's [tool.importlinter] contracts: the layers, model and parallel code free of
    Lightning, and no cycle between the siblings of any package (function-level imports count)."""
    lint = shutil.which("lint-imports") or pytest.fail(
        "import-linter is not installed: pip install -e '.[test]'"
    )
    proc = subprocess.run(
        [lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]


def test_every_mutant_target_is_in_place():
    """Each planted bug of tests/mutants.py names a line that is there exactly once and test files that
    exist: a reshape that moves a target fails here, not months later in a kill run."""
    proc = subprocess.run([sys.executable, "tests/mutants.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_two_test_modules_share_a_name():
    """pytest imports test modules by basename (no __init__.py): two files of one name in different
    tiers stop the whole suite at collection with "import file mismatch"."""
    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert not [name for name, n in names.items() if n > 1]
