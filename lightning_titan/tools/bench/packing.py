"""Packed documents: what the per-document attention costs, and how full the packed windows are.

    titan bench --packing                       # the default model, seq_len 256 and 1024, 5 rounds
    titan bench --packing --rounds 9

The mask's cost: one process trains the default model on the same tokens at each sequence length,
once as one document a sequence (causal attention) and once cut into documents (about four a
sequence: block-diagonal causal attention, positions restarting per document), steps alternating;
the ratio documents / causal is paired per round. The windows' fill: records of a skewed length
distribution (log-normal, median a tenth of the window) laid into windows by the packer
(``data/records.pack_records``, in order) against one record a window.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from lightning_titan.data.records import pack_records
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups
from lightning_titan.tools.bench.paired import compare, mark
from lightning_titan.tools.bench.runners import TitanRunner

SEQ_LENS = (256, 1024)
TOKENS = 2048  # a step's tokens at every sequence length
DOCUMENTS = 4  # about this many a sequence
TARGET = 1.10  # documents / causal step time, at most
RECORDS = 2000


def _mask_cost(config: ModelConfig, rounds: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    dims, groups = ParallelDims(1, 1, 1, 0), ProcessGroups(None, None, None, None)
    runner = TitanRunner(
        config, dims, groups, torch.device("cpu"), schedule="1f1b", num_microbatches=1
    )
    b, s = TOKENS // config.seq_len, config.seq_len
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (b, s + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    documents = (torch.rand(b, s, generator=g) < DOCUMENTS / s).long().cumsum(1)

    def timed(docs: torch.Tensor | None) -> float:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            runner.train_step.run(
                runner.model, inputs, targets, 1, runner.model.token_loss_sum, documents=docs
            )
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    timed(None), timed(documents)  # warm-up
    rows = [{"causal": timed(None), "documents": timed(documents)} for _ in range(rounds)]
    runner.close()
    ratio, medians = compare(rows, "documents", "causal")
    return {
        "seq_len": s,
        "median_ms": medians,
        "ratio": ratio.cell,
        "met": ratio.at_most(TARGET),
        "documents_per_sequence": float(documents.max(dim=1).values.float().mean() + 1),
    }


def _fill(window: int) -> dict[str, Any]:
    """The share of the windows' tokens that are records', packed and one record a window."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(window / 10), 1.0, RECORDS).astype(int), 2, window)
    records = [(np.zeros(n, np.int64), np.zeros(n, np.int64)) for n in lengths]
    packed = pack_records(records, window, pad_id=0)
    tokens = int(lengths.sum())
    return {
        "window": window,
        "records": RECORDS,
        "mean_length": float(lengths.mean()),
        "packed": tokens / (len(packed) * window),
        "one_a_window": tokens / (RECORDS * window),
    }


def run(
    config: ModelConfig, global_batch: int, rounds: int, steps: int, timeout_s: float
) -> dict[str, Any]:
    """``global_batch`` and ``timeout_s`` are the suite's: one process, fixed tokens per step here."""
    costs = [_mask_cost(replace(config, seq_len=s), rounds, steps) for s in SEQ_LENS]
    return {"mask_cost": costs, "fill": [_fill(s + 1) for s in SEQ_LENS]}


def markdown(result: dict[str, Any], command: str, machine: str) -> str:
    cost_rows = [
        f"| {c['seq_len']} | {c['documents_per_sequence']:.1f} | {c['median_ms']['causal']:.0f} | "
        f"{c['median_ms']['documents']:.0f} | {c['ratio']} | {mark(c['met'])} |"
        for c in result["mask_cost"]
    ]
    fill_rows = [
        f"| {f['window']} | {f['records']} | {f['mean_length']:.0f} | {f['one_a_window']:.1%} | "
        f"{f['packed']:.1%} |"
        for f in result["fill"]
    ]
    return "\n".join([
        f"`{command}`", "", machine, "",
        f"| seq_len | documents a sequence | causal step (ms) | documents step (ms) | "
        f"documents / causal | <= {TARGET:.2f} |",
        "|---|---|---|---|---|---|", *cost_rows, "",
        "| window | records | mean length | one record a window | packed in order |",
        "|---|---|---|---|---|", *fill_rows, "",
        f"{TOKENS} tokens a step, one process; medians of the rounds, the ratio paired per round "
        "with its 90 % interval in brackets. Record lengths log-normal (median a tenth of the "
        "window, sigma 1), clipped to the window.",
    ])  # fmt: skip
