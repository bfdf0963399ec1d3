"""Vectorised dispatch + combine vs a per-expert Python loop, one process (EP=1).

    python -m lightning_titan.tools.bench.dispatch --experts 8 64 --tokens 8192 --d-model 64 --top-k 2

Prints a markdown table of best-of-N wall times (forward, and forward + backward) and the
loop / vectorised ratios. The experts are the identity, so only packing and unpacking are timed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from lightning_titan.parallel.dispatch import (
    combine,
    combine_loop_reference,
    dispatch,
    dispatch_loop_reference,
)


def _best_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # Best of N, not the median: other load on the machine only ever adds time.
    for _ in range(3):  # warm-up: allocator, kernels
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def bench_case(
    n_experts: int, n_tokens: int, d_model: int, top_k: int, repeats: int, device: torch.device
) -> dict[str, float]:
    """Best-of-N ms of one dispatch + combine of ``n_tokens`` tokens, forward and forward + backward."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_tokens, d_model, generator=g).to(device)
    ids = torch.rand(n_tokens, n_experts, generator=g).topk(top_k, dim=-1).indices.to(device)
    weights = torch.softmax(torch.randn(n_tokens, top_k, generator=g), -1).to(device)
    # A dense upstream gradient, as from the layer above: ``.sum().backward()`` would hand both sides
    # a stride-0 gradient, which no model produces.
    grad_out = torch.randn(n_tokens, d_model, generator=g).to(device)

    def vectorised(inp: Tensor) -> Tensor:
        expert_in, plan = dispatch(inp, ids, n_experts)
        return combine(expert_in, weights, plan)

    def loop(inp: Tensor) -> Tensor:
        packed, indices = dispatch_loop_reference(inp, ids, n_experts)
        return combine_loop_reference(packed, weights, indices)

    torch.testing.assert_close(vectorised(x), loop(x))
    x_grad = x.detach().requires_grad_()
    result = {}
    for name, fn in (("vectorised", vectorised), ("loop", loop)):
        with torch.no_grad():
            result[f"{name}_fwd_ms"] = _best_ms(partial(fn, x), repeats, device)
        result[f"{name}_fwd_bwd_ms"] = _best_ms(
            partial(lambda f: f(x_grad).backward(grad_out), fn), repeats, device
        )
    return result


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    print(
        f"device={device} tokens={args.tokens} d_model={args.d_model} top_k={args.top_k} "
        f"threads={torch.get_num_threads()}, best of {args.repeats}; identity experts\n"
    )
    print(
        "| experts | vectorised fwd (ms) | loop fwd (ms) | ratio fwd "
        "| vectorised fwd+bwd (ms) | loop fwd+bwd (ms) | ratio fwd+bwd |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for n_experts in args.experts:
        r = bench_case(n_experts, args.tokens, args.d_model, args.top_k, args.repeats, device)
        r["experts"] = n_experts
        r["ratio_fwd"] = r["loop_fwd_ms"] / r["vectorised_fwd_ms"]
        r["ratio_fwd_bwd"] = r["loop_fwd_bwd_ms"] / r["vectorised_fwd_bwd_ms"]
        rows.append(r)
        print(
            f"| {n_experts} | {r['vectorised_fwd_ms']:.3f} | {r['loop_fwd_ms']:.3f} | "
            f"{r['ratio_fwd']:.1f}x | {r['vectorised_fwd_bwd_ms']:.3f} | "
            f"{r['loop_fwd_bwd_ms']:.3f} | {r['ratio_fwd_bwd']:.1f}x |"
        )
    return rows


if __name__ == "__main__":
    main()
