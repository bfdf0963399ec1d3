"""How long a checkpoint save blocks training: written at once vs in the background, paired rounds.

    titan bench --checkpoint                    # dp2 x pp2 x ep2, the default model, 5 rounds
    titan bench --checkpoint --rounds 7 --d-model 256

Each round, on every rank: ``steps`` training steps (the quiet step time), a synchronous save, then a
background save followed by ``steps`` training steps while the thread writes and the wait for it. The
loop is blocked for the save call plus that wait; the round's number is the slowest rank's (the next
step's collectives wait for it). The ratio blocked / synchronous is paired per round. The steps run
while the thread writes show what the writer costs training on these cores (it shares them).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_titan.checkpoint import BackgroundSaves, save_sharded
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.mesh import ParallelDims, build_process_groups
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.tools.bench.paired import Ratio, mark
from lightning_titan.tools.bench.runners import TitanRunner

LAYOUT = {"dp": 2, "pp": 2, "ep": 2}
TARGET = 0.20  # blocked at most this share of a synchronous save


def _worker(
    rank: int, world: int, config: ModelConfig, global_batch: int, rounds: int, steps: int, out: str
) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    dims = ParallelDims(**LAYOUT, rank=rank)
    runner = TitanRunner(
        config, dims, build_process_groups(dims), torch.device("cpu"), schedule="1f1b",
        num_microbatches=2 * dims.pp,
    )  # fmt: skip
    b = global_batch // dims.data_world
    g = torch.Generator().manual_seed(dims.data_rank)
    tokens = torch.randint(0, config.vocab_size, (b, config.seq_len + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])

    def timed_steps() -> list[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            runner.step(*batch)
            times.append(time.perf_counter() - start)
        return times

    def save(name: str, saves: BackgroundSaves | None) -> float:
        dist.barrier()
        start = time.perf_counter()
        save_sharded(Path(out) / name, runner.model, [runner.optimizer], {}, layout=LAYOUT,
                     background=saves)  # fmt: skip
        return time.perf_counter() - start

    saves, rows = BackgroundSaves(), []
    timed_steps()  # warm-up: the optimizer state exists, the allocator is warm
    save("warmup.ckpt", saves)  # the writer's group and host buffers exist
    saves.wait()
    for _ in range(rounds):
        quiet = timed_steps()
        sync_s = save("sync.ckpt", None)
        blocked_s = save("async.ckpt", saves)
        during = timed_steps()
        start = time.perf_counter()
        saves.wait()
        waited_s = time.perf_counter() - start
        rows.append({
            "sync_ms": sync_s * 1e3, "call_ms": blocked_s * 1e3, "wait_ms": waited_s * 1e3,
            "blocked_ms": (blocked_s + waited_s) * 1e3, "write_ms": saves.seconds * 1e3,
            "quiet_step_ms": statistics.median(quiet) * 1e3,
            "during_step_ms": statistics.median(during) * 1e3,
        })  # fmt: skip
    runner.close()
    return rows


def run(
    config: ModelConfig, global_batch: int, rounds: int, steps: int, timeout_s: float
) -> dict[str, Any]:
    """Every rank's rounds, the slowest rank's per round, and the paired ratio blocked / sync."""
    with tempfile.TemporaryDirectory(prefix="titan-bench-ckpt-") as out:
        per_rank = run_on_ranks(
            _worker, 8, config, global_batch, rounds, steps, out, timeout_s=timeout_s
        )
    keys = per_rank[0][0].keys()
    slowest = [{k: max(r[i][k] for r in per_rank) for k in keys} for i in range(rounds)]
    sync = {"rounds_ms": [r["sync_ms"] for r in slowest]}
    blocked = {"rounds_ms": [r["blocked_ms"] for r in slowest]}
    during = {"rounds_ms": [r["during_step_ms"] for r in slowest]}
    quiet = {"rounds_ms": [r["quiet_step_ms"] for r in slowest]}
    ratio, steps_ratio = Ratio.of(blocked, sync), Ratio.of(during, quiet)
    medians = {k: statistics.median(r[k] for r in slowest) for k in keys}
    return {
        "rounds": slowest, "median": medians, "blocked_over_sync": ratio.cell,
        "met": ratio.at_most(TARGET), "during_over_quiet": steps_ratio.cell,
    }  # fmt: skip


def markdown(result: dict[str, Any], command: str, machine: str) -> str:
    m = result["median"]
    return "\n".join([
        f"`{command}`", "", machine, "",
        "| dp2 x pp2 x ep2 | synchronous save | background save |", "|---|---|---|",
        f"| training blocked (slowest rank, ms) | {m['sync_ms']:.0f} | {m['blocked_ms']:.1f} "
        f"(call {m['call_ms']:.1f} + wait {m['wait_ms']:.1f}) |",
        f"| written in (ms) | {m['sync_ms']:.0f} | {m['write_ms']:.0f}, in the background |",
        f"| step time (ms) | {m['quiet_step_ms']:.0f} | {m['during_step_ms']:.0f} while writing |",
        "",
        f"Blocked / synchronous: {result['blocked_over_sync']} (target <= {TARGET:.2f}: "
        f"{mark(result['met'])}); a step while the thread writes / a quiet step: "
        f"{result['during_over_quiet']}. Medians of {len(result['rounds'])} rounds; ratios paired "
        "per round, 90 % interval in brackets.",
    ])  # fmt: skip
