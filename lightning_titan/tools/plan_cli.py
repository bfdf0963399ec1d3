"""``titan plan``: the layouts a model allows on N devices, ranked by predicted step time.

    titan plan --config configs/dp_pp_ep.yaml --devices 8 --device h100-80gb [--nodes 2]
    titan plan --config configs/dp_pp_ep.yaml --devices 8 --out layout.yaml   # then:
    titan fit --config configs/dp_pp_ep.yaml --config layout.yaml
    titan plan --config configs/base.yaml --devices 8 --check   # predicted against measured
    titan plan --config configs/dp_pp_ep.yaml --devices 8 --device h100-80gb --precision bf16-mixed
    titan plan --config path/to/gpt-oss-20b/config.json --seq-len 4096 --devices 64 --device h100-80gb
    titan plan --config path/to/DeepSeek-V3 --devices 64 --device h100-80gb  # a HF model's folder

Each layout (dp, pp, ep, cp, tp, zero) with each step option (schedule, microbatches, virtual stages,
activation checkpointing) gets the model state of its fullest rank, exactly as ``titan bench``
measures it (``plan/memory.py``), and a predicted step time with its terms (``plan/cost.py``):
compute, bubble, and each collective kind, in ms. Rows whose model state and activations fit
are ranked fastest first. Activations and payloads are priced in the dtypes of ``--precision``
(default: the config's ``trainer.precision``; ``plan/precision.py``).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import fields
from pathlib import Path

from lightning_titan.hf.load import config_from_folder
from lightning_titan.lightning.config_files import compose_config
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.plan.auto import cost_device, device_memory
from lightning_titan.plan.devices import Device
from lightning_titan.plan.layouts import (
    DEVICES,
    GB,
    candidates,
    check_request,
    shortfall,
    total_params,
)
from lightning_titan.plan.memory import PARTS
from lightning_titan.plan.precision import FP32, PRECISIONS, Precision, precision_of
from lightning_titan.plan.rank import Ranked, ranked

TERMS = ("dp", "ep", "pp", "tp", "cp")
HF_SEQ_LEN = 4096  # a Hugging Face config.json says the longest sequence, not the one trained on


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titan plan", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config",
        required=True,
        help="a titan config (its model and data; its init_from folder's model where it has one), "
        "or a Hugging Face model's config.json (or its folder)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        help=f"sequence length for a Hugging Face config.json (default {HF_SEQ_LEN})",
    )
    parser.add_argument("--devices", type=int, required=True, help="devices in all (every node)")
    parser.add_argument("--device", default="cpu", help=f"cpu or one of {sorted(DEVICES)}")
    parser.add_argument("--memory-gb", type=float, help="memory per device (default: the device's)")
    parser.add_argument(
        "--global-batch", type=int, help="sequences per step (default: the config's)"
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes the devices are spread over")
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="the dtypes activations and payloads are priced in (default: the config's "
        "trainer.precision, else 32-true); state is fp32 under either",
    )
    parser.add_argument("--top", type=int, default=20, help="rows to print")
    parser.add_argument(
        "--only",
        nargs="+",
        help="print only these layouts (e.g. dp8xep8 pp4xep2): each one's fastest --top rows",
    )
    parser.add_argument("--out", help="write the first layout as a config overlay (YAML)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="run the fastest and slowest predicted layouts on this machine's CPU ranks (1 to "
        "--devices) for a few steps: predicted against measured, and their rank correlation",
    )
    return parser


def model_and_batch(path: str, seq_len: int | None = None) -> tuple[ModelConfig, int, Precision]:
    """The ModelConfig, global batch and precision a titan config trains (defaults where it sets
    none), or those of a Hugging Face config.json (``seq_len``, a global batch of 16, fp32)."""
    hf = Path(path)
    if hf.name == "config.json" or hf.is_dir():
        folder = hf.parent if hf.name == "config.json" else hf
        return config_from_folder(folder, ModelConfig(seq_len=seq_len or HF_SEQ_LEN)), 16, FP32
    composed = compose_config(path)
    init_from = (composed.get("model") or {}).get("init_from")
    model = (composed.get("model") or {}).get("model") or {}
    model = model.get("init_args", model)
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(model) - known)
    if unknown:
        raise ValueError(f"{path}: model.model has unknown fields {unknown}")
    data = composed.get("data") or {}
    trainer = composed.get("trainer") or {}
    precision = precision_of(trainer.get("precision", "32-true"))
    config = ModelConfig(**model)
    if init_from:  # the folder's model, as TitanLM takes it
        config = config_from_folder(init_from, config)
    return config, int(data.get("global_batch_size", 16)), precision


def describe(device: Device, nodes: int) -> str:
    """What the step times are computed from, on one line."""
    inter = device.inter if nodes > 1 else None
    return (
        f"device: {device.name}, {device.flops / 1e12:.3g} TFLOP/s per rank, "
        f"{device.pass_s * 1e3:.3g} ms per block pass (+{device.split_s * 1e3:.3g} ms split into B "
        "and W); links: intra-node "
        f"{device.intra.bandwidth / GB:.3g} GB/s + {device.intra.latency_s * 1e6:.3g} us"
        + (
            f", inter-node {inter.bandwidth / GB:.3g} GB/s + {inter.latency_s * 1e6:.3g} us"
            if inter is not None
            else ""
        )
    )


def _ms(seconds: float) -> str:
    """Plain milliseconds to about three significant digits: "3,260", "35.5", "0.921", "0"."""
    ms = seconds * 1e3
    digits = 0 if ms == 0 else max(0, min(3, 2 - math.floor(math.log10(abs(ms)))))
    return f"{ms:,.{digits}f}"


def table(rows: list[Ranked], memory: float) -> list[str]:
    unit, scale = ("GB", GB) if max(r.candidate.state_bytes for r in rows) >= GB else ("MB", 1e6)
    lines = [
        f"| # | layout | zero | step options | state {unit}/rank | params / grads / optimizer "
        f"{unit} | activations {unit} | of memory | compute | bubble | {' | '.join(TERMS)} | optim | step ms |",
        "|---:|---|---:|---|---:|---|---:|---:|---:|---:|" + "---:|" * len(TERMS) + "---:|---:|",
    ]
    for i, r in enumerate(rows, 1):
        c, cost = r.candidate, r.cost
        parts = [sum(v for n, v in c.parts.items() if n.endswith(k)) / scale for k in PARTS]
        lines.append(
            f"| {i} | {c.label.split(' ')[0]} | {c.zero} | {r.options_label} | "
            f"{c.state_bytes / scale:,.3f} | {' / '.join(f'{v:,.3f}' for v in parts)} | "
            f"{r.activation_bytes / scale:,.3f} | {r.memory_bytes / memory:.0%} | {_ms(cost.compute)} | {_ms(cost.bubble)} "
            f"({cost.bubble_fraction:.0%}) | {' | '.join(_ms(cost.comm[t]) for t in TERMS)} | "
            f"{_ms(cost.optimizer)} | **{_ms(cost.step)}** |"
        )
    return lines


def overlay(r: Ranked) -> str:
    """The layout as dotted keys that replace the config's (``--config base --config overlay``)."""
    c, o = r.candidate, r.options
    keys: dict[str, object] = {"trainer.devices": math.prod(c.degrees.values())}
    keys.update({f"trainer.strategy.init_args.{a}": n for a, n in c.degrees.items()})
    keys["trainer.strategy.init_args.zero"] = c.zero
    keys["trainer.strategy.init_args.schedule"] = o.schedule
    keys["trainer.strategy.init_args.num_microbatches"] = o.microbatches
    keys["trainer.strategy.init_args.virtual_stages"] = o.virtual_stages
    # model.model is a class-valued block: a dotted key sets its fields under init_args
    keys["model.model.init_args.activation_checkpointing"] = str(o.recompute).lower()
    return "".join(f"{k}: {v}\n" for k, v in keys.items())


def shown_rows(
    rows: list[Ranked], only: list[str] | None, top: int
) -> tuple[list[Ranked], list[str]]:
    """The rows to print, fastest first, and the ``only`` layouts that have none: without ``only``
    the fastest ``top``; with it, each named layout's fastest ``top`` (every ZeRO level of it), so
    that a slow one is not cut by a fast one's many step options."""
    if not only:
        return rows[:top], []
    per_layout = {name: [r for r in rows if r.label.split(" ")[0] == name][:top] for name in only}
    keep = {id(r) for chosen in per_layout.values() for r in chosen}
    return [r for r in rows if id(r) in keep], [n for n, chosen in per_layout.items() if not chosen]


def main(argv: list[str] | None = None) -> list[Ranked]:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config, batch, precision = model_and_batch(args.config, args.seq_len)
        batch = args.global_batch if args.global_batch is not None else batch
        precision = Precision(args.precision) if args.precision else precision
        check_request(args.devices, batch, args.device)
        if args.check and args.device != "cpu":
            raise ValueError(
                f"--check runs on this machine's CPU ranks, not --device={args.device}"
            )
        memory = device_memory(args.device, args.memory_gb, args.devices)
        device = cost_device(args.device, memory, args.devices, args.nodes, config)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if args.check:
        from lightning_titan.tools.plan_check import check

        check(config, batch, args.devices, memory, precision=precision)
        return []
    found, rejected = candidates(config, args.devices, batch)
    found.sort(key=lambda c: (c.state_bytes, c.zero, -c.degrees["dp"]))
    fits = [c for c in found if c.state_bytes <= memory]
    print(
        f"titan plan: {total_params(config):,} parameters on {args.devices} x {args.device} "
        f"({memory / GB:.2f} GB each) on {args.nodes} node(s), global batch {batch}, "
        f"{precision.name}: {len(found)} "
        f"layouts the strategy accepts, {len(fits)} whose model state fits"
    )
    print(describe(device, args.nodes))
    if rejected:
        print("rejected: " + ", ".join(f"{n} by {rule}" for rule, n in rejected.most_common()))
    if not found:
        sys.exit("titan plan: no layout of these devices splits this model and batch evenly")
    if not fits:
        sys.exit(f"titan plan: nothing fits: {shortfall(found[0], memory)}")
    rows = ranked(config, fits, batch, device, precision=precision)
    if not rows:
        sys.exit(
            "titan plan: the model state fits but no step option's activations do: use more "
            "microbatches, activation checkpointing, or more devices"
        )
    shown, missing = shown_rows(rows, args.only, args.top)
    if shown:
        print("\n".join(table(shown, memory)))
    if missing:
        print(
            f"titan plan: no row for {', '.join(missing)}: not a layout these devices, model and "
            "batch allow, or its state and activations do not fit"
        )
    print(
        "(ms per step; comm columns are the collectives' exposed time; of memory: model state and "
        f"peak activations of the fullest rank; priced as {precision.label()})"
    )
    if args.out and shown:  # the first row printed: with --only, the fastest of those layouts
        Path(args.out).write_text(overlay(shown[0]))
        print(f"titan plan: wrote {shown[0].label} {shown[0].options_label} to {args.out}")
    return rows
