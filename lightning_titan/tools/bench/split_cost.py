"""What the zero-bubble schedules' backward split costs against one whole backward, and what ZB-H1
can buy over 1F1B with the stages' measured lengths.

    python -m lightning_titan.tools.bench.split_cost --d-model 64 256

Both stages of pp2 (``--n-layers`` in all, half on each; the first embeds, the last runs the head)
on ``--batch`` sequences, one thread: the median over ``--repeats`` microbatches of a forward, a whole
backward, B (the input grad, ``backward_split.split``) and W (``WeightGrads.run``), and the last
stage's (B + W) / whole. ZB-H1 and ZBV pay that ratio on every microbatch of every stage but the
first (whose B is empty: all its backward is W); what they save is the bubble.

The second table replays 1F1B and ZB-H1 on pp2 at ``--microbatches`` with those lengths and free
transfers (``pipeline.theory.ideal_spans``): the step and each stage's bubble, and ZB-H1 again with a
free split (the last stage's W = whole - B), the most the schedule can buy at this size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.pipeline import backward_split
from lightning_titan.parallel.pipeline.theory import ideal_spans
from lightning_titan.runtime import tracing


def measure(
    d_model: int, n_layers: int = 8, batch: int = 4, repeats: int = 20, pp_rank: int = 1
) -> dict[str, float]:
    """Median ms of a forward, a whole backward, B and W on stage ``pp_rank`` of pp2 (grads
    accumulate over the microbatches and are cleared every 4, as steps would). The first stage's B
    is empty and its W is the whole backward, as ``PipelineStage.backward_input`` runs them."""
    config = ModelConfig(d_model=d_model, ffn_dim=2 * d_model, n_layers=n_layers)
    model = StageModel(config, pp_rank=pp_rank, pp=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g)
    x0 = torch.randn(batch, config.seq_len, d_model, generator=g)
    grad_out = torch.randn(batch, config.seq_len, d_model, generator=g)
    params = list(model.parameters())

    def objective() -> tuple[torch.Tensor | None, torch.Tensor, float]:
        x = None if pp_rank == 0 else x0.clone().requires_grad_()
        start = time.perf_counter()
        out, aux = model(ids if x is None else x)
        if pp_rank == 0:  # the surrogate that gives the output the grad from the next stage
            loss = (out * grad_out).sum() + aux.sum()
        else:
            loss = F.cross_entropy(out.flatten(0, 1).float(), ids.flatten()) + aux.sum()
        return x, loss, time.perf_counter() - start

    times: dict[str, list[float]] = {"F": [], "whole": [], "B": [], "W": []}
    for i in range(repeats + 4):  # the first 4 warm up
        _, loss, forward = objective()
        start = time.perf_counter()
        loss.backward()
        whole = time.perf_counter() - start
        x, loss, _ = objective()
        start = time.perf_counter()
        if x is None:
            middle = time.perf_counter()
            loss.backward()
        else:
            _, weights = backward_split.split(loss, x, params)
            middle = time.perf_counter()
            weights.run()
        end = time.perf_counter()
        if i >= 4:
            for key, value in (
                ("F", forward),
                ("whole", whole),
                ("B", middle - start),
                ("W", end - middle),
            ):
                times[key].append(value)
        if i % 4 == 3:
            model.zero_grad(set_to_none=True)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["ratio"] = (out["B"] + out["W"]) / out["whole"]
    return out


def replay(stages: list[dict[str, float]], m: int) -> dict[str, tuple[float, list[float]]]:
    """(step ms, each stage's bubble) of 1F1B and ZB-H1 on pp2 with the measured lengths and free
    transfers, and of ZB-H1 with a free split (each stage's W = its whole backward - B)."""
    measured = [{"F": s["F"], "B": s["whole"], "B_input": s["B"], "W": s["W"]} for s in stages]
    free = [dict(c, W=s["whole"] - s["B"]) for c, s in zip(measured, stages, strict=True)]
    out = {}
    for name, schedule, costs in (
        ("1f1b", "1f1b", measured),
        ("zb_h1", "zb_h1", measured),
        ("zb_h1, free split", "zb_h1", free),
    ):
        spans = ideal_spans(schedule, len(stages), 1, m, costs)
        step_ms = (max(s.end_ns for s in spans) - min(s.start_ns for s in spans)) / 1e6
        bubbles = tracing.measure_bubbles(spans, [list(range(len(stages)))])
        out[name] = (step_ms, [b.measured for b in bubbles])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=8, help="M of the replay")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {
        d: [measure(d, args.n_layers, args.batch, args.repeats, p) for p in (0, 1)]
        for d in args.d_model
    }
    print("| d_model | stage | F ms | whole backward ms | B ms | W ms | (B + W) / whole |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for d, stages in results.items():
        for p, r in enumerate(stages):
            print(
                f"| {d} | {p} | {r['F']:.2f} | {r['whole']:.2f} | {r['B']:.2f} | {r['W']:.2f} | "
                f"{r['ratio']:.2f}x |"
            )
    print(
        f"\nReplayed on pp2, M = {args.microbatches}, free transfers (bubble: stage 0 / stage 1):\n"
    )
    print("| d_model | schedule | step ms | bubble | step / 1F1B's |")
    print("|---:|---|---:|---|---:|")
    for d, stages in results.items():
        rows = replay(stages, args.microbatches)
        base = rows["1f1b"][0]
        for name, (step, bubbles) in rows.items():
            shown = " / ".join(f"{b:.3f}" for b in bubbles)
            print(f"| {d} | {name} | {step:.1f} | {shown} | {step / base:.3f} |")


if __name__ == "__main__":
    main()
