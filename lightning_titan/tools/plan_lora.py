"""``titan plan`` for LoRA against a full fine-tune, on one node of eight H100 80 GB: the published
models' shapes (``tools/plan_published.py``), bf16-mixed, 4,096 tokens a sequence.

    python -m lightning_titan.tools.plan_lora          # the table in docs/lora.md

Each row: the planner's first layout and its predicted step and memory, or the smallest state a
rank could hold where nothing fits (the full fine-tune's 16 bytes a parameter).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.model.lora import LoRA
from lightning_titan.plan.devices import GPUS, on_nodes
from lightning_titan.plan.layouts import GB, candidates
from lightning_titan.plan.rank import ranked
from lightning_titan.tools.plan_published import BF16, GPT_OSS_120B, MIXTRAL_8X7B, QWEN3_30B_A3B

DEVICES, GLOBAL_BATCH = 8, 64
MODELS = (("Mixtral-8x7B", MIXTRAL_8X7B), ("Qwen3-30B-A3B", QWEN3_30B_A3B),
          ("gpt-oss-120b", GPT_OSS_120B))  # fmt: skip
ADAPTERS = {
    "full fine-tune": None,
    "LoRA r16 attention+experts": LoRA(rank=16, targets=("attention", "experts")),
    "LoRA r16 attention+experts, bf16 base": LoRA(
        rank=16, targets=("attention", "experts"), base_dtype="bf16"
    ),
}


@dataclass(frozen=True)
class Row:
    model: str
    how: str
    label: str  # the first layout and its options, or "nothing fits"
    step_s: float | None
    memory_gb: float  # its memory, or the least model state of any layout
    trained: int


def plan(name: str, config: ModelConfig, how: str, lora: LoRA | None) -> Row:
    device = on_nodes(GPUS["h100-80gb"], DEVICES, 1)
    with contextlib.redirect_stdout(io.StringIO()):
        found, _ = candidates(config, DEVICES, GLOBAL_BATCH, lora)
    trained = _trained(config, lora)
    fits = [c for c in found if c.state_bytes <= device.memory]
    rows = ranked(config, fits, GLOBAL_BATCH, device, precision=BF16, keep=1, lora=lora)
    if not rows:
        least = min(c.state_bytes for c in found) / GB
        return Row(name, how, "nothing fits", None, least, trained)
    r = rows[0]
    return Row(name, how, f"{r.label} {r.options_label}", r.cost.step, r.memory_bytes / GB, trained)


def _trained(config: ModelConfig, lora: LoRA | None) -> int:
    import torch

    from lightning_titan.model.decoder import StageModel

    with torch.device("meta"):
        model = StageModel(config, lora=lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| model | training | trained parameters | first layout (8 x H100 80 GB) | predicted step s "
        "| memory GB (least state where nothing fits) |",
        "|---|---|---:|---|---:|---:|",
    ]
    for r in rows:
        step = f"{r.step_s:.2f}" if r.step_s is not None else ""
        lines.append(
            f"| {r.model} | {r.how} | {r.trained / 1e9:.2f} B | {r.label} | {step} | "
            f"{r.memory_gb:.1f} |"
        )
    return lines


def main() -> None:
    rows = [
        plan(name, config, how, lora) for name, config in MODELS for how, lora in ADAPTERS.items()
    ]
    print("\n".join(table(rows)))
    print(
        f"\nbf16-mixed, {GLOBAL_BATCH} sequences of {MODELS[0][1].seq_len} tokens a step, "
        "AdamW; the planner's prices (docs/choosing_a_layout.md)."
    )


if __name__ == "__main__":
    main()
