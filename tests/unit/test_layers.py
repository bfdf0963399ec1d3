"""The layers hold at run time, not only in import-linter's static graph: importing any package below
the Lightning glue, and every module in it, loads no Lightning (a package ``__init__`` that imports a
Lightning class, or an import inside a function that runs at import, shows up only here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_utilities", "torchmetrics")
BELOW_THE_GLUE = ("hf", "model", "parallel", "train", "checkpoint", "runtime", "plan", "data")

# Imports the package, then each of its modules in pkgutil's order, in a fresh interpreter; prints
# as JSON the first module after whose import a Lightning package was loaded, and which ones.
PROBE = """
import importlib, json, pkgutil, sys
LIGHTNING = {lightning!r}

def loaded():
    return sorted({{m.split(".")[0] for m in sys.modules}} & set(LIGHTNING))

package = importlib.import_module({package!r})
names = [package.__name__] + [
    m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
]
found = None
for name in names:
    importlib.import_module(name)
    if loaded():
        found = {{"module": name, "loaded": loaded()}}
        break
print(json.dumps({{"modules": names, "leak": found}}))
"""


def imports_in_a_fresh_process(package: str) -> dict:
    code = PROBE.format(lightning=LIGHTNING, package=package)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(320)
@pytest.mark.parametrize("package", BELOW_THE_GLUE)
def test_importing_a_package_below_the_glue_loads_no_lightning(package: str) -> None:
    result = imports_in_a_fresh_process(f"lightning_titan.{package}")
    assert len(result["modules"]) > 1, result["modules"]  # the walk found its modules
    leak = result["leak"]
    assert leak is None, f"importing {leak['module']} loaded {leak['loaded']}"


def test_the_top_package_loads_lightning_only_when_asked() -> None:
    """``import lightning_titan`` stays light; its Lightning names load on first use."""
    code = (
        "import sys, lightning_titan\n"
        "before = 'lightning' in sys.modules\n"
        "lightning_titan.TitanDataModule\n"
        "print(before, 'lightning' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.stdout.split() == ["False", "True"], proc.stdout + proc.stderr[-3000:]


def test_the_data_module_answers_to_its_names() -> None:
    """``lightning_titan.TitanDataModule`` and ``lightning_titan.data.TitanDataModule`` (the name
    code and configs use) are the Lightning data module over the pipeline."""
    import lightning.pytorch as pl

    import lightning_titan
    import lightning_titan.data
    from lightning_titan.data import DataPipeline
    from lightning_titan.lightning.datamodule import TitanDataModule

    assert lightning_titan.TitanDataModule is TitanDataModule
    assert lightning_titan.data.TitanDataModule is TitanDataModule
    assert issubclass(TitanDataModule, DataPipeline) and issubclass(
        TitanDataModule, pl.LightningDataModule
    )
    with pytest.raises(AttributeError, match="no attribute 'TitanDatamodule'"):
        _ = lightning_titan.data.TitanDatamodule


def test_a_config_naming_the_data_module_by_its_data_path_builds_it() -> None:
    """A LightningCLI of the user's own, with data modules given by ``class_path``, that names
    ``lightning_titan.data.TitanDataModule`` gets the data module; the path goes into its hparams
    (and so into checkpoints), from where it must keep resolving."""
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    from lightning_titan import TitanLM
    from lightning_titan.lightning.datamodule import TitanDataModule

    data = {"class_path": "lightning_titan.data.TitanDataModule", "init_args": {"seq_len": 32}}
    cli = LightningCLI(
        TitanLM,
        pl.LightningDataModule,
        subclass_mode_data=True,
        run=False,
        save_config_callback=None,
        args=["--data", json.dumps(data), "--trainer.logger=false"],
    )
    assert isinstance(cli.datamodule, TitanDataModule) and cli.datamodule.seq_len == 32
    assert cli.datamodule.hparams["_class_path"] == "lightning_titan.data.TitanDataModule"
