"""``titan plan``: the layouts a model allows on N devices, with each one's model state per rank.

    titan plan --config configs/dp_pp_ep.yaml --devices 8 --device h100-80gb
    titan plan --config configs/dp_pp_ep.yaml --devices 8 --out layout.yaml   # then:
    titan fit --config configs/dp_pp_ep.yaml --config layout.yaml

What it predicts so far is the model state (params, grads, optimizer) of each layout's fullest rank,
exactly as ``titan bench`` measures it (``plan/memory.py``), against the device's memory; layouts are
listed from the least state per rank. Activations, step time, the bubble and communication are not
predicted yet (issue 20).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import fields
from pathlib import Path

from lightning_titan.bench.memory import PARTS
from lightning_titan.config_files import compose_config
from lightning_titan.model import ModelConfig
from lightning_titan.plan.layouts import (
    DEVICES,
    GB,
    Candidate,
    candidates,
    check_request,
    shortfall,
    total_params,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titan plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a titan config (its model and data)")
    parser.add_argument("--devices", type=int, required=True, help="devices in all (every node)")
    parser.add_argument("--device", default="cpu", help=f"cpu or one of {sorted(DEVICES)}")
    parser.add_argument("--memory-gb", type=float, help="memory per device (default: the device's)")
    parser.add_argument(
        "--global-batch", type=int, help="sequences per step (default: the config's)"
    )
    parser.add_argument("--top", type=int, default=20, help="rows to print")
    parser.add_argument("--out", help="write the first layout as a config overlay (YAML)")
    return parser


def model_and_batch(path: str) -> tuple[ModelConfig, int]:
    """The ModelConfig and global batch a titan config trains (defaults where it sets none)."""
    composed = compose_config(path)
    model = (composed.get("model") or {}).get("model") or {}
    model = model.get("init_args", model)
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(model) - known)
    if unknown:
        raise ValueError(f"{path}: model.model has unknown fields {unknown}")
    data = composed.get("data") or {}
    return ModelConfig(**model), int(data.get("global_batch_size", 16))


def device_memory(device: str, memory_gb: float | None, devices: int) -> float:
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ValueError(f"--memory-gb={memory_gb} must be > 0")
        return memory_gb * GB
    if device == "cpu":  # ranks on this machine share its memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / devices
    return DEVICES[device]


def table(rows: list[Candidate], memory: float) -> list[str]:
    unit, scale = ("GB", GB) if max(c.state_bytes for c in rows) >= GB else ("MB", 1e6)
    lines = [
        f"| # | layout | zero | state {unit}/rank | params / grads / optimizer {unit} | of memory |",
        "|---:|---|---:|---:|---|---:|",
    ]
    for i, c in enumerate(rows, 1):
        parts = [sum(v for n, v in c.parts.items() if n.endswith(k)) / scale for k in PARTS]
        lines.append(
            f"| {i} | {c.label.split(' ')[0]} | {c.zero} | {c.state_bytes / scale:,.3f} | "
            f"{' / '.join(f'{v:,.3f}' for v in parts)} | {c.state_bytes / memory:.0%} |"
        )
    return lines


def overlay(c: Candidate) -> str:
    """The layout as dotted keys that replace the config's (``--config base --config overlay``)."""
    keys = {"trainer.devices": math.prod(c.degrees.values())}
    keys.update({f"trainer.strategy.init_args.{a}": n for a, n in c.degrees.items()})
    keys["trainer.strategy.init_args.zero"] = c.zero
    return "".join(f"{k}: {v}\n" for k, v in keys.items())


def main(argv: list[str] | None = None) -> list[Candidate]:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config, batch = model_and_batch(args.config)
        batch = args.global_batch if args.global_batch is not None else batch
        check_request(args.devices, batch, args.device)
        memory = device_memory(args.device, args.memory_gb, args.devices)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    found, rejected = candidates(config, args.devices, batch)
    found.sort(key=lambda c: (c.state_bytes, c.zero, -c.degrees["dp"]))
    fits = [c for c in found if c.state_bytes <= memory]
    print(
        f"titan plan: {total_params(config):,} parameters on {args.devices} x {args.device} "
        f"({memory / GB:.2f} GB each), global batch {batch}: {len(found)} layouts the strategy "
        f"accepts, {len(fits)} whose model state fits"
    )
    if rejected:
        print("rejected: " + ", ".join(f"{n} by {rule}" for rule, n in rejected.most_common()))
    if not found:
        sys.exit("titan plan: no layout of these devices splits this model and batch evenly")
    if not fits:
        sys.exit(f"titan plan: nothing fits: {shortfall(found[0], memory)}")
    print("\n".join(table(fits[: args.top], memory)))
    print("(model state only: activations, step time and traffic are not predicted yet)")
    if args.out:
        Path(args.out).write_text(overlay(fits[0]))
        print(f"titan plan: wrote {fits[0].label} to {args.out}")
    return fits
