"""What ZeRO's collectives cost against the all-reduce they replace, on this machine's backend.

    python -m lightning_titan.tools.bench.collectives --worlds 2 4 --mb 4 16

ZeRO-1 adds a parameter all-gather to zero=0's gradient all-reduce; ZeRO-2 replaces the all-reduce
with a reduce-scatter and adds the same all-gather. On NCCL a ring reduce-scatter plus all-gather
moves what one ring all-reduce moves, so ZeRO costs about nothing; this table says what they cost
here. Prints best-of-N ms per collective on one flat fp32 buffer of each size (a gradient bucket)
and the ratios against the all-reduce in the same run: torch's ``reduce_scatter_single`` (on gloo an
all-reduce of a copy) and ``all_gather_into_tensor`` (on gloo a gather into a fresh flat buffer and
a copy out) beside ours (``lightning_titan.parallel.collectives``: on gloo one all-to-all and a local sum;
one broadcast per rank into its chunk), which ZeRO uses.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_titan.parallel import collectives
from lightning_titan.runtime.launch import run_on_ranks

KINDS = (
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter (ours)",
    "all_gather",
    "all_gather (ours)",
    "both ours",
)


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):  # warm-up: gloo's connections and buffers
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)  # best of N: other load on the machine only ever adds time


def _timings(n: int, world: int, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` ms of each kind on an ``n``-element buffer (``n`` divisible by ``world``)."""
    grads, shard, full = torch.randn(n), torch.empty(n // world), torch.empty(n)

    def reduce_scatter() -> None:
        dist.reduce_scatter_single(shard, grads)

    def all_gather() -> None:
        dist.all_gather_single(full, shard)

    def ours() -> None:
        collectives.reduce_scatter(shard, grads, None)

    def gather_ours() -> None:
        collectives.all_gather_(full, None)

    def both() -> None:
        ours()
        gather_ours()

    ops = {
        "all_reduce": lambda: dist.all_reduce(grads),
        "reduce_scatter": reduce_scatter,
        "reduce_scatter (ours)": ours,
        "all_gather": all_gather,
        "all_gather (ours)": gather_ours,
        "both ours": both,
    }
    return {k: _best_ms(op, repeats) for k, op in ops.items()}


def _on_rank(rank: int, world: int, sizes_mb: list[float], repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    return [
        {"world": world, "mb": mb, **_timings(int(mb * 1e6 / 4) // world * world, world, repeats)}
        for mb in sizes_mb  # fp32 elements, a whole number of shards
    ]


def measure(worlds: list[int], sizes_mb: list[float], repeats: int = 10) -> list[dict]:
    """Rank 0's best-of-``repeats`` ms per collective kind, per world size and buffer size."""
    return [row for w in worlds for row in run_on_ranks(_on_rank, w, sizes_mb, repeats)[0]]


def markdown(rows: list[dict], backend: str = "gloo") -> list[str]:
    lines = [
        f"**Collectives** ({backend}, one flat fp32 buffer, best of N ms on rank 0): what ZeRO "
        "adds to (zero=1: + our all-gather) or puts in place of (zero=2: our reduce-scatter + our "
        "all-gather) zero=0's all-reduce",
        "",
        "| ranks | MB | "
        + " | ".join(f"{k} ms" for k in KINDS)
        + " | zero=1 comm / zero=0 | zero=2 comm / zero=0 |",
        "|---:|---:|" + "---:|" * (len(KINDS) + 2),
    ]
    for r in rows:
        ar = r["all_reduce"]
        cells = " | ".join(f"{r[k]:.2f}" for k in KINDS)
        zero1 = (ar + r["all_gather (ours)"]) / ar
        zero2 = r["both ours"] / ar
        lines.append(f"| {r['world']} | {r['mb']:g} | {cells} | {zero1:.2f}x | {zero2:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mb", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    print("\n".join(markdown(measure(args.worlds, args.mb, args.repeats))))


if __name__ == "__main__":
    main()
