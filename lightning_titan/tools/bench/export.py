"""Peak host memory of ``titan export`` on a checkpoint of about ``--gb`` GB, against the bound it
promises: the largest output file plus the largest tensor read (plus what importing torch costs).

    python -m lightning_titan.tools.bench.export                  # ~1 GB fp32, 200MB shards, bf16
    python -m lightning_titan.tools.bench.export --gb 2 --max-shard-size 500MB --whole

Each is a fresh process whose own peak RSS (VmHWM) is measured: one that only imports the exporter
(the floor), the export, and with ``--whole`` the whole model loaded in one process and written
(what the export did before it streamed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lightning_titan.checkpoint import save_sharded
from lightning_titan.model.decoder import ModelConfig, StageModel


def config_of(gb: float) -> ModelConfig:
    """A Mixtral-shaped config of about ``gb`` GB in fp32: d_model 1024, 8 experts of 2048, a
    32k vocabulary, as many layers as it takes."""
    d, ffn, experts, vocab = 1024, 2048, 8, 32000
    per_layer = 4 * (3 * experts * d * ffn + 4 * d * d + experts * d + 2 * d)
    layers = max(1, round((gb * 1e9 - 4 * 2 * vocab * d) / per_layer))
    return ModelConfig(d_model=d, n_heads=16, n_layers=layers, ffn_dim=ffn, n_experts=experts,
                       top_k=2, vocab_size=vocab, seq_len=64)  # fmt: skip


# run in the child after its work: its own high-water RSS. (``wait4``'s ru_maxrss would not do: a
# child starts from the RSS of this process, which held the model, at the fork.)
PEAK = "; print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"


def peak_rss(code: str, *args: str) -> tuple[int, float]:
    """The peak RSS (bytes) and seconds of a fresh Python process running ``code`` (``sys.argv[1:]``:
    ``args``)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code + PEAK, *args], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{code} exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return int(proc.stdout.split()[-1]) * 1024, time.perf_counter() - start  # kB


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_titan.tools.bench.export")
    parser.add_argument("--gb", type=float, default=1.0, help="the checkpoint's size in fp32")
    parser.add_argument("--max-shard-size", default="200MB")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument(
        "--whole", action="store_true", help="also load the whole model and write it"
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_export_"))
    config = config_of(args.gb)
    model = StageModel(config)
    with torch.no_grad():  # random values are enough: the export reads and writes them all
        for p in model.parameters():
            p.normal_(0, 0.02)
    ckpt_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest_read = max(
        (p[0] if ".moe.experts." in n else p).numel() * p.element_size()
        for n, p in model.named_parameters()
    )
    save_sharded(root / "ckpt", model, [], {}, layout={})
    del model
    floor, _ = peak_rss("import lightning_titan.hf.export, safetensors.torch")
    out = root / "hf"
    export = "import sys; from lightning_titan.hf.export import main; main(sys.argv[1:])"
    rss, seconds = peak_rss(export, "--ckpt", str(root / "ckpt"), "--out", str(out),
                            "--dtype", args.dtype, "--max-shard-size", args.max_shard_size)  # fmt: skip
    files = sorted(out.glob("*.safetensors"))
    largest_file = max(f.stat().st_size for f in files)
    bound = largest_file + largest_read
    mb = 1e6
    print(f"checkpoint: {ckpt_bytes / mb:.0f} MB fp32 ({config.n_layers} layers); export "
          f"{args.dtype}: {len(files)} files, {sum(f.stat().st_size for f in files) / mb:.0f} MB")  # fmt: skip
    print(f"python + torch + exporter imported: peak RSS {floor / mb:.0f} MB")
    print(f"titan export: peak RSS {rss / mb:.0f} MB in {seconds:.1f} s; above the floor "
          f"{(rss - floor) / mb:.0f} MB; bound (largest file {largest_file / mb:.0f} MB + largest "
          f"tensor read {largest_read / mb:.0f} MB) {bound / mb:.0f} MB")  # fmt: skip
    if args.whole:
        whole = (
            "import sys; from lightning_titan.hf.export import load_full_model, write_hf_folder; "
            f"write_hf_folder(load_full_model(sys.argv[1]), sys.argv[2], dtype={args.dtype!r}, "
            f"max_shard_size={args.max_shard_size!r})"
        )
        rss_whole, seconds_whole = peak_rss(whole, str(root / "ckpt"), str(root / "whole"))
        print(f"whole model in one process, then written: peak RSS {rss_whole / mb:.0f} MB in "
              f"{seconds_whole:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
