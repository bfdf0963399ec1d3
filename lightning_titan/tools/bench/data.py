"""Tokens/s the data pipeline delivers per rank vs tokens/s the default model consumes.

    python -m lightning_titan.tools.bench.data                          # default corpus, both modes
    python -m lightning_titan.tools.bench.data --data-worlds 1 8 --batches 500 --workers 0 2 --device cuda
    python -m lightning_titan.tools.bench.data --model-tokens-per-s 2e6  # compare against a number measured elsewhere

One data rank is timed (rank 0 of each data world: map-style ranks all do the same work). The model side
is a forward + backward of the whole default ``StageModel(ModelConfig())`` on one rank with the same
per-rank batch: an upper bound on what one rank consumes (pipeline stages and EP ranks consume less).
The pipeline is not the bottleneck when the ratio is well above 1 (target: >= 10x).
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time

import torch

from lightning_titan.data import DataPipeline


def measure_data(
    streaming: bool,
    data_world: int,
    global_batch_size: int,
    seq_len: int,
    batches: int,
    num_workers: int = 0,
    cache_dir: str | None = None,
    max_bytes: int | None = None,
) -> dict:
    """Tokens/s one data rank's DataLoader yields, after its first batch (worker start-up excluded)."""
    dm = DataPipeline(
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        streaming=streaming,
        num_workers=0 if streaming else num_workers,
        cache_dir=cache_dir,
        max_bytes=max_bytes,
        val_fraction=0.0,
    )
    started = time.perf_counter()
    dm.bind(0, data_world).setup("fit")
    setup_s = time.perf_counter() - started
    loader = dm.train_dataloader()
    started = time.perf_counter()
    # from iter(): worker start-up and the stream's first reads count, as they do in training
    it = iter(loader) if streaming else itertools.chain.from_iterable(itertools.repeat(loader))
    first = next(it)
    first_s = time.perf_counter() - started
    tokens = first[0].numel()
    for inputs, _ in itertools.islice(it, batches - 1):
        tokens += inputs.numel()
    seconds = time.perf_counter() - started
    return {
        "mode": "streaming" if streaming else "map",
        "data_world": data_world,
        "local_batch": dm.local_batch_size,
        "workers": 0 if streaming else num_workers,
        "setup_s": setup_s,
        "first_batch_s": first_s,
        "data_tokens_per_s": tokens / seconds,
    }


def measure_model(local_batch: int, seq_len: int, steps: int = 10, device: str = "cpu") -> float:
    """Tokens/s of forward + backward of the default model on one rank (no optimizer, no communication)."""
    from lightning_titan.model.decoder import ModelConfig, StageModel

    config = ModelConfig(seq_len=max(seq_len, ModelConfig().seq_len))
    model = StageModel(config).to(device)
    x = torch.randint(0, config.vocab_size, (local_batch, seq_len), device=device)

    def step() -> None:
        logits, aux = model(x)
        loss = (
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
            + aux.mean()
        )
        loss.backward()

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):  # warm-up: allocator, kernels
        step()
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return local_batch * seq_len * steps / (time.perf_counter() - started)


def report(rows: list[dict], model_tokens_per_s: dict[int, float] | float | None) -> str:
    """The table. MODEL SIDE GOES HERE: ``model_tokens_per_s`` is a number for every batch size, a
    {local_batch: tokens/s} dict (what ``measure_model`` gives), or None to print the data side only."""
    lines = [
        "| mode | data world | b | workers | setup s | first batch s | data tok/s/rank | model tok/s/rank "
        "| ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        model = model_tokens_per_s
        if isinstance(model, dict):
            model = model.get(row["local_batch"])
        row["model_tokens_per_s"] = model
        row["ratio"] = row["data_tokens_per_s"] / model if model else None
        model_cell = f"{model:,.0f}" if model else "-"
        ratio_cell = f"{row['ratio']:.0f}x" if row["ratio"] else "-"
        lines.append(
            f"| {row['mode']} | {row['data_world']} | {row['local_batch']} | {row['workers']} | "
            f"{row['setup_s']:.2f} | {row['first_batch_s']:.3f} | {row['data_tokens_per_s']:,.0f} | {model_cell} | {ratio_cell} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--data-worlds", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0], help="map-style DataLoader workers"
    )
    parser.add_argument(
        "--modes", nargs="+", default=["map", "streaming"], choices=["map", "streaming"]
    )
    parser.add_argument("--max-bytes", type=int, default=None, help="default corpus cap (4 MB)")
    parser.add_argument(
        "--cache-dir", default=None, help="default: the usual cache; 'tmp': a fresh one"
    )
    parser.add_argument("--device", default="cpu", help="where the model side runs")
    parser.add_argument("--model-steps", type=int, default=5)
    parser.add_argument(
        "--model-tokens-per-s", type=float, default=None, help="skip measuring the model"
    )
    parser.add_argument("--no-model", action="store_true", help="print the data side only")
    args = parser.parse_args(argv)

    cache_dir = (
        tempfile.mkdtemp(prefix="titan-bench-") if args.cache_dir == "tmp" else args.cache_dir
    )
    rows = []
    for mode, world in itertools.product(args.modes, args.data_worlds):
        for workers in args.workers if mode == "map" else [0]:
            rows.append(
                measure_data(
                    mode == "streaming",
                    world,
                    args.global_batch_size,
                    args.seq_len,
                    args.batches,
                    workers,
                    cache_dir,
                    args.max_bytes,
                )
            )
    model: dict[int, float] | float | None = args.model_tokens_per_s
    if model is None and not args.no_model:
        sizes = sorted({row["local_batch"] for row in rows})
        model = {b: measure_model(b, args.seq_len, args.model_steps, args.device) for b in sizes}
    print(
        f"seq_len={args.seq_len} global_batch_size={args.global_batch_size} batches={args.batches} "
        f"threads={torch.get_num_threads()} model device={args.device}"
    )
    print(report(rows, model))
    return rows


if __name__ == "__main__":
    main()
