"""LoRA against a full fine-tune of the same model: trained parameters, state bytes, step time.

    titan bench --lora --d-model 256 --ffn-dim 512 --rounds 7   # one process
    titan bench --lora --d-model 256 --lora-layout ep2          # two ranks, ep2

On every rank, two runners of the same model and batches: the full fine-tune (every weight trains)
and LoRA (``rank`` 16 on the attention projections and the routed experts; the base frozen). Each
round times ``steps`` steps of one, then of the other; the round's number is the slowest rank's,
and the ratio LoRA / full is paired per round. The state table is one rank's bytes (the
``state_bytes`` the planner is held to). One process by default: on two CPU ranks sharing two
cores the step is mostly the ranks' exchanges and waits, which LoRA does not change.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.model.lora import LoRA
from lightning_titan.parallel.mesh import ParallelDims, build_process_groups
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.tools.bench.memory import state_bytes
from lightning_titan.tools.bench.paired import compare, mark
from lightning_titan.tools.bench.runners import TitanRunner

LAYOUTS = {"single": {"dp": 1, "pp": 1, "ep": 1}, "ep2": {"dp": 1, "pp": 1, "ep": 2}}
ADAPTERS = LoRA(rank=16, alpha=32.0, targets=("attention", "experts"))
TARGET = 0.80  # LoRA's step at most this share of the full fine-tune's (no base weight grads)


def _worker(
    rank: int,
    world: int,
    config: ModelConfig,
    global_batch: int,
    rounds: int,
    steps: int,
    layout: dict[str, int],
) -> dict[str, Any]:
    torch.set_num_threads(1)
    dims = ParallelDims(**layout, rank=rank)
    groups = build_process_groups(dims)
    runners = {
        name: TitanRunner(
            config,
            dims,
            groups,
            torch.device("cpu"),
            schedule="1f1b",
            num_microbatches=1,
            lora=lora,
        )  # fmt: skip
        for name, lora in (("full", None), ("lora", ADAPTERS))
    }
    b = global_batch // dims.data_world
    g = torch.Generator().manual_seed(dims.data_rank)
    tokens = torch.randint(0, config.vocab_size, (b, config.seq_len + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])

    def timed(name: str) -> float:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            runners[name].step(*batch)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    for name in runners:  # warm-up: the optimizer state exists, the allocator is warm
        timed(name)
    rows = [{name: timed(name) for name in runners} for _ in range(rounds)]
    state = {}
    for name, runner in runners.items():
        bytes_ = state_bytes(runner.model, runner.optimizer, runner.engine)
        trained = sum(p.numel() for p in runner.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in runner.model.parameters())
        state[name] = {**bytes_, "trained": trained, "total": total}
        runner.close()
    return {"rounds": rows, "state": state}


def run(
    config: ModelConfig,
    global_batch: int,
    rounds: int,
    steps: int,
    timeout_s: float,
    layout: str = "single",
) -> dict[str, Any]:
    """The slowest rank's step per round for each, the paired ratio LoRA / full, rank 0's state."""
    degrees = LAYOUTS[layout]
    world = degrees["dp"] * degrees["pp"] * degrees["ep"]
    per_rank = run_on_ranks(
        _worker, world, config, global_batch, rounds, steps, degrees, timeout_s=timeout_s
    )
    slowest = [
        {k: max(r["rounds"][i][k] for r in per_rank) for k in ("full", "lora")}
        for i in range(rounds)
    ]
    ratio, medians = compare(slowest, "lora", "full")
    return {
        "rounds": slowest,
        "median_ms": medians,
        "lora_over_full": ratio.cell,
        "met": ratio.at_most(TARGET),
        "state": per_rank[0]["state"],
        "layout": layout,
        "config": {
            "d_model": config.d_model,
            "ffn_dim": config.ffn_dim,
            "n_experts": config.n_experts,
            "seq_len": config.seq_len,
        },  # fmt: skip
    }


def markdown(result: dict[str, Any], command: str, machine: str) -> str:
    full, lora = result["state"]["full"], result["state"]["lora"]

    def mib(part: dict, kind: str) -> str:
        return f"{(part[f'expert_{kind}'] + part[f'non_expert_{kind}']) / 2**20:.2f}"

    rows = [
        f"| trained parameters | {full['trained']:,} | {lora['trained']:,} "
        f"({lora['trained'] / lora['total']:.2%} of {lora['total']:,}) |",
        *(
            f"| {kind} (MiB, rank 0) | {mib(full, kind)} | {mib(lora, kind)} |"
            for kind in ("params", "grads", "optimizer")
        ),
        f"| step (ms, slowest rank) | {result['median_ms']['full']:.0f} | "
        f"{result['median_ms']['lora']:.0f} |",
    ]
    return "\n".join([
        f"`{command}`", "", machine, "",
        f"| {result['layout']}, {ADAPTERS.targets} rank {ADAPTERS.rank} | full fine-tune | LoRA |",
        "|---|---|---|", *rows, "",
        f"LoRA / full step time: {result['lora_over_full']} (target <= {TARGET:.2f}: "
        f"{mark(result['met'])}). Medians of {len(result['rounds'])} rounds; ratio paired per "
        "round, 90 % interval in brackets.",
    ])  # fmt: skip
