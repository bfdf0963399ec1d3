"""Bad input found at construction or in data setup, in-process: each message names the value or file
and the fix (issue 13, item 7). Slower, launched cases live in test_reliability's bad-input tables."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_titan.cli import fit_summary, skipped_warning
from lightning_titan.data import TitanDataModule
from lightning_titan.module import TitanLM


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"max_bytes": -5}, r"max_bytes=-5 must be at least 1.*or None"),
        ({"max_bytes": 0}, r"max_bytes=0 must be at least 1"),
        ({"streaming": True, "steps_per_epoch": 0}, r"steps_per_epoch=0 must be at least 1.*None"),
        ({"val_batches": 0}, r"val_batches=0 must be at least 1.*val_fraction=0"),
    ],
)
def test_datamodule_rejects_non_positive_counts_at_construction(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        TitanDataModule(**kwargs)


def test_weight_decay_must_not_be_negative():
    with pytest.raises(ValueError, match=r"weight_decay=-1 must be >= 0"):
        TitanLM(weight_decay=-1)
    TitanLM(weight_decay=0.0)  # 0 turns it off: allowed


def _trainer(skipped: int | None, steps: int) -> SimpleNamespace:
    strategy = SimpleNamespace() if skipped is None else SimpleNamespace(skipped_steps=skipped)
    return SimpleNamespace(
        callback_metrics={}, global_step=steps, strategy=strategy, logger=None,
        checkpoint_callback=None,
    )  # fmt: skip


def test_fit_summary_counts_skipped_steps_and_warns_when_most_were_skipped():
    module = TitanLM()
    assert "skipped steps      7 of 8" in fit_summary(_trainer(7, 8), module)
    assert "skipped steps      0 of 8" in fit_summary(_trainer(0, 8), module)
    assert "skipped" not in fit_summary(_trainer(None, 8), module)  # another strategy
    warning = skipped_warning(_trainer(7, 8))
    assert warning is not None and warning.startswith(
        "WARNING: 7 of 8 optimizer steps were skipped"
    )
    assert "on_nonfinite='raise'" in warning
    assert skipped_warning(_trainer(4, 8)) is not None
    assert skipped_warning(_trainer(1, 8)) is None and skipped_warning(_trainer(0, 8)) is None
    assert skipped_warning(_trainer(None, 8)) is None


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
