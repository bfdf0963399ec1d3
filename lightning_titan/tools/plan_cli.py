"""``titan plan``: the layouts a model allows on N devices, ranked by predicted step time.

    titan plan --config configs/dp_pp_ep.yaml --devices 8 --device h100-80gb [--nodes 2]
    titan plan --config configs/dp_pp_ep.yaml --devices 8 --out layout.yaml   # then:
    titan fit --config configs/dp_pp_ep.yaml --config layout.yaml
    titan plan --config configs/base.yaml --devices 8 --check   # predicted against measured
    titan plan --config configs/dp_pp_ep.yaml --devices 8 --device h100-80gb --precision bf16-mixed
    titan plan --config path/to/gpt-oss-20b/config.json --seq-len 4096 --devices 64 --device h100-80gb
    titan plan --config path/to/DeepSeek-V3 --devices 64 --device h100-80gb  # a HF model's folder
    titan plan --config path/to/Mixtral-8x7B/config.json --devices 8 --device h100-80gb \
        --precision bf16-mixed --param-dtype bf16 --offload-optimizer

Each layout (dp, pp, ep, cp, tp, zero; folded, ``xfold``, where a stage has cp or tp ranks: the
experts over its ep x cp x tp ranks) with each step option (schedule, microbatches, virtual stages,
activation checkpointing) gets the model state of its fullest rank, exactly as ``titan bench``
measures it (``plan/memory.py``), and a predicted step time with its terms (``plan/cost.py``):
compute, bubble, and each collective kind, in ms. Rows whose model state and activations fit
are ranked fastest first. Activations and payloads are priced in the dtypes of ``--precision``
(default: the config's ``trainer.precision``; ``plan/precision.py``).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from lightning_titan.hf.load import config_from_folder, config_from_hf, read_hf_config
from lightning_titan.lightning.config_files import compose_config
from lightning_titan.model.config import FULL, NONE
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.lora import LoRA
from lightning_titan.parallel.mesh import AXES
from lightning_titan.plan.auto import cost_device, device_memory
from lightning_titan.plan.cost import DISPATCHERS
from lightning_titan.plan.devices import PER_NODE, Device
from lightning_titan.plan.layouts import (
    DEVICES,
    FOLD,
    GB,
    Candidate,
    candidates,
    check_request,
    rejection,
    shortfall,
    total_params,
)
from lightning_titan.plan.memory import PARTS, StatePolicy
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
    parser.add_argument(
        "--nodes",
        type=int,
        help="nodes the devices are spread over (default: --devices / --per-node)",
    )
    parser.add_argument(
        "--per-node",
        type=int,
        help=f"devices per node (default: {PER_NODE} for a GPU, all of them for the cpu)",
    )
    parser.add_argument(
        "--nvlink-gbs",
        type=float,
        help="GB/s per device each way inside a node (default: the device's NVLink)",
    )
    parser.add_argument(
        "--network-gbs",
        type=float,
        help="GB/s per device each way across nodes (default: the device's one network adapter)",
    )
    parser.add_argument(
        "--dispatch",
        choices=sorted(DISPATCHERS),
        default="all-to-all",
        help="how the EP dispatch is priced: "
        + "; ".join(f"{k}: {v}" for k, v in sorted(DISPATCHERS.items())),
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="the dtypes activations and payloads are priced in (default: the config's "
        "trainer.precision, else 32-true); state is fp32 under either",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        help="plan LoRA fine-tuning: adapters of this rank over a frozen base (default: the "
        "config's model.lora, else a full fine-tune)",
    )
    parser.add_argument(
        "--lora-targets",
        default="attention",
        help="with --lora-rank: the adapted projections, comma-separated (default attention; "
        "e.g. attention,experts)",
    )
    parser.add_argument(
        "--lora-base-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="with --lora-rank: the frozen base's dtype (bf16 needs bf16-mixed)",
    )
    parser.add_argument(
        "--param-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the trained weights' dtype (bf16: over fp32 masters, needs --precision bf16-mixed)",
    )
    parser.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="AdamW's moments and the fp32 masters in host memory, its step on the CPU",
    )
    parser.add_argument("--top", type=int, default=20, help="rows to print")
    parser.add_argument(
        "--only",
        nargs="+",
        help="print only these layouts (e.g. dp8xep8 pp4xep2 ep4xtp2xfold): each one's fastest "
        "--top rows; with --check, run each one's fastest row",
    )
    parser.add_argument("--out", help="write the first layout as a config overlay (YAML)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="run the fastest and slowest predicted layouts on this machine's CPU ranks (1 to "
        "--devices) for a few steps: predicted against measured, and their rank correlation",
    )
    return parser


def lora_of(args: argparse.Namespace) -> LoRA | None:
    """The LoRA to plan: ``--lora-rank`` and its targets and base dtype, else the titan config's
    ``model.lora`` (None: a full fine-tune)."""
    if args.lora_rank is not None:
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        return LoRA(rank=args.lora_rank, targets=targets, base_dtype=args.lora_base_dtype)
    if Path(args.config).name == "config.json" or Path(args.config).is_dir():
        return None
    lora = (compose_config(args.config).get("model") or {}).get("lora")
    return LoRA(**lora) if isinstance(lora, dict) else None


def trained_total(config: ModelConfig, lora: LoRA) -> int:
    """The whole model's trained (adapter) parameters."""
    with torch.device("meta"):
        model = StageModel(config, lora=lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def model_and_batch(path: str, seq_len: int | None = None) -> tuple[ModelConfig, int, Precision]:
    """The ModelConfig, global batch and precision a titan config trains (defaults where it sets
    none), or those of a Hugging Face config.json (``seq_len``, a global batch of 16, fp32)."""
    hf = Path(path)
    if hf.name == "config.json" or hf.is_dir():
        folder = hf.parent if hf.name == "config.json" else hf
        return shapes_of(folder, seq_len or HF_SEQ_LEN), 16, FP32
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


def shapes_of(folder: Path, seq_len: int) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder's config.json, for planning: its quantisation block
    (DeepSeek-V3's FP8 ``quantization_config``, gpt-oss's MXFP4) says how the published weights are
    stored, not their shapes, so it is dropped with a note; the plan prices ``--precision``."""
    hf = read_hf_config(folder)
    quantization = hf.pop("quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        print(
            f"titan plan: note: {folder}/config.json's quantization_config ({method}) is ignored: "
            "planning reads the shapes only, and prices the weights, activations and payloads in "
            "--precision's dtypes"
        )
    return config_from_hf(hf, folder, ModelConfig(seq_len=seq_len))


def nodes_of(args: argparse.Namespace) -> int:
    """--nodes, or the nodes --per-node (default ``PER_NODE`` GPUs) makes of --devices; they must
    agree where both are given."""
    per_node = args.per_node
    if per_node is not None and (per_node < 1 or args.devices % per_node):
        raise ValueError(f"--per-node={per_node} must divide --devices={args.devices}")
    if args.nodes is not None:
        if per_node is not None and args.nodes * per_node != args.devices:
            raise ValueError(
                f"--nodes={args.nodes} x --per-node={per_node} is not --devices={args.devices}: "
                "give one of them"
            )
        return args.nodes
    if per_node is not None:
        return args.devices // per_node
    if args.device == "cpu" or args.devices % PER_NODE:
        return 1
    return max(1, args.devices // PER_NODE)


def with_links(device: Device, args: argparse.Namespace) -> Device:
    """``device`` with the link bandwidths and the dispatcher the flags give."""
    for flag, value in (("--nvlink-gbs", args.nvlink_gbs), ("--network-gbs", args.network_gbs)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag}={value} must be > 0 (GB/s per device each way)")
    intra = device.intra
    if args.nvlink_gbs is not None:
        intra = replace(intra, bandwidth=args.nvlink_gbs * GB)
    inter = device.inter
    if args.network_gbs is not None and inter is not None:
        inter = replace(inter, bandwidth=args.network_gbs * GB)
    return replace(device, intra=intra, inter=inter, dispatch=args.dispatch)


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
        + f"; {device.per_node} per node; EP dispatch priced as {device.dispatch}"
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
            f"| {i} | {layout_cell(c)} | {c.zero} | {r.options_label} | "
            f"{c.state_bytes / scale:,.3f} | {' / '.join(f'{v:,.3f}' for v in parts)} | "
            f"{r.activation_bytes / scale:,.3f} | {r.memory_bytes / memory:.0%} | {_ms(cost.compute)} | {_ms(cost.bubble)} "
            f"({cost.bubble_fraction:.0%}) | {' | '.join(_ms(cost.comm[t]) for t in TERMS)} | "
            f"{_ms(cost.optimizer)} | **{_ms(cost.step)}** |"
        )
    return lines


def layout_cell(c: Candidate) -> str:
    """The layout, and its layers per stage where they are not even (``pp16xdp4 [4*15,1]``)."""
    layout = c.label.split(" ")[0]
    return f"{layout} [{c.split_label}]" if c.stage_layers else layout


def host_line(r: Ranked, device: Device) -> str:
    """Offload: the host memory the first row needs per node, against what a node has."""
    per_node = r.candidate.host_bytes * device.per_node
    has = device.host_memory_per_node
    of = f" of the {has / GB:,.0f} GB a node has" if has else ""
    return (
        f"host memory (optimizer offload, row 1): {r.candidate.host_bytes / GB:,.2f} GB a device, "
        f"{per_node / GB:,.1f} GB a node{of} (fp32 copies, moments and grad buffers)"
    )


def overlay(r: Ranked) -> str:
    """The layout as dotted keys that replace the config's (``--config base --config overlay``)."""
    c, o = r.candidate, r.options
    keys: dict[str, object] = {"trainer.devices": math.prod(c.degrees.values())}
    keys.update({f"trainer.strategy.init_args.{a}": n for a, n in c.degrees.items()})
    keys["trainer.strategy.init_args.zero"] = c.zero
    keys["trainer.strategy.init_args.schedule"] = o.schedule
    keys["trainer.strategy.init_args.num_microbatches"] = o.microbatches
    keys["trainer.strategy.init_args.virtual_stages"] = o.virtual_stages
    # layers per stage; null (even) replaces a split the config may give
    split = o.virtual_layers or c.stage_layers  # per virtual stage where interleaved
    keys["trainer.strategy.init_args.stage_layers"] = list(split) if split else "null"
    # false replaces a fold the config may set
    keys["trainer.strategy.init_args.fold_ep"] = str(c.fold_ep).lower()
    # model.model is a class-valued block: a dotted key sets its fields under init_args
    keys["model.model.init_args.activation_checkpointing"] = {NONE: "false", FULL: "true"}.get(
        o.recompute, o.recompute
    )
    if c.policy.param_dtype != "fp32":  # bf16 weights need bf16 activations
        keys["trainer.strategy.init_args.param_dtype"] = c.policy.param_dtype
        keys["trainer.precision"] = "bf16-mixed"
    if c.policy.offload:
        keys["trainer.strategy.init_args.offload_optimizer"] = "true"
    return "".join(f"{k}: {v}\n" for k, v in keys.items())


def parse_layout(name: str) -> dict[str, int] | None:
    """``dp16xep8xtp2`` (a row's layout; ``single``) as degrees in mesh order, None if it is not one."""
    degrees = dict.fromkeys(AXES, 1)
    if name == "single":
        return degrees
    for part in name.split("x"):
        match = re.fullmatch(r"(dp|pp|ep|cp|tp)([1-9][0-9]*)", part)
        if match is None or degrees[match[1]] != 1:
            return None
        degrees[match[1]] = int(match[2])
    return degrees


def parse_folded(name: str) -> tuple[dict[str, int], bool] | None:
    """``pp8xep16xtp2xfold`` (a row's layout, folded or not) as (degrees, folded), None if it is
    not one."""
    parts = name.split("x")
    folded = parts.count(FOLD)
    rest = [p for p in parts if p != FOLD]
    degrees = parse_layout("x".join(rest)) if rest and folded <= 1 else None
    return None if degrees is None else (degrees, bool(folded))


def only_rows(
    names: list[str],
    config: ModelConfig,
    found: list[Candidate],
    batch: int,
    device: Device,
    precision: Precision,
    top: int,
    lora: LoRA | None = None,
) -> tuple[list[Ranked], list[str]]:
    """``--only``: each named layout's fastest ``top`` rows whether they fit or not, fastest first,
    and one line per name: its fastest row's time and memory (and what does not fit), or why it has
    no row (not a layout, another number of devices, the strategy's own rule that refuses it)."""
    devices = math.prod(found[0].degrees.values()) if found else None
    rows: list[Ranked] = []
    lines = []
    for name in names:
        parsed = parse_folded(name)
        if parsed is None:
            lines.append(
                f"no row for {name}: not a layout (axes dp, pp, ep, cp, tp with their degrees, "
                "joined by x, in any order: dp2xpp2xep2; or single; xfold for the experts "
                "folded over ep x cp x tp)"
            )
            continue
        degrees, fold = parsed
        world = math.prod(degrees.values())
        if devices is not None and world != devices:
            lines.append(f"no row for {name}: {world} devices, not the {devices} planned for")
            continue
        if fold and degrees["cp"] * degrees["tp"] == 1:
            lines.append(
                f"no row for {name}: folding joins a stage's cp and tp ranks to expert "
                "parallelism, and this layout has none: name it without xfold"
            )
            continue
        mine = [c for c in found if c.degrees == degrees and c.fold_ep == fold]
        if not mine:
            why = rejection(config, degrees, 0, batch, fold_ep=fold)
            why = why or "no layout of these devices is accepted"
            lines.append(f"no row for {name}: the strategy refuses it: {why}")
            continue
        priced = ranked(config, mine, batch, device, precision=precision, fitting=False, lora=lora)
        if not priced:
            lines.append(f"no row for {name}: no step option the strategy accepts")
            continue
        rows += priced[:top]
        fastest, fits = priced[0], [r for r in priced if r.memory_bytes <= device.memory]
        line = (
            f"{name}: fastest {_ms(fastest.cost.step)} ms per step (zero={fastest.candidate.zero} "
            f"{fastest.options_label}{_split(fastest)}), {fastest.memory_bytes / GB:.2f} GB of "
            f"{device.memory / GB:.2f} GB (state {fastest.candidate.state_bytes / GB:.2f} + "
            f"activations {fastest.activation_bytes / GB:.2f}{_step_grads(fastest)})"
        )
        if fastest.memory_bytes > device.memory:
            line += ": does not fit; " + (
                f"its fastest row that fits: {_ms(fits[0].cost.step)} ms "
                f"(zero={fits[0].candidate.zero} {fits[0].options_label}{_split(fits[0])}, "
                f"{fits[0].memory_bytes / GB:.2f} GB)"
                if fits
                else "no row of it fits, the least memory of its rows is "
                f"{min(r.memory_bytes for r in priced) / GB:.2f} GB"
            )
        lines.append(line)
    rows.sort(key=lambda r: (r.cost.step, r.candidate.state_bytes))
    return rows, lines


def _split(r: Ranked) -> str:
    return f" stage_layers {r.candidate.split_label}" if r.candidate.stage_layers else ""


class Progress:
    """One line on stderr while the search runs (rewritten in place on a terminal, else a line
    every few seconds), and the last count when it ends: layouts priced of those left after
    pruning, the fastest row so far."""

    def __init__(self, every_s: float = 2.0) -> None:
        self.every_s, self.start = every_s, time.perf_counter()
        self.last, self.shown = self.start, False
        self.tty = sys.stderr.isatty()
        self.state: tuple[int, int, Ranked | None] | None = None

    def __call__(self, priced: int, of: int, best: Ranked | None) -> None:
        self.state = (priced, of, best)
        if time.perf_counter() - self.last >= self.every_s:
            self._show(priced, of, best)

    def _show(self, priced: int, of: int, best: Ranked | None) -> None:
        self.last, self.shown = time.perf_counter(), True
        fastest = f", fastest so far {_ms(best.cost.step)} ms ({best.label})" if best else ""
        seconds = self.last - self.start
        line = f"titan plan: priced {priced} of {of} layouts in {seconds:.0f} s{fastest}"
        end = "" if self.tty else "\n"
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        """The last count (the layouts left unpriced were bounded out)."""
        if self.state is not None:
            self._show(*self.state)
        if self.shown and self.tty:
            print(file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> list[Ranked]:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config, batch, precision = model_and_batch(args.config, args.seq_len)
        lora = lora_of(args)
        batch = args.global_batch if args.global_batch is not None else batch
        precision = Precision(args.precision) if args.precision else precision
        policy = StatePolicy(args.param_dtype, args.offload_optimizer)
        if policy.param_dtype == "bf16" and not precision.mixed:
            raise ValueError(
                f"--param-dtype bf16 multiplies bf16 weights with bf16 activations, which "
                f"{precision.name} does not run: add --precision bf16-mixed"
            )
        check_request(args.devices, batch, args.device)
        if args.check and args.device != "cpu":
            raise ValueError(
                f"--check runs on this machine's CPU ranks, not --device={args.device}"
            )
        memory = device_memory(args.device, args.memory_gb, args.devices)
        nodes = nodes_of(args)
        device = cost_device(args.device, memory, args.devices, nodes, config)
        device = with_links(device, args)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if args.check:
        from lightning_titan.tools.plan_check import check

        check(config, batch, args.devices, memory, precision=precision, only=args.only)
        return []
    found, rejected = candidates(config, args.devices, batch, lora, policy)
    found.sort(key=lambda c: (c.state_bytes, c.zero, -c.degrees["dp"]))
    fits = [c for c in found if c.state_bytes <= memory]
    print(
        f"titan plan: {total_params(config):,} parameters on {args.devices} x {args.device} "
        f"({memory / GB:.2f} GB each) on {nodes} node(s), global batch {batch}, "
        f"{precision.name}: {len(found)} "
        f"layouts the strategy accepts, {len(fits)} whose model state fits"
    )
    print(describe(device, nodes))
    if policy.label:
        print(f"state kept as: {policy.label}")
    if lora is not None:
        print(f"LoRA rank {lora.rank} on {', '.join(lora.targets)} over a frozen {lora.base_dtype} "
              f"base: {trained_total(config, lora):,} trained parameters")  # fmt: skip
    if rejected:
        print("rejected: " + ", ".join(f"{n} by {rule}" for rule, n in rejected.most_common()))
    if args.only:
        return _print_only(args, config, found, batch, device, precision, lora)
    if not found:
        sys.exit("titan plan: no layout of these devices splits this model and batch evenly")
    if not fits:
        sys.exit(f"titan plan: nothing fits: {shortfall(found[0], memory, config, lora)}")
    progress = Progress()
    rows = ranked(
        config, fits, batch, device, precision=precision, keep=args.top, progress=progress,
        lora=lora,
    )  # fmt: skip
    progress.close()
    if not rows:
        sys.exit(
            "titan plan: the model state fits but no step option's activations do: use more "
            "microbatches, activation checkpointing, or more devices"
        )
    print("\n".join(table(rows, memory)))
    _footer(precision)
    if policy.offload:
        print(host_line(rows[0], device))
    if args.out:
        Path(args.out).write_text(overlay(rows[0]))
        print(
            f"titan plan: wrote {rows[0].label} {rows[0].options_label}{_split(rows[0])} to "
            f"{args.out}"
        )
    return rows


def _step_grads(r: Ranked) -> str:
    if not r.step_grad_bytes:
        return ""
    return f" + grads its microbatches accumulate {r.step_grad_bytes / GB:.2f}"


def _footer(precision: Precision) -> None:
    print(
        "(ms per step; comm columns are the collectives' exposed time; of memory: model state, "
        "peak activations and, at zero >= 2 over several microbatches, the whole grads they "
        "accumulate before the last backward's reduction, of the fullest rank; zero=3's state adds the "
        "weights it gathers in the step to its parts, which are between steps; priced as "
        f"{precision.label()})"
    )


def _print_only(
    args: argparse.Namespace,
    config: ModelConfig,
    found: list[Candidate],
    batch: int,
    device: Device,
    precision: Precision,
    lora: LoRA | None = None,
) -> list[Ranked]:
    """``--only``: the named layouts' rows (those that do not fit too) and a line for each name;
    ``--out`` writes the fastest row that fits."""
    rows, lines = only_rows(args.only, config, found, batch, device, precision, args.top, lora)
    if rows:
        print("\n".join(table(rows, device.memory)))
    for line in lines:
        print(f"titan plan: {line}")
    if rows:
        _footer(precision)
    fits = [r for r in rows if r.memory_bytes <= device.memory]
    if args.out and fits:
        Path(args.out).write_text(overlay(fits[0]))
        print(
            f"titan plan: wrote {fits[0].label} {fits[0].options_label}{_split(fits[0])} to "
            f"{args.out}"
        )
    return rows
