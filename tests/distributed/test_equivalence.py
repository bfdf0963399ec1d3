"""Every composition and schedule trains the same model as one process.

One spawn per world size runs all of its layouts x schedules; the parent compares each rank's per-step
loss, aux loss and pre-clip grad norm (rtol 1e-5) and its slice of the final weights (atol 1e-5) with a
single-process run of the same model on the same global batches. Clipping bites on every step and the aux
losses are on. ZeRO cases (also under TP and CP) check that each rank holds only its share of the
optimizer state (and at zero=2 of the grads, after the step). Tensor-parallel layouts are
(dp, pp, ep, tp): each rank holds its slice of the heads and of the padded vocabulary (the padding
stays zero), and the loss is the vocab-parallel cross-entropy. Context-parallel layouts are
(dp, pp, ep, tp, cp): each rank computes its positions of every sequence. BIAS cases turn on
aux-loss-free balancing (the expert bias, with the aux loss still on) and compare with a
single-process run of that config, final biases bit for bit.
SPLIT cases cut the layers unevenly (``layers=3-1``: stage_layers) and over virtual stages
(``interleaved_1f1b:v2``: two chunks per rank), or as a probe on rank 0 balances them (``auto``); DEEP_CONFIG has 8 layers for 2 chunks on 4 stages.
ZERO_BUBBLE cases run ZB-H1 (B/W split backward), also under activation checkpointing, and ZBV
(two chunks per rank in a V, B/W split: the loss on rank 0, the turn of the V on the last rank).
Every case also checks a forward-only pass (validation) of the trained model against the reference.
CAPACITY cases cap each expert's share of a sequence: the same assignments are dropped on every step
(counts equal to one process's) and no local expert receives more rows than the capacity allows.
FAMILY cases turn on the options of the pretrained families (QK-norm per head or over the whole
projection, q/k/v biases, a shared expert, sigmoid routing without renormalisation; gpt-oss's sinks,
window layers, biases, clamped SwiGLU and YaRN; DeepSeek-V3's latent attention, group-limited routing
and dense first layer).
OVERLAP cases run the schedules that overlap one microbatch's forward with another's backward
(1f1b_overlap on one stage, DualPipeV on the V), each rank's two halves handing the rank over at every
all-to-all they start (checked: they did, and no other schedule did).
ADAMW cases run ZeRO under torch's foreach and fused AdamW; MASKED cases train on targets partly
ignored (-100), whose loss is the mean over the step's counted targets. PACKED cases pack several
documents a sequence (block-diagonal causal attention, RoPE from each document's start).
FOLD cases run MoE Parallel Folding (fold_ep): the experts split over the ep x cp x tp ranks of a
stage, under every schedule that runs expert parallelism.
"""

from dataclasses import replace

import pytest
import torch
from engine_harness import (
    ACKPT_CONFIG,
    BIAS_CONFIG,
    CAPACITY_CONFIG,
    CONFIG,
    DEEP_CONFIG,
    FAMILY_CONFIGS,
    MAX_NORM,
    SELECTIVE_CONFIG,
    assert_matches_reference,
    reference,
    run_layouts,
)

from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.pipeline.schedules import OVERLAPPED
from lightning_titan.plan.memory import rank_state, step_grad_bytes
from lightning_titan.runtime.launch import run_on_ranks

SCHEDULES = ("gpipe", "1f1b")
CASES = {
    2: [((2, 1, 1), 1), ((1, 2, 1), 2), ((1, 1, 2), 2)],
    4: [
        ((2, 2, 1), 2),
        ((1, 2, 2), 2),
        ((2, 1, 2), 2),
        ((1, 4, 1), 4),
        ((1, 4, 1), 2),
        ((1, 1, 4), 1),
        ((1, 4, 1), 8),
    ],
    8: [((2, 2, 2), 2)],
}
# The pipeline transport CUDA gets (receives posted with their exchange), run here on gloo.
PAIRED = {2: [((1, 2, 1), 2)], 4: [((1, 4, 1), 8), ((1, 2, 2), 2)], 8: []}
# ZeRO under torch's AdamW implementations (the reference: the default, for-loop one); fused steps
# a tensor as one run of memory, so the expert shards (strided rows of dim 1) must be dense leaves
ADAMW = {
    2: [((2, 1, 1), "1f1b:zero1:adamw=fused", 1), ((2, 1, 1), "1f1b:zero2:adamw=fused", 1)],
    4: [((2, 1, 2), "1f1b:zero1:adamw=fused", 2), ((2, 1, 2), "1f1b:zero2:adamw=foreach", 2)],
    8: [],
}
# Targets partly ignored (-100, another count on each rank and microbatch; reference(masked=True)):
# the loss is the mean over the step's counted targets under every layout, schedule and ZeRO level
MASKED = {
    2: [
        ((2, 1, 1), "1f1b:masked", 2),
        ((1, 2, 1), "zbv:masked", 4),
        ((1, 1, 1, 2), "1f1b:masked", 1),  # tp2: the vocab-parallel loss
        ((1, 1, 1, 1, 2), "1f1b:masked", 1),  # cp2: each rank counts its positions
    ],
    4: [((2, 1, 2), "1f1b:masked:zero2", 2), ((1, 2, 2), "dualpipev:masked", 4)],
    8: [((2, 2, 2), "1f1b:masked", 2)],
}
# Packed documents (several a sequence, attention and RoPE positions per document; the targets
# that would cross a document left out; reference(packed=True)): the ids reach every stage, are cut
# like the tokens under CP, and hold for sinks with window layers (gpt_oss) and MLA (deepseek)
PACKED = {
    2: [
        ((2, 1, 1), "1f1b:packed", 2),
        ((1, 2, 1), "1f1b:packed", 2),
        ((1, 1, 1, 2), "1f1b:packed", 1),
        ((1, 1, 1, 1, 2), "1f1b:packed", 1),
        ((1, 1, 1, 1, 2), "1f1b:packed", 1, "gpt_oss"),
        ((1, 1, 1, 1, 2), "1f1b:packed", 1, "deepseek"),
    ],
    4: [((2, 1, 2), "1f1b:packed", 2), ((1, 2, 1, 1, 2), "1f1b:packed", 2, "gpt_oss")],
    # every 8-rank layout with the default model, gpt-oss and DeepSeek-V3: dp2 x pp2 x ep2,
    # tp2 x pp2 x ep2, cp2 x pp2 x ep2, and DualPipeV's dp2 x pp2 x ep2 (16-sequence batches)
    8: [
        (layout, schedule, m, *family)
        for layout, schedule, m in [
            ((2, 2, 2), "1f1b:packed", 2),
            ((1, 2, 2, 2), "1f1b:packed", 2),
            ((1, 2, 2, 1, 2), "1f1b:packed", 2),
            ((2, 2, 2), "dualpipev:packed:batch=16", 4),  # reference(batch=16, packed=True)
        ]
        for family in [(), ("gpt_oss",), ("deepseek",)]
    ],
}
# Tensor parallelism with sequence parallelism, composed with the other axes: (dp, pp, ep, tp)
TP = {
    2: [((1, 1, 1, 2), "1f1b", 1), ((1, 1, 1, 2), "gpipe", 2)],
    4: [
        ((1, 1, 1, 4), "1f1b", 2),
        ((2, 1, 1, 2), "1f1b", 1),
        ((1, 2, 1, 2), "gpipe", 2),
        ((1, 2, 1, 2), "1f1b", 4),
        ((1, 1, 2, 2), "1f1b", 2),
    ],
    8: [((2, 1, 2, 2), "1f1b", 1), ((1, 2, 2, 2), "1f1b", 2), ((1, 2, 2, 2), "gpipe", 2)],
}
# Context parallelism (load-balanced causal chunks, K/V all-gathered), composed: (dp, pp, ep, tp, cp)
CP = {
    2: [((1, 1, 1, 1, 2), "1f1b", 1)],
    4: [
        ((1, 1, 1, 1, 4), "1f1b", 2),
        ((1, 2, 1, 1, 2), "gpipe", 2),
        ((1, 2, 1, 1, 2), "1f1b", 2),
        ((1, 1, 2, 1, 2), "1f1b", 2),
        ((1, 1, 1, 2, 2), "1f1b", 1),
    ],
    8: [((2, 1, 2, 1, 2), "1f1b", 1), ((1, 2, 1, 2, 2), "1f1b", 2)],
}
# ZeRO-1: the optimizer state split over the data-parallel groups; ZeRO-2: and the grads. Both levels.
# Under TP a cut weight's state is split over dp x ep x cp along the dim TP does not cut, the norms',
# routers' and experts' over their groups with the TP ranks in them.
ZERO = {
    2: [((2, 1, 1), "1f1b", 1), ((1, 1, 2), "1f1b", 2)],  # ep2: experts whole, the rest over ep
    4: [
        ((2, 1, 2), "1f1b", 2),
        ((4, 1, 1), "gpipe", 1),
        ((2, 1, 1, 2), "1f1b", 1),  # dp2 x tp2
        ((1, 1, 1, 2, 2), "1f1b", 1),  # cp2 x tp2: the TP-cut weights over cp only
    ],
    8: [
        ((2, 2, 2), "1f1b", 2),
        ((2, 2, 2), "gpipe", 2),
        ((2, 1, 2, 2), "1f1b", 1),  # dp2 x ep2 x tp2
        ((2, 2, 1, 2), "gpipe", 2),  # dp2 x pp2 x tp2
    ],
}

# The expert bias (BIAS_CONFIG): its counts summed over dp, ep, tp and cp ranks, kept per stage
BIAS = {
    2: [
        ((2, 1, 1), "1f1b", 1),
        ((1, 2, 1), "1f1b", 2),
        ((1, 1, 2), "gpipe", 2),
        ((1, 1, 1, 2), "1f1b", 1),
        ((1, 1, 1, 1, 2), "1f1b", 1),
    ],
    4: [((1, 1, 2, 2), "1f1b:fold", 2)],  # the loads of the folded experts' owners
    8: [((2, 2, 2), "1f1b", 2)],
}
# Expert capacity (CAPACITY_CONFIG): the drops per sequence, its queue counted over its cp x tp ranks
CAPACITY = {
    2: [
        ((2, 1, 1), "1f1b", 1),
        ((1, 2, 1), "1f1b", 2),
        ((1, 1, 2), "gpipe", 2),
        ((1, 1, 2), "1f1b_overlap", 4),  # the static slots' exchanges inside a pair's halves
        ((1, 1, 1, 2), "1f1b", 1),
        ((1, 1, 1, 1, 2), "1f1b", 1),
    ],
    4: [((1, 1, 1, 2, 2), "1f1b", 2), ((1, 1, 2, 2), "1f1b:fold", 2)],  # each TP slice: its slots
    8: [((1, 2, 2, 2), "1f1b", 2)],
}

# Uneven and interleaved splits (``<schedule>:v2``, ``:layers=a-b-..``), composed with ep and dp;
# a zero-layer first (embedding) or last (head) stage included
SPLIT = {
    2: [
        ((1, 2, 1), "interleaved_1f1b:v2", 2),
        ((1, 2, 1), "interleaved_1f1b:v2:paired", 4),
        ((1, 2, 1), "interleaved_1f1b:v2:layers=2-1-1-0", 2),
        ((1, 2, 1), "1f1b:layers=3-1", 2),
        ((1, 2, 1), "gpipe:layers=0-4", 2),
        ((1, 2, 1), "1f1b:auto", 2),
    ],
    4: [
        ((1, 4, 1), "interleaved_1f1b:v2", 4, DEEP_CONFIG),
        ((1, 4, 1), "interleaved_1f1b:v2:layers=0-1-2-1-1-1-2-0", 8, DEEP_CONFIG),
        ((1, 2, 2), "interleaved_1f1b:v2", 2),
        ((2, 2, 1), "interleaved_1f1b:v2", 2),  # a reducer with ranks: synced for the last backward
        ((2, 2, 1), "interleaved_1f1b:v2:zero2", 2),
        ((1, 2, 2), "interleaved_1f1b:v2:paired", 4),
        ((1, 4, 1), "1f1b:layers=2-1-1-0", 4),
        ((1, 2, 2), "interleaved_1f1b:v2:auto", 2),
        ((1, 2, 1, 1, 2), "interleaved_1f1b:v2", 2),  # cp2 x pp2
    ],
    8: [((2, 2, 2), "interleaved_1f1b:v2", 2), ((2, 2, 2), "1f1b:layers=1-3", 2)],
}
# ZB-H1 (each backward split into the input grad and the deferred weight grads); ACKPT_CONFIG
# recomputes each block in backward (the same numbers as CONFIG: compared with its reference)
ZERO_BUBBLE = {
    2: [
        ((1, 2, 1), "zb_h1", 4),
        ((1, 2, 1), "zb_h1:paired", 2),
        ((1, 2, 1), "zb_h1:layers=3-1", 2),
        ((1, 2, 1), "zbv", 4),
        ((1, 2, 1), "zbv:paired", 2),  # the GPU path on gloo (NCCL ordering: test_nccl_strict.py)
        ((1, 2, 1), "zbv:layers=1-1-2-0", 1),  # M < 2P-1: the V never full; a headless chunk
        ((1, 2, 1), "zb_h1:auto", 2),
    ],
    4: [
        ((1, 4, 1), "zb_h1", 8),
        ((1, 2, 2), "zb_h1", 4),
        ((2, 2, 1), "zb_h1", 2),
        ((2, 2, 1), "zb_h1:zero2", 2),  # the sharded reducer's hooks fire in W
        ((1, 2, 1, 2), "zb_h1", 2),  # tp2 x pp2: W through the sequence-parallel region
        ((1, 2, 2), "zb_h1", 2, ACKPT_CONFIG),
        ((1, 2, 2), "interleaved_1f1b:v2", 2, ACKPT_CONFIG),
        ((1, 2, 2), "zbv", 4),  # pp2 x ep2: each chunk's all-to-alls in the V's order
        ((2, 2, 1), "zbv", 2),  # dp2 x pp2: the reducers sync for the step's last W
        # the middle ranks of the V (M=4: at M=8 DEEP_CONFIG's grad norm drifted to 1.0e-5 by step
        # 4 under interleaved_1f1b as under zbv while the harness's AdamW had eps=1e-6: rounding)
        ((1, 4, 1), "zbv", 4, DEEP_CONFIG),
        ((1, 2, 2), "zbv:auto", 2),  # the probe's counts over the V's four virtual stages
    ],
    8: [((2, 2, 2), "zb_h1", 2), ((2, 2, 2), "zbv", 2)],
}

# The families' options (engine_harness.FAMILY_CONFIGS) on every axis: (layout, schedule, M, name).
# qk_head under tp2: its explicit head_dim leaves grads of ~1e-6 whose TP rounding (~5e-8) AdamW's
# eps amplified past rtol 1e-5 while the harness used eps=1e-6; at eps=1e-3 it holds
FAMILY = {
    2: [
        ((1, 1, 1, 2), "1f1b", 1, "qk_full"),
        ((1, 1, 2), "1f1b", 2, "qk_full"),
        ((1, 1, 1, 1, 2), "1f1b", 1, "qk_head"),
        ((1, 1, 1, 2), "1f1b", 1, "qk_head"),
    ],
    4: [
        ((1, 2, 1, 2), "gpipe", 2, "qk_full"),
        ((2, 1, 2), "1f1b:zero1", 2, "qk_head"),
        ((1, 2, 2), "1f1b", 2, "qk_full"),  # the shared expert under the all-to-alls, pipelined
    ],
    8: [
        ((2, 2, 2), "1f1b", 2, "qk_head"),
        ((1, 2, 2, 2), "1f1b", 2, "qk_full"),
        ((1, 2, 2, 1, 2), "1f1b", 2, "gpt_oss"),  # the aux losses and clipping on, under cp
        ((1, 2, 2, 2), "1f1b", 2, "deepseek"),  # MLA's heads split, its down-projections whole
        ((1, 2, 2, 1, 2), "1f1b", 2, "deepseek"),  # the latent gathered over CP
        # the dense layer alone on stage 0; the ungated shared expert under the all-to-alls
        ((2, 2, 2), "1f1b:layers=1-3:zero2", 2, "deepseek"),
    ],
}
# The overlapped schedules: one microbatch's forward with another's whole backward on two threads,
# handing the rank over at every started all-to-all (parallel/overlap.py). dualpipev needs M >= 2P:
# under dp x ep (2 sequences a rank) its cases take global batches of 16 (``:batch=16``)
# selective recompute (the norms' outputs and the experts' activations discarded, recomputed in the
# backward) under the axes, the B/W split, the overlapped pair's two threads and packed documents;
# a name: that family's options recomputed so (MLA, the shared expert, the dense layer)
SELECTIVE = {
    2: [((1, 1, 2), "1f1b_overlap", 4)],
    4: [
        ((1, 2, 2), "zbv", 4),
        ((1, 2, 1, 1, 2), "1f1b", 2),  # cp2 x pp2
        ((1, 2, 2), "1f1b:packed", 2),
    ],
    8: [
        ((2, 2, 2), "1f1b", 2),
        ((1, 2, 2, 2), "1f1b", 2),  # tp2 x pp2 x ep2
        ((1, 2, 2, 2), "1f1b", 2, "deepseek"),
    ],
}
SELECTIVE_FAMILY = {
    name: replace(FAMILY_CONFIGS[name], activation_checkpointing="selective")
    for name in ("deepseek",)
}

OVERLAP = {
    2: [((1, 1, 2), "1f1b_overlap", 4)],
    4: [
        ((1, 2, 2), "dualpipev", 4),
        ((1, 2, 2), "dualpipev:paired", 4),  # the GPU path's batches: two messages to one peer
        ((2, 1, 2), "1f1b_overlap:zero1", 2),
        ((1, 1, 4), "1f1b_overlap", 2),
        ((1, 1, 2, 2), "1f1b_overlap", 2),  # tp2 x ep2: TP's collectives inside both halves
    ],
    8: [
        ((2, 2, 2), "dualpipev:batch=16", 4),
        ((2, 2, 2), "dualpipev:batch=16:zero2", 4),  # the sharded reducer's hooks in the pairs
        ((1, 2, 2, 2), "dualpipev", 4),
        ((1, 2, 2, 1, 2), "dualpipev", 4),
    ],
}
# MoE Parallel Folding (``:fold``, fold_ep): the experts split over the ep x cp x tp ranks of a
# stage (4 experts: one a rank), each TP/CP rank sending its own tokens; attention keeps tp and cp
FOLD = {
    2: [((1, 1, 1, 2), "1f1b:fold", 1)],  # tp2 alone: EP2 over the TP ranks
    4: [
        ((1, 1, 2, 2), "1f1b:fold", 2),  # ep2 x tp2 -> EP4
        ((1, 1, 2, 2), "gpipe:fold", 2),
        ((1, 1, 2, 2), "1f1b_overlap:fold", 2),  # the folded all-to-alls in the overlapped halves
        ((1, 1, 1, 2, 2), "1f1b:fold", 2),  # cp2 x tp2 -> EP4 over the sequence's ranks
        ((2, 1, 1, 2), "1f1b:fold", 1),  # dp2 x tp2 -> EP2 over tp, the experts reduced over dp
        ((2, 1, 1, 2), "1f1b:fold:zero2", 1),  # the experts' state and grads over dp only
    ],
    8: [
        ((1, 2, 2, 2), "1f1b:fold", 2),  # tp2 x pp2 x ep2 -> EP4 a stage
        ((1, 2, 2, 2), "gpipe:fold", 2),
        ((1, 2, 2, 2), "interleaved_1f1b:v2:fold", 2),
        ((1, 2, 2, 2), "zb_h1:fold", 2),
        ((1, 2, 2, 2), "zbv:fold", 2),
        ((1, 2, 2, 2), "dualpipev:fold", 4),
        ((1, 2, 1, 2, 2), "1f1b:fold", 2),  # cp2 x tp2 x pp2
        ((2, 1, 2, 2), "1f1b:fold", 1),  # dp2 x ep2 x tp2: the experts' own reducer, over dp
        ((2, 1, 2, 2), "1f1b:fold:zero1", 1),
    ],
}
# a folded checkpoint (after step 2) resumed unfolded, saved again after step 4, resumed folded:
# the expert rows are global, so each run continues the single process's (ep2 x tp2, 4 ranks)
FOLD_CHECKPOINT = {
    2: [],
    4: [
        ((1, 1, 2, 2), "1f1b:fold:save=2", 2),
        ((1, 1, 2, 2), "1f1b:resume=2:save=4", 2),
        ((1, 1, 2, 2), "1f1b:fold:resume=4", 2),
    ],
    8: [],
}
# and with a shared expert (its halves under the exchanges too), and DeepSeek-V3's blocks
OVERLAP_FAMILY = {
    2: [((1, 1, 2), "1f1b_overlap", 2, "qk_full")],
    4: [],
    8: [((1, 2, 2, 2), "dualpipev", 4, "deepseek")],
}


@pytest.fixture(scope="module")
def family_refs():
    return {name: reference(config) for name, config in FAMILY_CONFIGS.items()}


@pytest.fixture(scope="module")
def ref():
    result = reference()
    assert min(result["norm"]) > MAX_NORM, "clipping must bite for the test to check it"
    assert min(result["aux"]) > 0
    return result


@pytest.fixture(scope="module")
def bias_ref(ref):
    result = reference(BIAS_CONFIG)
    assert result["loss"] != ref["loss"], "the bias must change some selections to be tested"
    assert all(b.abs().sum() > 0 for b in result["biases"].values())
    return result


@pytest.fixture(scope="module")
def wide_ref():
    return reference(batch=16)


@pytest.fixture(scope="module")
def masked_ref(ref):
    result = reference(masked=True)
    assert result["loss"] != ref["loss"]
    return result


@pytest.fixture(scope="module")
def packed_refs(ref):
    """The packed single-process runs: CONFIG's (under None) and the families' in PACKED."""
    names = {c[3] for cases in PACKED.values() for c in cases if len(c) > 3}
    out = {name: reference(FAMILY_CONFIGS[name], packed=True) for name in names}
    out[None] = reference(packed=True)
    # dualpipev's 16-sequence batches: ("wide", None) for CONFIG, ("wide", name) for a family
    wide = {
        c[3] if len(c) > 3 else None for cs in PACKED.values() for c in cs if "batch=16" in c[1]
    }
    for name in wide:
        config = () if name is None else (FAMILY_CONFIGS[name],)
        out["wide", name] = reference(*config, batch=16, packed=True)
    assert out[None]["loss"] != ref["loss"], "packing must change the losses to be tested"
    return out


@pytest.fixture(scope="module")
def deep_ref():
    return reference(DEEP_CONFIG)


@pytest.fixture(scope="module")
def capacity_ref(ref):
    result = reference(CAPACITY_CONFIG)
    assert min(result["dropped"]) > 0, "assignments must be dropped on every step to be tested"
    assert result["loss"] != ref["loss"]
    return result


@pytest.mark.slow
@pytest.mark.timeout(620)
@pytest.mark.parametrize("world", sorted(CASES))
def test_every_layout_equals_one_process(
    ref, bias_ref, deep_ref, capacity_ref, family_refs, wide_ref, masked_ref, packed_refs, world,
    tmp_path,
):  # fmt: skip
    cases = [(layout, schedule, m) for layout, m in CASES[world] for schedule in SCHEDULES]
    cases += [(layout, f"{s}:paired", m) for layout, m in PAIRED[world] for s in SCHEDULES]
    cases += [(layout, f"{s}:zero{z}", m) for layout, s, m in ZERO[world] for z in (1, 2)]
    cases += TP[world] + CP[world] + ADAMW[world] + MASKED[world]
    cases += [(layout, schedule, m, BIAS_CONFIG) for layout, schedule, m in BIAS[world]]
    cases += SPLIT[world] + ZERO_BUBBLE[world]
    cases += [(layout, schedule, m, CAPACITY_CONFIG) for layout, schedule, m in CAPACITY[world]]
    cases += [(lay, s, m, FAMILY_CONFIGS[name]) for lay, s, m, name in FAMILY[world]]
    cases += OVERLAP[world] + FOLD[world]
    cases += [
        (c[0], c[1], c[2], SELECTIVE_FAMILY[c[3]] if len(c) > 3 else SELECTIVE_CONFIG)
        for c in SELECTIVE[world]
    ]
    cases += [(lay, s, m, FAMILY_CONFIGS[name]) for lay, s, m, name in OVERLAP_FAMILY[world]]
    packed_names = {id(FAMILY_CONFIGS[c[3]]): c[3] for c in PACKED[world] if len(c) > 3}
    cases += [(c[0], c[1], c[2], *(FAMILY_CONFIGS[n] for n in c[3:])) for c in PACKED[world]]
    resumed = FOLD_CHECKPOINT[world]  # after the others: compared with parts of the run below
    per_rank = run_on_ranks(
        run_layouts, world, cases + resumed, str(tmp_path), timeout_s=600, start_method="fork"
    )
    if resumed:
        saved, unfolded, folded = (
            [per_rank[r][len(cases) + i] for r in range(world)] for i in range(3)
        )
        for r in saved:
            torch.testing.assert_close(r["loss"], ref["loss"][:2], rtol=1e-5, atol=0)
        for r in unfolded:  # resumed unfolded from the folded checkpoint
            torch.testing.assert_close(r["loss"], ref["loss"][2:4], rtol=1e-5, atol=0)
        later = {k: ref[k][4:] for k in ("loss", "aux", "norm", "dropped")}
        assert_matches_reference({**ref, **later}, folded, "folded from unfolded from folded")
    refs = {id(BIAS_CONFIG): (bias_ref, " expert bias"), id(DEEP_CONFIG): (deep_ref, " 8 layers")}
    refs[id(ACKPT_CONFIG)] = (ref, " activation checkpointing")
    refs[id(SELECTIVE_CONFIG)] = (ref, " selective recompute")
    refs.update(
        {id(c): (family_refs[n], f" {n} selective recompute") for n, c in SELECTIVE_FAMILY.items()}
    )
    refs[id(CAPACITY_CONFIG)] = (capacity_ref, " capacity")
    refs.update({id(c): (family_refs[name], f" {name}") for name, c in FAMILY_CONFIGS.items()})
    for i, (layout, schedule, m, *config) in enumerate(cases):
        results = [per_rank[r][i] for r in range(world)]
        case_ref, what = refs[id(config[0])] if config else (ref, "")
        if "batch=16" in schedule:
            case_ref = wide_ref
        if ":masked" in schedule:
            case_ref = masked_ref
        if ":packed" in schedule:
            name = packed_names.get(id(config[0])) if config else None
            case_ref, what = packed_refs[name], f" packed {name or ''}"
            if "batch=16" in schedule:
                case_ref = packed_refs["wide", name]
        assert_matches_reference(case_ref, results, f"{layout} {schedule} M={m}{what}")
        # the overlapped schedules did interleave their halves (and nothing else did)
        paired = schedule.split(":")[0] in OVERLAPPED
        assert all((r["handovers"] > 0) == paired for r in results), (layout, schedule)
        assert len({r["split"] for r in results}) == 1, "the ranks built different splits"
        folded = ":fold" in schedule
        _, _, ep, tp, cp = (*layout, 1, 1)[:5]  # each rank owns its share of the experts
        n_experts = (config[0] if config else CONFIG).n_experts
        owned = n_experts // (ep * cp * tp if folded else ep)
        assert all(r["expert_range"][1] - r["expert_range"][0] == owned for r in results), schedule
        # titan plan's state model: every rank's params, grads and optimizer bytes, exactly
        zero = next((int(o[-1]) for o in schedule.split(":") if o.startswith("zero")), 0)
        for rank, r in enumerate(results):
            dims = ParallelDims(*layout[:3], rank, *layout[3:], fold_ep=folded)
            predicted = rank_state(config[0] if config else CONFIG, dims, zero, r["split"])
            assert predicted == r["state"], (layout, schedule, rank, predicted, r["state"])
            # and the grads the step holds beyond it: at zero=2 the microbatches' whole grads,
            # accumulated (zero <= 1 sums them into its buckets, the state's grads)
            model_config = config[0] if config else CONFIG
            step_grads = step_grad_bytes(model_config, dims, zero, m > 1, r["split"])
            held = r["accumulated_bytes"]
            assert step_grads == held, (layout, schedule, rank, step_grads, held)
        # AdamW keeps two moments per weight; zero>0 leaves each rank its share of them (within 5%:
        # rows cut unevenly), zero=2 likewise of the grads it holds at the step and after it (whole
        # at zero<2; the buckets' padding and flags are the rest)
        for r in results:
            whole = 2 * sum(w.numel() for w in r["weights"].values())
            share = zero_share(r, layout, folded) if ":zero" in schedule else 1.0
            state = r["state_numel"] / whole
            assert abs(state / share - 1) <= 0.05, (layout, schedule, r["coords"], state, share)
            grads = r["grad_bytes"] / r["param_bytes"]
            if "zero2" in schedule:
                ok = abs(grads / share - 1) <= 0.05
            else:  # zero=1 with dense leaves (fused AdamW): their grads copy the strided rows
                # (the others are views of the reducer's buckets: one copy)
                ok = grads == 1.0 + r["dense_bytes"] / r["param_bytes"]
            assert (r["dense_bytes"] > 0) == ("adamw=fused" in schedule), (layout, schedule)
            assert ok, (layout, schedule, r["coords"], grads, share)


def zero_share(result: dict, layout: tuple, folded: bool = False) -> float:
    """The fraction of its weights' elements a rank's ZeRO shards hold, per part: a weight TP cuts
    over dp x ep x cp, an expert over dp x cp x tp (folded: over dp), the rest (norms, routers;
    everything without TP) over dp x ep x cp x tp. Stated from the layout, not from the product's
    groups."""
    dp, _, ep, tp, cp = (*layout, 1, 1)[:5]
    held = shared = 0.0
    for name, weight in result["weights"].items():
        if name in result["expert_names"]:
            n = dp if folded else dp * cp * tp
        elif name in result["tp_dims"] and tp > 1:
            n = dp * ep * cp
        else:
            n = dp * ep * cp * tp
        held += weight.numel()
        shared += weight.numel() / n
    return shared / held
