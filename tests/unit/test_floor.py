"""The dependency floor: an older torch than the oldest the suite passes on is named at import."""

import re
import subprocess
import sys

import pytest

from lightning_titan._floor import TORCH_FLOOR, check_torch


@pytest.mark.parametrize("version", ["2.12.1", "2.4.0+cu121", "1.13.1"])
def test_an_older_torch_is_named_with_the_fix(version):
    with pytest.raises(
        ImportError, match=rf"needs torch >= 2\.13 .* found torch {re.escape(version)}: pip install"
    ):
        check_torch(version)


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.14.1", "3.0.0a0"])
def test_the_floor_and_newer_pass(version):
    check_torch(version)


def test_the_package_checks_before_it_imports_anything_else():
    """Run in a fresh interpreter whose torch reports an older version: the import fails with the
    floor's message, not somewhere inside the model's imports."""
    code = "import torch; torch.__version__ = '2.10.0'; import lightning_titan"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"needs torch >= {TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("ImportError"), proc.stderr[-2000:]
