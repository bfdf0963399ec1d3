"""Expert compute and routing, one process: grouped vs loop experts, training FLOP/s against the
box's matmul peak, and the load balance of the three balancing choices.

    titan bench --routing                 # all three, one thread (the tables of docs/benchmarks.md)
    titan bench --routing --balance-steps 50 --mfu-d-models 64 256

- ``experts_case``: one layer's local experts (``GroupedExperts``) forward + backward on the rows a
  top-2 router sends them, ``torch._grouped_mm`` vs the per-expert loop, same weights.
- ``mfu_case``: the training step one rank runs (``Engine`` forward_backward, clip, AdamW), its model
  FLOPs (``flops.step_flops``) per second over the FLOP/s of a matmul probe in the same process.
- ``balance_case``: 200 steps of the default model on the default data, max/mean load per layer
  (the router's selections) with the aux loss alone, the expert bias alone, or both.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import Tensor

from lightning_titan.model import compiled, flops
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.moe.experts import GroupedExperts
from lightning_titan.model.moe.layer import MoELayer
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups
from lightning_titan.tools.bench import dispatch as dispatch_bench
from lightning_titan.tools.bench.cases import Settings
from lightning_titan.tools.bench.dispatch import _best_ms
from lightning_titan.train.engine import Engine
from lightning_titan.train.step import TrainStep


def experts_case(
    n_experts: int,
    tokens: int,
    d_model: int,
    ffn_dim: int,
    top_k: int,
    repeats: int,
    device: torch.device,
) -> dict:
    """Best-of-N ms of forward + backward of ``n_experts`` experts over ``tokens * top_k`` rows."""
    g = torch.Generator().manual_seed(0)
    ids = torch.rand(tokens, n_experts, generator=g).topk(top_k, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=n_experts).tolist()
    x = torch.randn(tokens * top_k, d_model, generator=g).to(device).requires_grad_()
    grad = torch.randn(tokens * top_k, d_model, generator=g).to(device)
    experts = GroupedExperts(d_model, ffn_dim, (0, n_experts)).to(device)
    row: dict = {"experts": n_experts}
    outputs = {}
    for name, grouped in (("grouped", True), ("loop", False)):
        experts.grouped_mm = grouped
        if grouped and not experts.uses_grouped_mm(x.detach()):
            continue
        outputs[name] = experts(x, counts).detach()
        row[f"{name}_fwd_bwd_ms"] = _best_ms(
            lambda: experts(x, counts).backward(grad), repeats, device
        )
    if "grouped" in outputs:
        torch.testing.assert_close(outputs["grouped"], outputs["loop"], rtol=1e-4, atol=1e-5)
        row["ratio"] = row["loop_fwd_bwd_ms"] / row["grouped_fwd_bwd_ms"]
    return row


def mfu_config(d_model: int) -> ModelConfig:
    """The default model widened: 16-wide heads, experts 2x wide."""
    return ModelConfig(d_model=d_model, n_heads=max(1, d_model // 16), ffn_dim=2 * d_model)


def _train_steps(
    config: ModelConfig,
    batches: Iterator[tuple[Tensor, Tensor]],
    seed: int = 0,
    compile: bool = False,
) -> Iterator[tuple[float, StageModel]]:
    """A generator: one training step of one rank per batch, yielding (seconds, the model);
    ``compile``: the stage compiled as ``TitanLM(compile=True)`` compiles it."""
    model = StageModel(config)
    model.init_weights(seed)
    if compile:
        compiled.compile_stage(model)
    engine = Engine(model, ParallelDims(1, 1, 1, 0), ProcessGroups(None, None, None, None))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    step = TrainStep(engine, optimizer, max_norm=1.0)
    for inputs, targets in batches:
        start = time.perf_counter()
        step.run(model, inputs, targets, 1, model.token_loss_sum)
        yield time.perf_counter() - start, model


def random_batches(config: ModelConfig, batch: int) -> Iterator[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def mfu_case(d_model: int, batch: int = 32, steps: int = 6, warmup: int = 2) -> dict:
    """Model FLOP/s of the single-rank training step (best step) over this process's matmul peak."""
    config = mfu_config(d_model)
    run = _train_steps(config, random_batches(config, batch))
    times = [seconds for seconds, _ in itertools.islice(run, warmup + steps)][warmup:]
    step_flops = flops.step_flops(config, batch * config.seq_len)
    achieved = step_flops / min(times)
    peak = flops.matmul_peak(torch.device("cpu"), torch.float32, seconds=1.0)
    return {
        "d_model": d_model,
        "ffn_dim": config.ffn_dim,
        "n_heads": config.n_heads,
        "tokens": batch * config.seq_len,
        "step_ms": min(times) * 1e3,
        "gflops_per_s": achieved / 1e9,
        "peak_gflops_per_s": peak / 1e9,
        "mfu": achieved / peak,
    }


BALANCING: dict[str, dict[str, float]] = {
    "aux loss alone": {"aux_loss_coef": 0.01, "router_bias_update_rate": 0.0},
    "bias alone": {"aux_loss_coef": 0.0, "router_bias_update_rate": 1e-3},
    "aux loss + bias": {"aux_loss_coef": 0.01, "router_bias_update_rate": 1e-3},
}


def balance_case(name: str, steps: int = 200, batch: int = 16) -> dict:
    """Max/mean expert load per layer of the default model over ``steps`` steps (default data)."""
    from lightning_titan.data import DataPipeline

    choice = BALANCING[name]
    config = replace(
        ModelConfig(),
        aux_loss_coef=choice["aux_loss_coef"],
        router_bias_update_rate=choice["router_bias_update_rate"],
    )
    data = DataPipeline(seq_len=config.seq_len, global_batch_size=batch, val_fraction=0.0)
    data.bind(0, 1).setup("fit")
    batches = itertools.chain.from_iterable(itertools.repeat(data.train_dataloader()))
    ratios = []  # [step][layer]
    for _, model in _train_steps(config, itertools.islice(batches, steps), seed=1234):
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        loads = torch.stack([m.tokens_per_expert.double() for m in layers])
        ratios.append((loads.max(-1).values / loads.mean(-1)).tolist())
    per_layer = torch.tensor(ratios)  # [steps, layers]
    last = per_layer[-50:]
    return {
        "balancing": name,
        "steps": steps,
        "mean_all": per_layer.mean(0).tolist(),
        "mean_last50": last.mean(0).tolist(),
        "worst_last50": last.max(0).values.tolist(),
    }


def markdown(experts: list[dict], mfu: list[dict], balance: list[dict], settings: str) -> str:
    lines = [f"Settings: {settings}", ""]
    if experts:
        lines += [
            "**Grouped vs loop experts** (one layer's experts, forward + backward, best of N)",
            "",
            "| experts | grouped ms | loop ms | loop / grouped |",
            "|---:|---:|---:|---:|",
        ]
        for r in experts:
            grouped = f"{r['grouped_fwd_bwd_ms']:.2f}" if "ratio" in r else "n/a"
            ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "n/a"
            lines.append(f"| {r['experts']} | {grouped} | {r['loop_fwd_bwd_ms']:.2f} | {ratio} |")
    if mfu:
        lines += [
            "",
            "**Single-rank training FLOP/s vs the matmul peak** (model FLOPs, best step)",
            "",
            "| d_model | ffn_dim | heads | tokens/step | step ms | GFLOP/s | peak GFLOP/s "
            "| share of peak |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in mfu:
            lines.append(
                f"| {r['d_model']} | {r['ffn_dim']} | {r['n_heads']} | {r['tokens']} | "
                f"{r['step_ms']:.1f} | {r['gflops_per_s']:.1f} | "
                f"{r['peak_gflops_per_s']:.1f} | {100 * r['mfu']:.0f}% |"
            )
    if balance:
        n_layers = len(balance[0]["mean_all"])
        layers = " | ".join(f"layer {i}" for i in range(n_layers))
        lines += [
            "",
            f"**Load balance** (max/mean load per layer, 1.0 = even; {balance[0]['steps']} "
            "steps of the default model): mean over the last 50 steps (over all steps)",
            "",
            f"| balancing | {layers} |",
            "|---|" + "---:|" * n_layers,
        ]
        for r in balance:
            cells = " | ".join(
                f"{a:.2f} ({b:.2f})" for a, b in zip(r["mean_last50"], r["mean_all"], strict=True)
            )
            lines.append(f"| {r['balancing']} | {cells} |")
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> tuple[str, dict]:
    """``titan bench --routing``: the three benchmarks at one thread; (markdown, results)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.dispatch_threads)
    device = torch.device("cpu")
    experts = [experts_case(e, args.dispatch_tokens, 64, 128, 2, 20, device) for e in (8, 64)]
    mfu = [mfu_case(d) for d in args.mfu_d_models]
    balance = [balance_case(name, args.balance_steps) for name in BALANCING]
    torch.set_num_threads(threads)
    settings = (
        f"one process, {args.dispatch_threads} thread(s), fp32; experts: "
        f"{args.dispatch_tokens} tokens x top-2, d_model 64, ffn 128"
    )
    results = {"settings": settings, "experts": experts, "mfu": mfu, "balance": balance}
    return markdown(experts, mfu, balance, settings), results


def micro_benchmarks(
    args: argparse.Namespace, settings: Settings
) -> tuple[list[dict], str, list[dict]]:
    """One process: vectorised vs loop dispatch, grouped vs loop experts, at E = 8 and 64."""
    tokens = 1024 if args.quick else args.dispatch_tokens
    repeats = 5 if args.quick else 20
    device = torch.device(settings.device)
    # one thread: on a shared box a second thread mostly waits for a preempted core
    threads = torch.get_num_threads()
    torch.set_num_threads(args.dispatch_threads)
    dispatch_settings = f"tokens={tokens}, d_model=64, top_k=2, best of {repeats}, {args.dispatch_threads} thread(s)"
    dispatch_rows = []
    for experts in (8, 64):
        row = dispatch_bench.bench_case(experts, tokens, 64, 2, repeats, device)
        row["experts"] = experts
        row["ratio_fwd"] = row["loop_fwd_ms"] / row["vectorised_fwd_ms"]
        row["ratio_fwd_bwd"] = row["loop_fwd_bwd_ms"] / row["vectorised_fwd_bwd_ms"]
        dispatch_rows.append(row)
    experts_rows = [experts_case(e, tokens, 64, 128, 2, repeats, device) for e in (8, 64)]
    torch.set_num_threads(threads)
    return dispatch_rows, dispatch_settings, experts_rows
