"""Source of 02_pipeline_schedules.ipynb (python examples/notebooks/build.py turns it into the notebook)."""

# %% [markdown]
# # 2. Pipeline schedules: GPipe vs 1F1B, the bubble and the memory
#
# Pipeline parallelism (PP) cuts the model into `P` stages of consecutive layers, one per rank. A
# stage can only start a microbatch once the previous stage has sent its activations, and can only
# run its backward once the next stage has sent the gradient back. To keep stages busy, each step's
# batch is split into `M` **microbatches** that flow through the pipe one after another. The time a
# stage spends waiting at the start and the end of a step is the **bubble**.
#
# Two classic orders of the same work:
#
# - **GPipe**: all `M` forwards, then all `M` backwards (in reverse).
# - **1F1B**: a few warm-up forwards, then alternate one forward / one backward, then drain.
#
# This notebook derives both timelines from the schedule functions themselves, then measures them on 4
# CPU ranks with the `PipelineTimeline` callback, and compares the bubble and the activation memory with
# the formulas as `M` changes. At the end: interleaved 1F1B and ZB-H1, ideal and as the benchmark
# measured them.
#
# **Time:** about a minute on a 2-core laptop CPU (72 s measured on 2 vCPUs).

# %%
import json
import logging
import os
import warnings
from pathlib import Path

import lightning as L
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger

import lightning_titan
from lightning_titan import ModelConfig, TitanDataModule, TitanLM, TitanStrategy
from lightning_titan.lightning import plots
from lightning_titan.lightning.callbacks import PipelineTimeline
from lightning_titan.parallel.pipeline.schedules import gpipe, one_f_one_b
from lightning_titan.parallel.pipeline.theory import ideal_bubble, ideal_spans
from lightning_titan.runtime.saved_tensors import SavedTensorMeter
from lightning_titan.runtime.tracing import theory_bubble

QUICK = os.environ.get("TITAN_NOTEBOOK_QUICK") == "1"  # the test suite sets it: fewer runs
P = 4  # pipeline stages (ranks)
MS = (2, 8) if QUICK else (1, 2, 4, 8, 16)  # microbatch counts to measure
# the two schedules over one chunk per rank compared here (interleaved 1F1B and ZB-H1: concepts.md)
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}
M_SHOW = 8  # the one drawn side by side
MICROBATCH = 2  # sequences per microbatch: the global batch grows with M
RECORD = [1] if QUICK else [2, 3]  # steps the timeline records (after warm-up)
RUNS = Path("runs/02_pipeline_schedules")

# the forked ranks inherit these: keep their output to what matters here
for logger in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(logger).setLevel(logging.ERROR)
warnings.filterwarnings("ignore", ".*(does not have many workers|LeafSpec).*")

# %% [markdown]
# ## The schedules are plain functions
#
# `gpipe(stage, M)` and `one_f_one_b(stage, M)` only decide the *order* of work; the stage object does
# the work. Hand them a stand-in stage that just records what it is asked to compute and we get each
# stage's order of forwards (F) and backwards (B):


# %%
class Recorder:
    """A stand-in stage: records the compute order; sends and receives do nothing."""

    def __init__(self, pp: int, pp_rank: int) -> None:
        self.pp, self.pp_rank, self.ops = pp, pp_rank, []

    def forward(self, i, x):
        self.ops.append(("F", i))

    def backward(self, i, grad):
        self.ops.append(("B", i))

    def recv_forward(self, i):
        return None

    def send_forward(self, i, y):
        pass

    recv_backward, send_backward = recv_forward, send_forward

    def send_forward_recv_backward(self, i, y, j):
        return None

    def send_backward_recv_forward(self, j, dx, i):
        return None


def op_orders(schedule: str, m: int) -> list[list[tuple[str, int]]]:
    orders = []
    for p in range(P):
        stage = Recorder(P, p)
        SCHEDULES[schedule](stage, m)
        orders.append(stage.ops)
    return orders


for schedule in SCHEDULES:
    print(schedule)
    for p, ops in enumerate(op_orders(schedule, 4)):
        print(f"  stage {p}: {' '.join(f'{kind}{i}' for kind, i in ops)}")

# %% [markdown]
# ## The ideal timeline
#
# Give every forward 1 time unit and every backward 2 (a backward computes two gradients), let each op
# start as soon as its stage is free and its input exists (forward `i` needs forward `i` of the previous
# stage; backward `i` needs backward `i` of the next), and the orders above become the textbook
# diagrams. Both schedules have the same bubble,
#
# $$\text{bubble} = \frac{P-1}{M+P-1},$$
#
# because both must fill and drain the pipe once per step. What differs is memory: a stage keeps a
# microbatch's activations from its forward until its backward. GPipe holds all `M`; 1F1B starts
# backwards early, so stage `p` never holds more than `P - p`.


# %%
def simulate(orders, t_forward=1.0, t_backward=2.0):
    """Per stage: [(kind, microbatch, start, end)] with each op as early as its stage and input allow."""
    done, free, nxt = {}, [0.0] * P, [0] * P
    timeline = [[] for _ in range(P)]
    while any(nxt[p] < len(orders[p]) for p in range(P)):
        progressed = False
        for p in range(P):
            if nxt[p] == len(orders[p]):
                continue
            kind, i = orders[p][nxt[p]]
            if kind == "F":
                dep = ("F", p - 1, i) if p > 0 else None
            else:
                dep = ("B", p + 1, i) if p < P - 1 else ("F", p, i)
            if dep is not None and dep not in done:
                continue
            start = max(free[p], done.get(dep, 0.0))
            end = start + (t_forward if kind == "F" else t_backward)
            done[(kind, p, i)] = free[p] = end
            timeline[p].append((kind, i, start, end))
            nxt[p] += 1
            progressed = True
        assert progressed, "the orders deadlock"
    return timeline


def bubbles(timeline) -> list[float]:
    """Per stage: 1 - busy / (first start to last end over all stages)."""
    start = min(op[2] for ops in timeline for op in ops)
    end = max(op[3] for ops in timeline for op in ops)
    return [1 - sum(b - a for _, _, a, b in ops) / (end - start) for ops in timeline]


def live_peak(ops) -> int:
    """Most microbatches whose activations a stage holds at once (forward done, backward not yet)."""
    live = peak = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def draw(ax, timeline, title, unit):
    colors = {"F": "#4C72B0", "B": "#55A868"}
    width = max(end for ops in timeline for *_, end in ops)
    for p, ops in enumerate(timeline):
        for kind, i, start, end in ops:
            ax.barh(
                p, end - start, left=start, color=colors[kind], edgecolor="white", linewidth=0.5
            )
            if end - start > width / 50:  # label only what has room
                ax.text(
                    (start + end) / 2,
                    p,
                    f"{kind}{i}",
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=7,
                )
    ax.set_yticks(range(P), [f"stage {p}" for p in range(P)])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)


fig, axes = plt.subplots(2, 1, figsize=(13, 5), sharex=True)
for ax, schedule in zip(axes, SCHEDULES, strict=True):
    orders = op_orders(schedule, M_SHOW)
    timeline = simulate(orders)
    peaks = [live_peak(ops) for ops in orders]
    draw(ax, timeline, f"{schedule}, ideal (P={P}, M={M_SHOW}): bubble {bubbles(timeline)[0]:.2f}, "
         f"live microbatches per stage {peaks}", "time units")  # fmt: skip
plt.tight_layout()
plt.show()

# %% [markdown]
# Check both claims for every `M` we will measure, straight from the schedule functions:

# %%
for schedule in SCHEDULES:
    for m in MS:
        orders = op_orders(schedule, m)
        assert np.allclose(bubbles(simulate(orders)), theory_bubble(P, m)), (schedule, m)
        expected = [m] * P if schedule == "gpipe" else [min(m, P - p) for p in range(P)]
        assert [live_peak(ops) for ops in orders] == expected, (schedule, m)
print("ideal bubble == (P-1)/(M+P-1); live microbatches: gpipe M, 1f1b min(M, P - p)")

# %% [markdown]
# ## Measured on 4 CPU ranks
#
# Now the real thing: `TitanStrategy(dp=1, pp=4, ep=1, schedule=..., num_microbatches=M)` trains the
# default model (4 layers: one per stage) for a few steps in forked processes. Two callbacks watch:
#
# - `PipelineTimeline` (from `lightning_titan.lightning.callbacks`) records every rank's forwards, backwards and
#   sends/receives during the chosen steps and writes `trace.json` (open it in
#   [ui.perfetto.dev](https://ui.perfetto.dev)), `timeline.png` and `bubbles.json` with the measured
#   bubble per stage next to the formula, in the run's log folder beside `metrics.csv`;
# - `ActivationPeak`, below, counts the bytes autograd keeps for backward on each rank
#   (`SavedTensorMeter`: every saved storage once, parameters excluded) and logs the peak of each step.
#
# The microbatch stays 2 sequences, so a larger `M` is a larger batch.
#
# A caveat for reading the numbers: on a laptop or a small CI box, 4 ranks share 2 CPU cores. A stage
# computing beside three others runs slower than one computing alone, a rank that waits in a receive may
# not be scheduled the moment its data arrives, and the first and last stages do more work (embedding;
# LM head and loss). So the measured bubble sits above the formula. `bubbles.json` says how much of it
# each cause explains: the bubble *with free send/recv* (`compute_only`: the recorded forwards and
# backwards, each stage in its recorded order, re-timed as if communication cost nothing: stage imbalance
# and jitter), and the same with every forward and backward at its stage's median length
# (`steady_compute`: stage imbalance alone). The difference between the measured bubble and
# `compute_only` is time spent in (or waiting for) sends and receives.


# %%
class ActivationPeak(L.Callback):
    """Log each rank's peak bytes saved for backward during a training step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.meter = SavedTensorMeter(exclude=pl_module.parameters()).__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.meter.__exit__(None, None, None)
        peaks = torch.zeros(trainer.world_size, dtype=torch.float64)
        peaks[trainer.global_rank] = self.meter.peak
        dist.all_reduce(peaks)  # every rank logs the same keys
        pl_module.log_dict(
            {f"activation_peak_rank{r}": peak for r, peak in enumerate(peaks.tolist())}
        )


MODEL = ModelConfig()


def measure(schedule: str, m: int) -> Path:
    name = f"{schedule}_m{m}"
    trainer = L.Trainer(
        accelerator="cpu", devices=P, max_steps=RECORD[-1] + 1,
        strategy=TitanStrategy(dp=1, pp=P, ep=1, schedule=schedule, num_microbatches=m, start_method="fork"),
        callbacks=[PipelineTimeline(steps=RECORD), ActivationPeak()],
        logger=CSVLogger(RUNS, name=name, version=0), log_every_n_steps=1, limit_val_batches=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TitanDataModule(seq_len=MODEL.seq_len, global_batch_size=MICROBATCH * m)
    trainer.fit(TitanLM(MODEL), datamodule=data)
    return RUNS / name


runs = {(schedule, m): measure(schedule, m) for schedule in SCHEDULES for m in MS}
print("\n".join(str(path) for path in runs.values()))

# %% [markdown]
# ### The measured timelines, side by side
#
# Read back from each run's `trace.json`: the last recorded step, one row per stage, forwards blue,
# backwards green, time in sends and receives as thin grey bars (that is where the bubble is spent).


# %%
def measured_timeline(run: Path):
    events = json.loads((run / "version_0" / "timeline" / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    last = max(e["args"]["step"] for e in spans)
    spans = [e for e in spans if e["args"]["step"] == last]
    t0 = min(e["ts"] for e in spans)
    compute = [[] for _ in range(P)]
    waits = [[] for _ in range(P)]
    for e in spans:
        start, end = (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3
        if e["cat"] in ("forward", "backward"):
            compute[e["pid"]].append(
                ("F" if e["cat"] == "forward" else "B", e["args"].get("mb"), start, end)
            )
        elif e["cat"] == "p2p":
            waits[e["pid"]].append((start, end))
    return compute, waits


fig, axes = plt.subplots(2, 1, figsize=(13, 5))
for ax, schedule in zip(axes, SCHEDULES, strict=True):
    compute, waits = measured_timeline(runs[(schedule, M_SHOW)])
    for p, spans in enumerate(waits):
        for start, end in spans:
            ax.barh(p, end - start, left=start, height=0.25, color="#B0B0B0")
    step_ms = max(end for ops in compute for *_, end in ops)
    draw(
        ax, compute, f"{schedule}, measured (P={P}, M={M_SHOW}): one step in {step_ms:.0f} ms", "ms"
    )
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Bubble and memory as `M` changes
#
# Left: the bubble (mean over stages, from `bubbles.json`) against `(P-1)/(M+P-1)`. Middle and right:
# the activation peak of each stage. GPipe's grows with `M` on every stage; 1F1B's stops growing at `P - p`
# microbatches. That is the point of 1F1B: raise `M` to shrink the bubble without paying for it in memory.


# %%
def bubble_summary(run: Path) -> list[dict]:
    return json.loads((run / "version_0" / "timeline" / "bubbles.json").read_text())["bubbles"]


def activation_peaks(run: Path) -> list[float]:
    metrics = pd.read_csv(run / "version_0" / "metrics.csv").dropna(
        subset=["activation_peak_rank0"]
    )
    return [metrics[f"activation_peak_rank{p}"].iloc[-1] for p in range(P)]  # rank p = stage p here


fig, (ax_bubble, *axes_memory) = plt.subplots(1, 3, figsize=(16, 4))
axes_memory[1].sharey(axes_memory[0])
ms = np.array(MS)
grid = np.linspace(1, max(MS), 100)
ax_bubble.plot(grid, [theory_bubble(P, m) for m in grid], color="black", label="(P-1)/(M+P-1)")
for color, schedule in zip(("C0", "C1"), SCHEDULES, strict=True):
    summaries = [bubble_summary(runs[(schedule, m)]) for m in MS]
    measured = [np.mean([b["measured"] for b in summary]) for summary in summaries]
    compute_only = [np.mean([b["compute_only"] for b in summary]) for summary in summaries]
    ax_bubble.plot(ms, measured, "o-", color=color, label=f"{schedule}, measured")
    ax_bubble.plot(
        ms, compute_only, "o--", color=color, mfc="none", label=f"{schedule}, free send/recv"
    )
ax_bubble.set_xscale("log", base=2)
ax_bubble.set_xlabel("microbatches M")
ax_bubble.set_ylabel("bubble (idle fraction of a step)")
ax_bubble.legend()

for ax, schedule in zip(axes_memory, SCHEDULES, strict=True):
    peaks = np.array([activation_peaks(runs[(schedule, m)]) for m in MS]) / 2**20
    for p in range(P):
        ax.plot(ms, peaks[:, p], "o-", color=f"C{p}", label=f"stage {p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches M")
    ax.set_title(f"{schedule}: activation peak per stage", fontsize=10)
    ax.legend(fontsize=8)
axes_memory[0].set_ylabel("saved for backward (MiB)")
plt.show()

for schedule in SCHEDULES:
    for m in MS:
        summary = bubble_summary(runs[(schedule, m)])
        measured = " ".join(f"{b['measured']:.2f}" for b in summary)
        compute_only = " ".join(f"{b['compute_only']:.2f}" for b in summary)
        steady = " ".join(f"{b['steady_compute']:.2f}" for b in summary)
        print(f"{schedule:>5} M={m:>2}: theory {theory_bubble(P, m):.2f} | per stage: measured {measured}"
              f" | free send/recv {compute_only} | steady compute {steady}")  # fmt: skip

# %% [markdown]
# The memory claim holds in bytes, not just in the diagram: a stage's peak under 1F1B is its GPipe peak
# scaled by `min(M, P - p) / M` (GPipe keeps all `M` microbatches, each the same size).

# %%
for m in MS:
    gpipe, one_f_one_b = activation_peaks(runs[("gpipe", m)]), activation_peaks(runs[("1f1b", m)])
    for p in range(P):
        expected = gpipe[p] * min(m, P - p) / m
        assert abs(one_f_one_b[p] - expected) <= 0.05 * expected, (m, p, one_f_one_b[p], expected)
print("1F1B peak == GPipe peak * min(M, P - p) / M on every stage, for M in", MS)

# %% [markdown]
# ## Interleaved 1F1B, ZB-H1 and ZBV
#
# Three more orders of the same work, for the bubble that 1F1B leaves:
#
# - **Interleaved 1F1B** (`TitanStrategy(schedule="interleaved_1f1b", virtual_stages=v)`): each rank
#   holds `v` chunks of layers (rank `p` holds virtual stages `p`, `p + P`, ...), so a microbatch goes
#   round the ring of ranks `v` times and the fill and drain take `1/v` as long:
#   bubble `(P-1)/(v*M+P-1)`, for `v` times as many messages and more activations in flight.
# - **ZB-H1** (`schedule="zb_h1"`): each backward is split into B (the input grad, sent upstream at
#   once) and W (the weight grads, deferred); stage `p` defers its W's by `p` backwards, so they fill the
#   cooldown where 1F1B waits. With F = B = W the bubble is `(P-1)/(3M+P-1)`.
# - **ZBV** (`schedule="zbv", virtual_stages=2`): the same split over two chunks per rank laid out as
#   a V (rank `r` holds virtual stages `r` and `2P-1-r`, so rank 0 embeds and also runs the head and
#   the loss). The turn of the V needs no message, and once `M >= 2P-1` the bubble is
#   `(P-1)/(6M+P-1)`, for 1F1B's first-stage memory on every rank.
#
# Their ideal timelines come from the schedule functions the same way as above
# (`lightning_titan.tools.bench.schedule_report`: a stand-in stage records the order; F 1, B 2, zero-bubble
# B 1 + W 1; each chunk `1/v` of a stage), drawn by the Gantt chart the benchmark uses
# (`F3.1`: forward of microbatch 3 in chunk 1; time in units of one forward of a stage):

# %%
RUNS.mkdir(parents=True, exist_ok=True)
MORE = {"1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zbv": 2}  # schedule -> chunks per rank
fig, axes = plt.subplots(len(MORE), 1, figsize=(13, 3 * len(MORE)))
for ax, (schedule, v) in zip(axes, MORE.items(), strict=True):
    path = RUNS / f"ideal_{schedule}.png"
    bubble = ideal_bubble(schedule, P, v, M_SHOW)
    plots.plot_gantt(ideal_spans(schedule, P, v, M_SHOW), path,
                     title=f"{schedule}, ideal (P={P}, M={M_SHOW}, v={v}): bubble {bubble:.3f}")  # fmt: skip
    ax.imshow(plt.imread(path))
    ax.axis("off")
plt.tight_layout()
plt.show()

for m in (4, 8, 16):
    assert np.isclose(ideal_bubble("interleaved_1f1b", P, 2, m), (P - 1) / (2 * m + P - 1))
    assert ideal_bubble("zb_h1", P, 1, m) < ideal_bubble("1f1b", P, 1, m)
for m in (8, 16):  # the V is full from M = 2P - 1 on
    assert np.isclose(ideal_bubble("zbv", P, 2, m), (P - 1) / (6 * m + P - 1))
    assert ideal_bubble("zbv", P, 2, m) < ideal_bubble("zb_h1", P, 1, m)
print("ideal bubble: interleaved (P-1)/(v*M+P-1); zb_h1 below 1f1b; zbv (P-1)/(6M+P-1) below zb_h1")

# %% [markdown]
# ### Measured: `titan bench --schedules`
#
# The benchmark runs each schedule on pp2 and pp4 (8 layers, so pp4 x v2 has a layer per virtual
# stage) beside torch.distributed.pipelining's schedule over the same stage modules, and reports the
# bubble per stage (measured, and replayed with free send/recv), the activations per stage against the
# schedule's theory, and the step time against torch's (docs/benchmarks.md, "Pipeline schedules").
# These are its measured timelines on a shared 2-core box, committed under `docs/benchmarks/`:

# %%
DOCS = Path(lightning_titan.__file__).resolve().parents[1] / "docs" / "benchmarks"
measured = [DOCS / f"pp4_{name}.png" for name in ("1f1b", "interleaved_1f1b_v2", "zb_h1", "zbv")]
if all(path.exists() for path in measured):
    fig, axes = plt.subplots(len(measured), 1, figsize=(13, 3.2 * len(measured)))
    for ax, path in zip(axes, measured, strict=True):
        ax.imshow(plt.imread(path))
        ax.axis("off")
    plt.tight_layout()
    plt.show()
else:  # an installed package without the repository's docs
    print(f"no measured timelines under {DOCS}: run titan bench --schedules --out bench_out")
