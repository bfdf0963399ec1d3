"""``titan plan`` against published bf16 training runs on H100s: for each run, the planner's
prediction for the layout the publisher ran (its fastest step option of that layout, within what
the publisher states: schedule, virtual stages, the layers per stage: even unless it says), whether that layout fits the planner's memory
model, and the planner's own first row on the same devices, global batch and sequence length.

    python -m lightning_titan.tools.plan_published          # the table in docs/choosing_a_layout.md

Our decoder is matched to each model in its shapes (``ModelConfig`` below); the state is fp32 AdamW
(16 bytes a parameter) as the engine trains; the publishers' optimizers shard differently (Megatron's
distributed optimizer is our zero=1; FSDP, ZeRO-3, is nearest our zero=2).
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.mesh import AXES
from lightning_titan.plan.devices import GPUS, PER_NODE, on_nodes
from lightning_titan.plan.layouts import candidates
from lightning_titan.plan.precision import Precision
from lightning_titan.plan.rank import Ranked, ranked

MIXTRAL_8X7B = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                           ffn_dim=14336, n_experts=8, top_k=2, seq_len=4096)  # fmt: skip
QWEN3_30B_A3B = ModelConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                            attn_head_dim=128, ffn_dim=768, n_experts=128, top_k=8, seq_len=4096,
                            qk_norm="head")  # fmt: skip
GPT_OSS_120B = ModelConfig(vocab_size=201088, d_model=2880, n_layers=36, n_heads=64, n_kv_heads=8,
                           attn_head_dim=64, ffn_dim=2880, n_experts=128, top_k=4, seq_len=4096,
                           qkv_bias=True, attn_sinks=True, attn_out_bias=True, sliding_window=128,
                           expert_proj_bias=True, router_bias=True)  # fmt: skip


@dataclass(frozen=True)
class Published:
    model: str
    config: ModelConfig
    source: str
    devices: int
    global_batch: int
    layout: dict[str, int]  # in our mesh
    zero: int
    schedules: tuple[str, ...]  # the schedule (and chunks) the publisher states
    virtual_stages: int
    seconds: tuple[float, float]  # the published step time (a range where they give one)
    published_label: str  # the layout as the publisher writes it
    stage_layers: tuple[int, ...] | None = None  # the layers per stage it ran (None: even)


RUNS = (
    Published("Mixtral-8x7B", MIXTRAL_8X7B,
              "Megatron-LM, megatron/core/transformer/moe/README.md (438-468 TFLOPS/GPU)",
              64, 256, {"dp": 2, "pp": 4, "ep": 8}, 1, ("interleaved_1f1b",), 8, (2.90, 3.10),
              "TP1 EP8 PP4 VPP8, distributed optimizer"),
    Published("Qwen3-30B-A3B", QWEN3_30B_A3B, "NeMo AutoModel, performance summary", 8, 512,
              {"ep": 8}, 2, ("1f1b",), 1, (21.8, 21.8), "EP8 FSDP8"),
    Published("gpt-oss-120b", GPT_OSS_120B, "Megatron-Bridge, performance summary", 64, 1280,
              {"dp": 2, "pp": 4, "ep": 8}, 1, ("1f1b",), 1, (14.07, 14.07),
              "PP4 EP8, distributed optimizer"),
)  # fmt: skip
BF16 = Precision("bf16-mixed")


@dataclass(frozen=True)
class Prediction:
    run: Published
    theirs: Ranked | None  # the published layout's fastest step option (fitting or not)
    fits: bool
    best: Ranked | None  # the planner's first row

    @property
    def ratio(self) -> float:
        """Predicted over published (the middle of a published range)."""
        assert self.theirs is not None
        return self.theirs.cost.step / (sum(self.run.seconds) / 2)


def predict_run(run: Published, search: bool = True) -> Prediction:
    device = on_nodes(GPUS["h100-80gb"], run.devices, max(1, run.devices // PER_NODE))
    degrees = {a: run.layout.get(a, 1) for a in AXES}
    assert math.prod(degrees.values()) == run.devices, run
    with contextlib.redirect_stdout(io.StringIO()):
        found, _ = candidates(run.config, run.devices, run.global_batch)
    mine = [
        c
        for c in found
        if c.degrees == degrees and c.zero == run.zero and c.stage_layers == run.stage_layers
    ]
    rows = [
        r
        for r in ranked(run.config, mine, run.global_batch, device, precision=BF16, fitting=False)
        if r.options.schedule in run.schedules and r.options.virtual_stages == run.virtual_stages
    ]
    fitting = [r for r in rows if r.memory_bytes <= device.memory]
    theirs = (fitting or rows)[0] if rows else None
    best = None
    if search:
        first = ranked(run.config, found, run.global_batch, device, precision=BF16, keep=1)
        best = first[0] if first else None
    return Prediction(run, theirs, bool(fitting), best)


def _label(r: Ranked) -> str:
    """The row's layout and zero level, and its layers per stage where uneven."""
    split = f" [{r.candidate.split_label}]" if r.candidate.stage_layers else ""
    return r.label + split


def table(predictions: list[Prediction]) -> list[str]:
    lines = [
        "| run | devices | global batch | published layout | published step s | planner, that "
        "layout (fastest option) | predicted s | predicted / published | fits the memory model | "
        "planner's first row | its s |",
        "|---|---:|---:|---|---:|---|---:|---:|---|---|---:|",
    ]
    for p in predictions:
        run, r, best = p.run, p.theirs, p.best
        low, high = run.seconds
        published = f"{low:.2f}" if low == high else f"{low:.2f}-{high:.2f}"
        mine = f"{_label(r)} {r.options_label}" if r else "not accepted"
        best_label = f"{_label(best)} {best.options_label}" if best else "nothing fits"
        lines.append(
            f"| {run.model} ({run.source}) | {run.devices} | {run.global_batch} | "
            f"{run.published_label} | {published} | {mine} | "
            f"{r.cost.step:.2f} | {p.ratio:.2f} | {'yes' if p.fits else 'no'} | {best_label} | "
            f"{best.cost.step:.2f} |"
            if r and best
            else f"| {run.model} | {run.devices} | {run.global_batch} | {run.published_label} | "
            f"{published} | {mine} | | | | {best_label} | |"
        )
    return lines


def main() -> None:
    print("\n".join(table([predict_run(run) for run in RUNS])))


if __name__ == "__main__":
    main()
