"""Peak activation bytes per rank: what one sequence saves for backward, times what the schedule holds.

Per sequence the bytes come from the model itself: one step of a one- and a two-layer copy of it,
forward and loss under the bench's ``SavedTensorMeter``, on one sequence; the difference is one
block, the rest the embedding, head and loss. A wide model is measured at ``1/s`` of its width (heads,
``d_model``, ``ffn_dim`` divided by ``s``, head_dim, S, K and the vocabulary kept) and its block
bytes multiplied by ``s``: everything a block saves is linear in those widths (the router's ``E``
scores, not scaled, are a rounding error). Then, in microbatches held at the peak on stage ``p``:

    gpipe: M          1f1b: min(M, pp - p)          interleaved (v chunks): the doc's bound / v
    zb_h1: min(M, pp) (a forward's activations live until its W, which every stage defers)
    zbv: pp on every rank once the V is full (M >= 2 pp - 1), the replayed order before

(each the count of live microbatches in the schedule's own order, ``parallel/pipeline/theory.py``: a test
holds them equal). Under zbv the embedding, head and loss are on rank 0, the V's turn.

Activation checkpointing keeps only each block's input (``m * S * D`` floats) and, during one block's
backward, that block's full activations again.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.pipeline.theory import live_peak
from lightning_titan.plan.cost import BYTES, StepOptions
from lightning_titan.runtime.saved_tensors import SavedTensorMeter

PROBE_WIDTH = 512  # the widest d_model measured as it is


def _scale(config: ModelConfig) -> int:
    """The largest ``s`` that divides the heads, kv heads and widths and leaves d_model >= 64."""
    best = 1
    for s in range(2, config.n_heads + 1):
        widths = [config.n_heads, config.kv_heads, config.ffn_dim, config.d_model]
        if config.shared_expert_dim:
            widths.append(config.shared_expert_dim)
        if all(w % s == 0 for w in widths) and config.d_model // s >= 64:
            best = s
        if config.d_model // best <= PROBE_WIDTH:
            break
    return best


def _saved(config: ModelConfig) -> int:
    torch.manual_seed(0)
    model = StageModel(config)
    x = torch.randint(0, config.vocab_size, (1, config.seq_len))
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    with meter:
        logits, aux = model(x)
        loss = model.token_loss_sum(logits, x) + aux.sum()
    del loss, logits, aux
    return meter.peak


_PER_SEQUENCE: dict[str, tuple[float, float]] = {}


def per_sequence(config: ModelConfig) -> tuple[float, float]:
    """(bytes one block saves for one sequence, bytes of the embedding, head and loss)."""
    key = repr(config)
    if key not in _PER_SEQUENCE:
        s = _scale(config)
        narrow = replace(
            config,
            d_model=config.d_model // s,
            n_heads=config.n_heads // s,
            n_kv_heads=None if config.n_kv_heads is None else config.n_kv_heads // s,
            ffn_dim=config.ffn_dim // s,
            shared_expert_dim=config.shared_expert_dim // s,
            attn_head_dim=config.head_dim,
            activation_checkpointing=False,
        )
        one, two = _saved(replace(narrow, n_layers=1)), _saved(replace(narrow, n_layers=2))
        _PER_SEQUENCE[key] = ((two - one) * s, one - (two - one))
    return _PER_SEQUENCE[key]


def held(options: StepOptions, pp: int, pp_rank: int) -> float:
    """Microbatches (of the whole stage) whose activations stage ``pp_rank`` holds at its peak."""
    m, v = options.microbatches, options.virtual_stages
    if options.schedule == "1f1b":
        return min(m, pp - pp_rank)
    if options.schedule == "interleaved_1f1b":
        return min(v * m, 2 * (pp - pp_rank - 1) + (v - 1) * pp + 1) / v
    if options.schedule == "zb_h1":
        return min(m, pp)
    if options.schedule == "zbv":
        if m >= 2 * pp - 1:
            return pp
        return live_peak("zbv", pp, pp_rank, 2, m, [1, 1])[1] / 2
    return m  # gpipe


def peak_bytes(
    config: ModelConfig, degrees: dict[str, int], options: StepOptions, global_batch: int
) -> float:
    """Peak activation bytes of the fullest stage (one rank; tp and cp divide the positions)."""
    pp = degrees["pp"]
    block, ends = per_sequence(config)
    share = degrees["tp"] * degrees["cp"]  # positions per rank (the head's logits: V/tp of them)
    m = global_batch // (degrees["dp"] * degrees["ep"]) / options.microbatches
    layers = config.n_layers / pp
    head = 0 if options.schedule == "zbv" else pp - 1  # the rank with the embedding, head and loss
    if options.recompute:  # inputs kept, one block's activations live again during its backward
        kept = config.seq_len * config.d_model * BYTES
        peaks = [held(options, pp, p) * layers * kept + block for p in range(pp)]
        peaks[head] += ends
        return max(peaks) * m / share
    peaks = [held(options, pp, p) * layers * block for p in range(pp)]
    peaks[head] += held(options, pp, head) * ends
    return max(peaks) * m / share
