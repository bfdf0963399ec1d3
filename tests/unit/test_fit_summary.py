"""What a `titan fit` prints and writes besides training: the end summary (lightning/summary.py), built
from what FitCounts measured on the ranks; Lightning's chatter and datasets' save bars kept off the
terminal (lightning/quiet.py, data/prepare.py); the callbacks' files in the run's log folder
(lightning/callbacks.py). In one process, through the hooks; tests/cli/test_errors.py checks the whole
command's output."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_titan.data.prepare import no_progress_bars
from lightning_titan.lightning import quiet, summary
from lightning_titan.lightning.callbacks import ExpertLoad, PipelineTimeline
from lightning_titan.lightning.summary import FitCounts, duration, fit_summary, size
from lightning_titan.model import flops
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.mesh import ParallelDims

CONFIG = ModelConfig()


class Strategy:
    """A TitanStrategy of ``world`` ranks seen from rank 0: ``reduce`` answers as if the other ranks
    held ``others`` (max only, as FitCounts uses it)."""

    def __init__(self, dims: ParallelDims, others: list[float]) -> None:
        self.parallel_dims, self.root_device, self.skipped_steps = dims, torch.device("cpu"), 0
        self.others = others

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "max"
        rows = [tensor] + [torch.tensor([v, -v], dtype=tensor.dtype) for v in self.others]
        return torch.stack(rows).max(dim=0).values


def fake_trainer(dims: ParallelDims, others: list[float] = ()) -> SimpleNamespace:
    return SimpleNamespace(
        callback_metrics={}, global_step=0, strategy=Strategy(dims, list(others)),
        world_size=dims.world_size, logger=None, checkpoint_callback=None,
    )  # fmt: skip


def fit(monkeypatch, step_seconds: list[float], dims: ParallelDims, peak: float, others=()):
    """FitCounts over len(step_seconds) steps of 2 x 16-token sequences a data rank, each step taking
    the given seconds by the callback's clock."""
    clock = iter(t for s in step_seconds for t in (100.0, 100.0 + s))
    monkeypatch.setattr(summary.time, "perf_counter", lambda: next(clock))
    trainer = fake_trainer(dims, others)
    module = SimpleNamespace(config=CONFIG, peak_flops_total=peak)
    callback, batch = FitCounts(), (torch.zeros(2, 16, dtype=torch.long), None)
    for index in range(len(step_seconds)):
        callback.on_train_batch_start(trainer, module, batch, index)
        callback.on_train_batch_end(trainer, module, None, batch, index)
        trainer.global_step += 1
    callback.on_train_end(trainer, module)
    trainer.callback_metrics["train_loss"] = torch.tensor(4.25)
    return trainer, module


def test_the_mean_leaves_out_the_first_step_and_counts_every_data_rank(monkeypatch):
    dims = ParallelDims(dp=2, pp=2, ep=2)  # data_world = 4: 4 x 32 tokens a step
    trainer, module = fit(monkeypatch, [50.0, 2.0, 2.0], dims, peak=1e12)
    out = fit_summary(trainer, module, wall_seconds=75.0)
    tokens, seconds = 2 * 4 * 32, 4.0
    assert (
        f"tokens/s           {tokens / seconds:,.0f} (mean of the 2 steps after the first)" in out
    )
    mfu = flops.step_flops(CONFIG, tokens) / seconds / 1e12
    assert f"MFU                {mfu:.2%} of 1 TFLOP/s (every rank's peak summed)" in out
    assert "wall time          1 min 15 s" in out and "final train_loss   4.2500 (step 3)" in out
    assert "layout             dp=2 pp=2 ep=2 (8 ranks)" in out


def test_one_step_or_no_peak_says_n_a(monkeypatch):
    trainer, module = fit(monkeypatch, [5.0], ParallelDims(1, 1, 1), peak=1e12)
    out = fit_summary(trainer, module)
    assert "tokens/s           n/a (one step: the mean leaves out the first)" in out
    assert "MFU" not in out and "wall time" not in out
    trainer, module = fit(monkeypatch, [5.0, 1.0], ParallelDims(1, 1, 1), peak=0.0)
    assert "MFU                n/a (no device peak known)" in fit_summary(trainer, module)


def test_peak_memory_is_the_range_over_the_ranks(monkeypatch):
    monkeypatch.setattr(summary, "peak_memory", lambda device: ("host", 300 * 2**20))
    dims = ParallelDims(4, 1, 1)
    others = [2.5 * 2**30, 200 * 2**20, 2**30]  # the other three ranks' peaks
    trainer, module = fit(monkeypatch, [1.0, 1.0], dims, 1e12, others=others)
    out = fit_summary(trainer, module)
    assert "peak memory        200 MiB to 2.50 GiB a rank (host max RSS) over 4 ranks" in out
    monkeypatch.setattr(summary, "peak_memory", lambda device: ("cuda", 3 * 2**30))
    trainer, module = fit(monkeypatch, [1.0, 1.0], ParallelDims(1, 1, 1), 1e12)
    assert "peak memory        3.00 GiB a rank (CUDA max allocated)" in fit_summary(trainer, module)


def test_this_process_peak_is_its_max_resident_set():
    kind, peak = summary.peak_memory(torch.device("cpu"))
    held = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB touched: the peak is at least that
    kind, after = summary.peak_memory(torch.device("cpu"))
    assert kind == "host" and after >= 64 * 2**20 and after >= peak
    del held


def test_durations_and_sizes_read_plainly():
    assert [duration(s) for s in (9.46, 192.0, 7380.0)] == ["9.5 s", "3 min 12 s", "2 h 03 min"]
    assert [size(b) for b in (412 * 2**20, 1.234 * 2**30)] == ["412 MiB", "1.23 GiB"]


@pytest.fixture
def chatter_filter():
    yield quiet.quiet_lightning_chatter
    for name in quiet.RANK_ZERO_LOGGERS:  # leave Lightning's loggers as found
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, quiet.DropChatter)]:
            logger.removeFilter(f)


def test_lightning_tips_and_accelerator_lines_are_dropped_and_the_rest_kept(chatter_filter, caplog):
    chatter_filter()
    chatter_filter()  # twice: still one filter
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert sum(isinstance(f, quiet.DropChatter) for f in logger.filters) == 1
    with caplog.at_level(logging.INFO):
        for line in ("💡 Tip: try litlogger", "GPU available: False, used: False",
                     "TPU available: False, using: 0 TPU cores", "HPU available: False, using: 0 HPUs",
                     "-" * 100 + "\ndistributed_backend=gloo\nAll distributed processes registered.",
                     "Seed set to 1234", "`Trainer.fit` stopped: `max_steps=2` reached."):  # fmt: skip
            rank_zero_info(line)
        logging.getLogger("lightning.fabric.utilities.distributed").info(
            "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/8"
        )
    assert [r.getMessage() for r in caplog.records] == [
        "Seed set to 1234",
        "`Trainer.fit` stopped: `max_steps=2` reached.",
    ]


def test_no_progress_bars_turns_datasets_bars_off_inside_only():
    was_off = datasets.utils.are_progress_bars_disabled()
    datasets.utils.enable_progress_bars()
    try:
        with no_progress_bars():
            assert datasets.utils.are_progress_bars_disabled()
        assert not datasets.utils.are_progress_bars_disabled()
        datasets.utils.disable_progress_bars()
        with no_progress_bars():
            pass
        assert datasets.utils.are_progress_bars_disabled()  # off before: still off
    finally:
        (datasets.utils.disable_progress_bars if was_off else datasets.utils.enable_progress_bars)()


def test_the_callbacks_write_into_the_run_log_folder(tmp_path):
    run = tmp_path / "runs" / "job" / "version_3"
    trainer = SimpleNamespace(log_dir=str(run), default_root_dir=str(tmp_path), global_step=0,
                              strategy=SimpleNamespace(root_device="cpu"), is_global_zero=True)  # fmt: skip
    timeline, load = PipelineTimeline(steps=[1]), ExpertLoad()
    timeline.on_train_start(trainer, nn.Linear(1, 1))
    load.on_train_start(trainer, nn.Linear(1, 1))
    assert timeline.out_dir == run / "timeline"
    assert Path(load.plot_path) == run / "expert_load.png"
    # absolute paths as given; no plot stays no plot; no logger: the Trainer's root folder
    absolute = PipelineTimeline(out_dir=str(tmp_path / "tl")), ExpertLoad(plot_path=None)
    no_logger = SimpleNamespace(**{**vars(trainer), "log_dir": None})
    absolute[0].on_train_start(no_logger, nn.Linear(1, 1))
    absolute[1].on_train_start(no_logger, nn.Linear(1, 1))
    assert absolute[0].out_dir == tmp_path / "tl" and absolute[1].plot_path is None
    relative = PipelineTimeline(out_dir="tl")
    relative.on_train_start(no_logger, nn.Linear(1, 1))
    assert relative.out_dir == tmp_path / "tl"


PNG = b"\x89PNG\r\n\x1a\n"


def test_the_loss_curve_is_drawn_beside_metrics_csv_and_named_in_the_summary(tmp_path, monkeypatch):
    """The run folder's metrics.csv as loss_curve.png, train and val loss; a step a restarted attempt
    redid keeps its last row; without the CSV logger or matplotlib the summary says why there is none."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_titan.lightning import plots

    logger = CSVLogger(str(tmp_path / "runs"), name="job", version=2)
    folder = Path(logger.log_dir)
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_text(
        "epoch,step,train_loss,val_loss\n0,0,9.0,\n0,1,8.0,\n0,1,,8.5\n0,2,7.0,\n"
        "0,1,7.5,\n"  # step 1 again, after a restart: the later row counts
    )
    assert summary.losses(folder / "metrics.csv") == ([(0, 9.0), (1, 7.5), (2, 7.0)], [(1, 8.5)])
    drawn: list = []
    real = plots.plot_loss_curve
    monkeypatch.setattr(plots, "plot_loss_curve", lambda *a, **k: (drawn.append(a), real(*a, **k)))
    trainer = SimpleNamespace(**{**vars(fake_trainer(ParallelDims(1, 1, 1, 0))), "logger": logger})
    curve = summary.draw_loss_curve(trainer)
    assert curve == str((folder / "loss_curve.png").resolve())
    assert (folder / "loss_curve.png").read_bytes().startswith(PNG)
    assert drawn[0][:2] == ([(0, 9.0), (1, 7.5), (2, 7.0)], [(1, 8.5)])
    text = fit_summary(trainer, SimpleNamespace(config=CONFIG), loss_curve=curve)
    assert f"loss curve         {curve}" in text.splitlines()
    assert f"logs               {(folder / 'metrics.csv').resolve()}" in text.splitlines()
    # the reasons there is none
    tensorboard = SimpleNamespace(**{**vars(trainer), "logger": TensorBoardLogger(str(tmp_path))})
    assert summary.draw_loss_curve(tensorboard).startswith("n/a (drawn from the CSVLogger's")
    empty = CSVLogger(str(tmp_path / "runs"), name="job", version=3)
    none_logged = SimpleNamespace(**{**vars(trainer), "logger": empty})
    assert "log_every_n_steps" in summary.draw_loss_curve(none_logged)
    monkeypatch.setattr(plots, "available", lambda: False)
    assert summary.draw_loss_curve(trainer) == "n/a (pip install matplotlib)"
