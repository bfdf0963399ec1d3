"""Peak activation bytes per rank: what one sequence saves for backward, times what the schedule holds.

Per sequence the bytes come from the model itself: one step of a one- and a two-layer copy of it,
forward and loss under the bench's ``SavedTensorMeter``, on one sequence; the difference is one
block, the rest the embedding, head and loss. A wide model is measured at ``1/s`` of its width (heads,
``d_model``, ``ffn_dim`` divided by ``s``, head_dim, S and K kept) and its block
bytes multiplied by ``s``: everything a block saves is linear in those widths (the router's ``E``
scores, not scaled, are a rounding error). A vocabulary wider than ``PROBE_VOCAB`` is measured at
that width and twice it, and the ends' bytes (logits, the loss's rows) drawn through the two. Then, in microbatches held at the peak on stage ``p``:

    gpipe: M          1f1b: min(M, pp - p)          interleaved (v chunks): the doc's bound / v
    zb_h1: min(M, pp) (a forward's activations live until its W, which every stage defers)
    zbv: pp on every rank once the V is full (M >= 2 pp - 1), the replayed order before
    1f1b_overlap (pp=1): 1, as 1F1B (a pair's backward frees faster than its forward saves)
    dualpipev: pp on every rank, pp + 1/2 on the last (its first pair of the turn runs apart)

(each the count of live microbatches in the schedule's own order, ``parallel/pipeline/theory.py``: a test
holds them equal). Under zbv and dualpipev the embedding, head and loss are on rank 0, the V's turn.

Selective recompute (``activation_checkpointing="selective"``) is measured as it runs: the probe frees
the norms' and activations' outputs after use, and the meter counts what stays. Full activation
checkpointing keeps only each block's input (``m * S * D`` floats: the residual stream, fp32
under either precision) and, during one block's backward, that block's full activations again.

Under ``bf16-mixed`` the probe runs under the run's autocast (``plan/precision.py``), so each saved
tensor has the run's dtype. Autocast's bf16 copies of the weights, which autograd saves too, do not
scale with the tokens: the meter leaves them out, and they are counted from the stage's parameters
(the non-expert matrices once, autocast caches their copies for the step; each local expert's
``w1``, ``w2``, ``w3`` once per layer and held microbatch, a ``w[e]`` view is copied on every call).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from lightning_titan.model.config import FULL, NONE, Recompute
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.grad_kinds import EXPERT
from lightning_titan.model.moe.experts import probe_grouped_mm
from lightning_titan.model.options import LATENT
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.pipeline.schedules import V_SHAPED
from lightning_titan.parallel.pipeline.theory import live_peak
from lightning_titan.plan.cost import StepOptions
from lightning_titan.plan.memory import local_shape, stage_tensors
from lightning_titan.plan.precision import FP32, STATE_BYTES, Precision
from lightning_titan.runtime.saved_tensors import SavedTensorMeter

PROBE_WIDTH = 512  # the widest d_model measured as it is
# the largest vocabulary measured as it is: a 150k vocabulary's logits at 4,096 tokens held the
# probe at 8.6 GB; the ends' bytes are linear in V, so a wider one is priced from V and 2V
PROBE_VOCAB = 4096


def _scale(config: ModelConfig) -> int:
    """The largest ``s`` that divides the heads, kv heads and widths and leaves d_model >= 64."""
    best, latent = 1, config.attention.latent
    for s in range(2, config.n_heads + 1):
        widths = [config.n_heads, config.kv_heads, config.ffn_dim, config.d_model]
        if config.experts.shared_dim:
            widths.append(config.experts.shared_dim)
        widths += [w for w in (latent.kv_rank, latent.q_rank) if w]  # MLA's latents
        if all(w % s == 0 for w in widths) and config.d_model // s >= 64:
            best = s
        if config.d_model // best <= PROBE_WIDTH:
            break
    return best


# the nodes between a parameter and autocast's copy of it as a matmul reads it
_CAST_OR_VIEW = ("ToCopyBackward", "SelectBackward", "TBackward", "TransposeBackward", "View")


def _from_weight(node: object, depth: int = 4) -> bool:
    """Whether a saved tensor with grad_fn ``node`` is a parameter through casts and views only
    (autocast's copy of a weight, of ``w[e]``, transposed): not an activation such as the
    embedding's output, which also has one parameter as its only input."""
    for _ in range(depth):
        if node is None or not type(node).__name__.startswith(_CAST_OR_VIEW):
            return False
        inputs = [f for f, _ in getattr(node, "next_functions", ()) if f is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
        if type(node).__name__ == "AccumulateGrad":
            return True
    return False


class _ActivationMeter(SavedTensorMeter):
    """The meter, without autocast's weight copies (``weight_copy_bytes`` prices those)."""

    def _pack(self, tensor: torch.Tensor) -> object:
        if _from_weight(tensor.grad_fn):
            return tensor
        return super()._pack(tensor)


def _saved(config: ModelConfig, precision: Precision) -> int:
    torch.manual_seed(0)
    model = StageModel(config)
    probe_grouped_mm(model)  # the expert GEMM path training takes (the engine probes at setup)
    x = torch.randint(0, config.vocab_size, (1, config.seq_len))
    meter = _ActivationMeter(exclude=list(model.parameters()))
    with meter, precision.autocast():
        logits, aux = model(x)
        loss = model.token_loss_sum(logits, x) + aux.sum()
    del loss, logits, aux
    return meter.peak


_PER_SEQUENCE: dict[str, tuple[float, float]] = {}


def per_sequence(
    config: ModelConfig, precision: Precision = FP32, recompute: Recompute = NONE
) -> tuple[float, float]:
    """(bytes one block saves for one sequence, bytes of the embedding, head and loss), in the
    dtypes ``precision`` computes in, weight copies aside; ``recompute``: none or selective (the
    probe runs with it: what its blocks free after use is not counted)."""
    key = repr(config) + precision.name + recompute
    if key not in _PER_SEQUENCE:
        s, latent = _scale(config), config.attention.latent
        narrow = replace(
            config,
            d_model=config.d_model // s,
            n_heads=config.n_heads // s,
            n_kv_heads=None if config.n_kv_heads is None else config.n_kv_heads // s,
            ffn_dim=config.ffn_dim // s,
            shared_expert_dim=config.experts.shared_dim // s,
            attn_head_dim=None if config.attention.kind == LATENT else config.head_dim,
            kv_lora_rank=latent.kv_rank // s,
            q_lora_rank=latent.q_rank // s,
            # every block priced as an MoE block (DeepSeek-V3's few dense first layers save less)
            dense_layers=0,
            activation_checkpointing=recompute,
        )
        vocab = min(config.vocab_size, PROBE_VOCAB)
        one = _saved(replace(narrow, n_layers=1, vocab_size=vocab), precision)
        two = _saved(replace(narrow, n_layers=2, vocab_size=vocab), precision)
        ends: float = one - (two - one)
        if vocab < config.vocab_size:  # the logits and the loss's saved rows are linear in V
            wider = _saved(replace(narrow, n_layers=1, vocab_size=2 * vocab), precision)
            ends += (wider - one) * (config.vocab_size - vocab) / vocab
        _PER_SEQUENCE[key] = ((two - one) * s, ends)
    return _PER_SEQUENCE[key]


def held(options: StepOptions, pp: int, pp_rank: int) -> float:
    """Microbatches (of the whole stage) whose activations stage ``pp_rank`` holds at its peak."""
    m, v = options.microbatches, options.virtual_stages
    if options.schedule in ("1f1b", "1f1b_overlap"):
        return min(m, pp - pp_rank)
    if options.schedule == "interleaved_1f1b":
        return min(v * m, 2 * (pp - pp_rank - 1) + (v - 1) * pp + 1) / v
    if options.schedule == "zb_h1":
        return min(m, pp)
    if options.schedule == "zbv":
        if m >= 2 * pp - 1:
            return pp
        return live_peak("zbv", pp, pp_rank, 2, m, [1, 1])[1] / 2
    if options.schedule == "dualpipev":
        return pp + (pp_rank == pp - 1) / 2
    return m  # gpipe


def weight_copy_bytes(
    config: ModelConfig, degrees: dict[str, int], precision: Precision, fold_ep: bool = False
) -> tuple[float, float, float]:
    """Bytes of autocast's weight copies on one rank: (the non-expert ones of one block, kept once
    per step; the expert ones of one block, per microbatch: its own experts, ``fold_ep``: of the
    folded split; the LM head's). All 0 in fp32."""
    per_element = precision.weight_copy
    if not per_element:
        return 0.0, 0.0, 0.0
    dims = ParallelDims(**degrees, fold_ep=fold_ep)
    block, experts, head = 0, 0, 0
    for t in stage_tensors(config, 1, 0):
        numel = math.prod(local_shape(t, dims))
        if t.kind == EXPERT:
            experts += numel if t.name.startswith("layers.0.") else 0
        elif t.name.startswith("lm_head."):
            head += numel
        elif t.name.startswith("layers.0.") and len(t.shape) == 2:  # matmul weights, not norms
            block += numel
    return block * per_element, experts * per_element, head * per_element


def peak_bytes(
    config: ModelConfig,
    degrees: dict[str, int],
    options: StepOptions,
    global_batch: int,
    precision: Precision = FP32,
    copies: tuple[float, float, float] | None = None,
    stage_layers: tuple[int, ...] | None = None,
    fold_ep: bool = False,
) -> float:
    """Peak activation bytes of the fullest stage (one rank; tp and cp divide the positions, folded
    or not: a rank's experts compute as many token copies either way);
    ``copies``: ``weight_copy_bytes`` of these degrees (and ``fold_ep``), where the caller has them
    already; ``stage_layers``: layers per stage (None: ``n_layers / pp`` each)."""
    pp = degrees["pp"]
    full = options.recompute == FULL
    block, ends = per_sequence(config, precision, NONE if full else options.recompute)
    weights = (
        copies if copies is not None else weight_copy_bytes(config, degrees, precision, fold_ep)
    )
    block_copies, expert_copies, head_copies = weights
    share = degrees["tp"] * degrees["cp"]  # positions per rank (the head's logits: V/tp of them)
    m = global_batch // (degrees["dp"] * degrees["ep"]) / options.microbatches
    layers = stage_layers or (config.n_layers / pp,) * pp
    head = (
        0 if options.schedule in V_SHAPED else pp - 1
    )  # the rank with the embedding, head and loss
    if full:  # inputs kept, one block's activations live again during its backward
        kept = config.seq_len * config.d_model * STATE_BYTES
        peaks = [
            (held(options, pp, p) * layers[p] * kept + block) * m / share
            + block_copies
            + expert_copies
            for p in range(pp)
        ]
        peaks[head] += ends * m / share + head_copies
        return max(peaks)
    peaks = [
        held(options, pp, p) * layers[p] * (block * m / share + expert_copies)
        + layers[p] * block_copies
        for p in range(pp)
    ]
    peaks[head] += held(options, pp, head) * ends * m / share + head_copies
    return max(peaks)
