"""``titan plan`` against published training runs on H100s: for each run, the planner's
prediction for the layout the publisher ran (its fastest step option of that layout, within what
the publisher states: schedule, virtual stages, the layers per stage: even unless it says), whether that layout fits the planner's memory
model, and the planner's own first row on the same devices, global batch and sequence length. The
predictions are bf16-mixed; a run published in another precision only (FP8) gets no ratio.

    python -m lightning_titan.tools.plan_published          # the table in docs/choosing_a_layout.md

Our decoder is matched to each model in its shapes (``ModelConfig`` below); the state is fp32 AdamW
(16 bytes a parameter) as the engine trains; the publishers' optimizers shard differently (Megatron's
distributed optimizer is our zero=1; FSDP, ZeRO-3, is nearest our zero=2).
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass, replace

from lightning_titan.hf.load import config_from_hf
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.mesh import AXES
from lightning_titan.plan.cost import balanced_split
from lightning_titan.plan.devices import GPUS, PER_NODE, on_nodes
from lightning_titan.plan.layouts import candidate, candidates
from lightning_titan.plan.precision import Precision
from lightning_titan.plan.rank import Ranked, ranked

MIXTRAL_8X7B = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                           ffn_dim=14336, n_experts=8, top_k=2, seq_len=4096)  # fmt: skip
QWEN3_30B_A3B = ModelConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                            attn_head_dim=128, ffn_dim=768, n_experts=128, top_k=8, seq_len=4096,
                            qk_norm="head")  # fmt: skip
# Qwen3-235B-A22B's config.json (huggingface.co/Qwen/Qwen3-235B-A22B), its shapes
QWEN3_235B_A22B = ModelConfig(vocab_size=151936, d_model=4096, n_layers=94, n_heads=64,
                              n_kv_heads=4, attn_head_dim=128, ffn_dim=1536, n_experts=128,
                              top_k=8, seq_len=4096, qk_norm="head")  # fmt: skip
GPT_OSS_120B = ModelConfig(vocab_size=201088, d_model=2880, n_layers=36, n_heads=64, n_kv_heads=8,
                           attn_head_dim=64, ffn_dim=2880, n_experts=128, top_k=4, seq_len=4096,
                           qkv_bias=True, attn_sinks=True, attn_out_bias=True, sliding_window=128,
                           expert_proj_bias=True, router_bias=True)  # fmt: skip


# DeepSeek-V3's config.json (huggingface.co/deepseek-ai/DeepSeek-V3), its shapes: the FP8
# quantization_config says how the published weights are stored, and is left out (bf16 runs)
DEEPSEEK_V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128,
    "vocab_size": 129280,
}  # fmt: skip
DEEPSEEK_V3 = config_from_hf(DEEPSEEK_V3_JSON, "deepseek-ai/DeepSeek-V3", ModelConfig(seq_len=4096))


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
    dispatch: str = "all-to-all"  # how its EP dispatch is priced (plan/cost.py DISPATCHERS)
    note: str = ""  # what of the published layout is priced how
    fold_ep: bool = False  # the experts over the ep x cp x tp ranks of a stage (Parallel Folding)
    # the precision of the published step time: a run published in FP8 only has no bf16 time to
    # hold the (bf16) prediction against
    precision: str = "bf16"
    published_as: str = ""  # the step time as published, where it is not a bf16 time


AUTOMODEL = (
    "NeMo AutoModel, docs.nvidia.com/nemo/automodel/latest/performance/performance-summary.html"
)
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
    # AutoModel's two DeepSeek-V3 runs: FSDP over the 64 (256) ranks of a stage is our zero=2 over
    # dp x ep; DeepEP's dispatcher (node-dedup); VP8: 61 layers over 32 virtual stages, 16, 16,
    # 15, 14 a rank (the planner's balanced split) dealt over its 8 chunks (cost.virtual_split:
    # 2 a chunk, 1 and 0 on the last two, the last with the head)
    Published("DeepSeek-V3", DEEPSEEK_V3, AUTOMODEL, 256, 512, {"pp": 4, "ep": 64}, 2,
              ("interleaved_1f1b",), 8, (8.18, 8.18), "PP4 VP8 EP64 FSDP64, DeepEP",
              (16, 16, 15, 14), "node-dedup", "61 layers over 32 virtual stages, split unevenly"),
    Published("DeepSeek-V3", DEEPSEEK_V3, AUTOMODEL, 1024, 8192, {"dp": 4, "pp": 4, "ep": 64},
              2, ("interleaved_1f1b",), 8, (37.87, 37.87), "PP4 VP8 EP64 FSDP256, DeepEP",
              (16, 16, 15, 14), "node-dedup", "61 layers over 32 virtual stages, split unevenly"),
    # Megatron-Bridge's TP2 PP8 VP4 EP32 ETP1 on 256 H100: the dense part TP2 x DP16, the experts
    # folded over the 32 ranks of a stage (MoE Parallel Folding), whole on each (ETP1): our
    # pp8 x ep16 x tp2 folded (ep16 x tp2 = 32 expert ranks; 16 data ranks). 94 layers over 32
    # virtual stages on the planner's balanced split. Its only H100 row is FP8
    Published("Qwen3-235B-A22B", QWEN3_235B_A22B,
              "Megatron-Bridge, docs/performance-summary.md, 26.02 container", 256, 8192,
              {"pp": 8, "ep": 16, "tp": 2}, 1, ("interleaved_1f1b",), 4, (80.3, 80.3),
              "TP2 PP8 VP4 EP32 (ETP1), distributed optimizer", balanced_split(QWEN3_235B_A22B, 8),
              note="94 layers over 32 virtual stages, split unevenly", fold_ep=True,
              precision="FP8", published_as="80.3 (FP8: 1,633 tokens/s/GPU)"),
)  # fmt: skip
BF16 = Precision("bf16-mixed")


@dataclass(frozen=True)
class Prediction:
    run: Published
    theirs: Ranked | None  # the published layout's fastest step option (fitting or not)
    fits: bool
    best: Ranked | None  # the planner's first row

    @property
    def ratio(self) -> float | None:
        """Predicted over published (the middle of a published range); None where the published
        time is not bf16's."""
        assert self.theirs is not None
        if self.run.precision != "bf16":
            return None
        return self.theirs.cost.step / (sum(self.run.seconds) / 2)


def predict_run(run: Published, search: bool = True) -> Prediction:
    device = on_nodes(GPUS["h100-80gb"], run.devices, max(1, run.devices // PER_NODE))
    device = replace(device, dispatch=run.dispatch)
    degrees = {a: run.layout.get(a, 1) for a in AXES}
    assert math.prod(degrees.values()) == run.devices, run
    layout = candidate(
        run.config, degrees, run.zero, run.global_batch, run.stage_layers, run.fold_ep
    )
    mine = [] if isinstance(layout, str) else [layout]
    rows = [
        r
        for r in ranked(run.config, mine, run.global_batch, device, precision=BF16, fitting=False)
        if r.options.schedule in run.schedules and r.options.virtual_stages == run.virtual_stages
    ]
    fitting = [r for r in rows if r.memory_bytes <= device.memory]
    theirs = (fitting or rows)[0] if rows else None
    best = None
    if search:
        with contextlib.redirect_stdout(io.StringIO()):
            found, _ = candidates(run.config, run.devices, run.global_batch)
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
        published = run.published_as or published
        mine = f"{_label(r)} {r.options_label}" if r else "not accepted"
        if run.dispatch != "all-to-all":
            mine += f", {run.dispatch} dispatch"
        if run.note:
            mine += f" ({run.note})"
        best_label = f"{_label(best)} {best.options_label}" if best else "not searched"
        if best and run.dispatch != "all-to-all":
            best_label += f", {run.dispatch} dispatch"
        ratio = p.ratio if r else None
        against = (
            f"{ratio:.2f}"
            if ratio is not None
            else f"none: no bf16 run is published, only {run.precision}"
        )
        predicted = f"{r.cost.step:.2f} | {against} | {'yes' if p.fits else 'no'}" if r else "| |"
        lines.append(
            f"| {run.model} ({run.source}) | {run.devices} | {run.global_batch} | "
            f"{run.published_label} | {published} | {mine} | {predicted} | {best_label} | "
            f"{f'{best.cost.step:.2f}' if best else ''} |"
        )
    return lines


def main() -> None:
    print("\n".join(table([predict_run(run) for run in RUNS])))


if __name__ == "__main__":
    main()
