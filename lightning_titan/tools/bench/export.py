"""Peak host memory of ``titan export`` on a checkpoint of about ``--gb`` GB, against the bound it
promises: the largest output file plus the largest tensor read (plus what importing torch costs).

    python -m lightning_titan.tools.bench.export                  # ~1 GB fp32, 200MB shards, bf16
    python -m lightning_titan.tools.bench.export --gb 2 --max-shard-size 500MB --whole

Each is a fresh process whose own peak RSS (VmHWM) is measured: one that only imports the exporter
(the floor), the export, and with ``--whole`` the whole model loaded in one process and written
(what the export did before it streamed).

In each process the high-water RSS is reset once everything is imported (``measured``): "above its
own start" is what the export held at its worst, free of what the imports' allocations left behind;
"above the floor" is its peak less the import-only process's peak.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
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


HERE = "lightning_titan.tools.bench.export"


def _status(field: str) -> int:
    """A ``/proc/self/status`` field of this process, in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return int(f.read().split(f"{field}:")[1].split()[0]) * 1024


def measured(work: Callable[[], object]) -> None:
    """Run ``work`` in this (fresh) process and print ``start_rss peak_rss``: the RSS after every
    import, and the high-water RSS from then to the end.

    What the imports and the allocator hold before the work would blur the number: freed heap is
    handed back (``malloc_trim``) and the high-water mark reset to the current RSS (``5`` into
    ``/proc/self/clear_refs``) before it starts, so ``peak - start`` is what the work itself held
    at its worst. Where the kernel refuses the reset, ``start`` is printed as -1."""
    import ctypes

    import safetensors.torch  # noqa: F401 - imported by the export when it writes: not its memory

    ctypes.CDLL(None).malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = _status("VmRSS")
    except OSError:
        start = -1
    work()
    print(start, _status("VmHWM"))


def peak_rss(work: str, *args: str) -> Run:
    """A fresh Python process running ``measured(work)`` (``work``: ``"module:function"``, called
    with ``args``); its RSS at the start and at its peak, and its seconds.

    (``wait4``'s ru_maxrss would not do: a child starts from the RSS of this process, which held
    the model, at the fork.)"""
    module, function = work.split(":")
    code = (
        "import sys; from functools import partial; "
        "import lightning_titan.hf.export; from lightning_titan.tools.bench.export import measured; "
        f"from {module} import {function} as work; measured(partial(work, *sys.argv[1:]))"
    )
    begin = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{work} exited with {proc.returncode}: {proc.stderr[-2000:]}")
    start, peak = (int(x) for x in proc.stdout.split()[-2:])
    return Run(start, peak, time.perf_counter() - begin)


@dataclass(frozen=True)
class Run:
    start: int  # RSS once imported (-1: the high-water mark could not be reset)
    peak: int  # high-water RSS of the whole process
    seconds: float


def nothing(*args: str) -> None:
    """The import floor's work."""


def export(*args: str) -> None:
    from lightning_titan.hf.export import main as export_main

    export_main(list(args))


def whole(ckpt: str, out: str, dtype: str, max_shard_size: str) -> None:
    from lightning_titan.hf.export import load_full_model, write_hf_folder

    write_hf_folder(load_full_model(ckpt), out, dtype=dtype, max_shard_size=max_shard_size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_titan.tools.bench.export")
    parser.add_argument("--gb", type=float, default=1.0, help="the checkpoint's size in fp32")
    parser.add_argument("--max-shard-size", default="200MB")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument(
        "--whole", action="store_true", help="also load the whole model and write it"
    )
    parser.add_argument("--repeat", type=int, default=2, help="exports, each a fresh process")
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
    floor = peak_rss(f"{HERE}:nothing")
    mb = 1e6
    print(f"checkpoint: {ckpt_bytes / mb:.0f} MB fp32 ({config.n_layers} layers)")
    print(f"python + torch + exporter imported (the floor): peak RSS {floor.peak / mb:.0f} MB")
    for run in range(args.repeat):
        out = root / f"hf{run}"
        got = peak_rss(f"{HERE}:export", "--ckpt", str(root / "ckpt"), "--out", str(out),
                       "--dtype", args.dtype, "--max-shard-size", args.max_shard_size)  # fmt: skip
        files = sorted(out.glob("*.safetensors"))
        largest_file = max(f.stat().st_size for f in files)
        bound = largest_file + largest_read
        held = got.peak - got.start if got.start >= 0 else got.peak - floor.peak
        if run == 0:
            print(f"export {args.dtype}: {len(files)} files, "
                  f"{sum(f.stat().st_size for f in files) / mb:.0f} MB; bound: largest file "
                  f"{largest_file / mb:.0f} MB + largest tensor read {largest_read / mb:.0f} MB = "
                  f"{bound / mb:.0f} MB")  # fmt: skip
        print(f"titan export, run {run + 1}: peak RSS {got.peak / mb:.0f} MB in {got.seconds:.1f} "
              f"s; above the floor {(got.peak - floor.peak) / mb:.0f} MB; above its own start "
              f"{held / mb:.0f} MB = {held / bound:.2f}x the bound")  # fmt: skip
        shutil.rmtree(out)
    if args.whole:
        got = peak_rss(f"{HERE}:whole", str(root / "ckpt"), str(root / "whole"), args.dtype,
                       args.max_shard_size)  # fmt: skip
        print(
            f"whole model in one process, then written: peak RSS {got.peak / mb:.0f} MB in "
            f"{got.seconds:.1f} s"
        )


if __name__ == "__main__":
    main()
