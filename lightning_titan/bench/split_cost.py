"""What the zero-bubble schedules' backward split costs against one whole backward, on one stage.

    python -m lightning_titan.bench.split_cost --d-model 64 256

The last stage of pp2 (half the layers and the head; ``--n-layers`` in all) on ``--batch`` sequences,
one thread: the median over ``--repeats`` microbatches of a whole backward, of B (the input grad,
``backward_split.split``) and of W (``WeightGrads.run``), and (B + W) / whole. ZB-H1 and ZBV pay that
ratio on every microbatch of every stage; what they save is the bubble.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lightning_titan.model import ModelConfig, StageModel
from lightning_titan.pipeline import backward_split


def measure(d_model: int, n_layers: int = 8, batch: int = 4, repeats: int = 20) -> dict[str, float]:
    """Median ms of a whole backward, of B and of W on the last stage of pp2 (grads accumulate over
    the microbatches and are cleared every 4, as steps would)."""
    config = ModelConfig(d_model=d_model, ffn_dim=2 * d_model, n_layers=n_layers)
    model = StageModel(config, pp_rank=1, pp=2)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(batch, config.seq_len, d_model, generator=g)
    targets = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g)
    params = list(model.parameters())

    def objective() -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_()
        logits, aux = model(x)
        return x, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) + aux.sum()

    times: dict[str, list[float]] = {"whole": [], "B": [], "W": []}
    for i in range(repeats + 4):  # the first 4 warm up
        _, loss = objective()
        start = time.perf_counter()
        loss.backward()
        whole = time.perf_counter() - start
        x, loss = objective()
        start = time.perf_counter()
        _, weights = backward_split.split(loss, x, params)
        middle = time.perf_counter()
        weights.run()
        end = time.perf_counter()
        if i >= 4:
            times["whole"].append(whole)
            times["B"].append(middle - start)
            times["W"].append(end - middle)
        if i % 4 == 3:
            model.zero_grad(set_to_none=True)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["ratio"] = (out["B"] + out["W"]) / out["whole"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| d_model | whole backward ms | B ms | W ms | (B + W) / whole |")
    print("|---:|---:|---:|---:|---:|")
    for d in args.d_model:
        r = measure(d, args.n_layers, args.batch, args.repeats)
        print(f"| {d} | {r['whole']:.2f} | {r['B']:.2f} | {r['W']:.2f} | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
