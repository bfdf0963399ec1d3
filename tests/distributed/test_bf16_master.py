"""bf16 weights over fp32 master weights (``param_dtype="bf16"``, ``parallel/dp/master.py``).

One process against the policy written plainly here (a bf16 copy of fp32 master parameters, the
engine's forward and backward on it, the grads cast to fp32, torch's clip and AdamW on the masters,
the masters cast back): a bug every layout shares cannot hide behind the layouts agreeing. Then one
2-rank spawn: dp2, ep2, pp2, and zero=1 and zero=2 over dp2 and over ep2 (each rank the masters of
its rows; at zero=2 also only its rows of the fp32 grads) against one process with bf16 weights,
and the planner's state model against the bytes each held; a checkpoint saved by a bf16 run (zero=0, and zero=1: the
masters' rows), resumed by an fp32 run (which must hold exactly the saved masters) and saved again,
then resumed by a bf16 run (which must repeat the uninterrupted run's steps bit for bit); and the
bytes each rank holds.

Tolerances. One process against the plain policy: the same bf16 matmuls on the same weights, so
the losses are equal and the rest agrees to fp32 rounding of the clip (torch's norm sums the
per-tensor norms in another order): measured, norms within 1 ulp, weights within 1.2e-8.
Layouts against one process: a layout sums a weight's grad over tokens in other pieces (dp2: each
rank's half of the batch is a bf16 matmul, rounded to bf16 before the fp32 sum; pp2 and ep2 cut
the same sums elsewhere), so the grads differ by bf16 rounding (2^-8 relative), and Adam turns
such a difference on a small grad into a good part of lr (1e-2) on its weight. Measured over 5
steps: losses within 7.1e-5 relative, norms within 1.9e-3 relative, weights within 8.9e-4; the
bounds below are about 3x those. The same dp2 with fp32 weights agrees to 1.2e-7
(test_equivalence.py holds fp32 layouts to 1e-5): the looser bound is bf16's rounding, not the
layout's; the bugs a layout could bring (a grad scaled twice, a replica not updated, a master not
written back) move the norm by 2x or the weights by a whole step.
"""

import pytest
import torch
from engine_harness import (
    ACKPT_CONFIG,
    CONFIG,
    GLOBAL_BATCH,
    MAX_NORM,
    SELECTIVE_CONFIG,
    STEPS,
    expected_slice,
    global_batch,
    loss_fn_for,
    reference,
    run_layouts,
    stage_model,
)
from torch import nn

from lightning_titan.parallel.dp.clipping import clip_grad_norm_
from lightning_titan.parallel.dp.offload import HostOptimizer
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups
from lightning_titan.plan.memory import gathered_bytes, rank_state, step_grad_bytes
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.train.engine import Engine
from lightning_titan.train.options import TrainOptions, zero3_reshards_after_forward

LAYOUTS = [
    ((2, 1, 1), "1f1b:bf16", 1),
    ((1, 1, 2), "1f1b:bf16", 2),
    ((1, 2, 1), "1f1b:bf16", 2),
    ((2, 1, 1), "1f1b:bf16:zero1", 1),
    ((1, 1, 2), "1f1b:bf16:zero1", 2),  # the non-expert masters cut over the ep2 group
    ((2, 1, 1), "1f1b:bf16:zero2", 1),  # and the fp32 grads reduce-scattered into the rows
    ((1, 1, 2), "1f1b:bf16:zero2", 2),
    # zero=3: the fp32 master rows the leaves, the blocks gathered in bf16 around their use
    ((2, 1, 1), "1f1b:bf16:zero3", 1),
    ((2, 1, 1), "1f1b:bf16:zero3", 2, ACKPT_CONFIG),  # the recompute inside the backward gathers
    ((1, 1, 2), "1f1b:bf16:zero3", 2),  # the non-expert rows over the ep2 group
    # pp=1 under a split backward: the stage kept whole for the step, as under a pipeline (pp2
    # with a data-parallel group needs 4 ranks): the masters stay tensors of their own
    ((2, 1, 1), "zb_h1:bf16:zero3", 2),
    # selective recompute under autocast: the norms' bf16 outputs refilled, from gathered weights
    ((2, 1, 1), "1f1b:bf16:zero3", 2, SELECTIVE_CONFIG),
]
ZERO3 = 7  # LAYOUTS[7]: zero=3 over dp2
# save at step 2 under bf16 weights; resume under fp32 weights (no step) and save; resume under
# bf16: at zero=0 (the uninterrupted run: LAYOUTS[0]), and from zero=1's master rows through an
# fp32 zero=0 run back to zero=1 (LAYOUTS[3]), and the same from zero=3's (LAYOUTS[ZERO3])
CHECKPOINTS = [
    ((2, 1, 1), "1f1b:bf16:save=2", 1),
    ((2, 1, 1), "1f1b:resume=2:save=2", 1),
    ((2, 1, 1), "1f1b:bf16:resume=2", 1),
    ((2, 1, 1), "1f1b:bf16:zero1:save=2", 1),
    ((2, 1, 1), "1f1b:resume=2:save=2", 1),
    ((2, 1, 1), "1f1b:bf16:zero1:resume=2", 1),
    ((2, 1, 1), "1f1b:bf16:zero3:save=2", 1),
    ((2, 1, 1), "1f1b:resume=2:save=2", 1),
    ((2, 1, 1), "1f1b:bf16:zero3:resume=2", 1),
]
# optimizer offload (parallel/dp/offload.py): each against the same layout without it (its index
# in LAYOUTS; None: fp32 weights, against one process); then a checkpoint saved with offload,
# resumed without it and saved, resumed with it (the uninterrupted run: LAYOUTS[3])
OFFLOAD = [
    (((2, 1, 1), "1f1b:offload:zero1", 1), None),
    (((2, 1, 1), "1f1b:bf16:offload", 1), 0),
    (((2, 1, 1), "1f1b:bf16:offload:zero1", 1), 3),
    (((1, 1, 2), "1f1b:bf16:offload:zero2", 2), 6),
]
OFFLOAD_CHECKPOINTS = [
    ((2, 1, 1), "1f1b:bf16:offload:zero1:save=2", 1),
    ((2, 1, 1), "1f1b:bf16:zero1:resume=2:save=2", 1),
    ((2, 1, 1), "1f1b:bf16:offload:zero1:resume=2", 1),
]


def plain_policy() -> dict:
    """The policy as a reader would write it, on one process: fp32 masters, a bf16 model."""
    dims, groups = ParallelDims(1, 1, 1, 0), ProcessGroups(None, None, None, None)
    torch.manual_seed(0)
    model = stage_model(dims, groups, CONFIG)
    names = [n for n, _ in model.named_parameters()]
    masters = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    # fp32 engine options: forward and backward only (one rank: its reducer does nothing)
    engine = Engine(model, dims, groups, schedule="gpipe", bucket_cap_mb=0.01)
    optimizer = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, eps=1e-3)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets = global_batch(step, CONFIG, GLOBAL_BATCH)
        with torch.autocast("cpu", torch.bfloat16):
            loss = engine.forward_backward(model, inputs, targets, 1, loss_fn_for(model, dims))
        for p, master in zip(model.parameters(), masters, strict=True):
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        # the norm summed as the engine sums it (clipping.clip_grad_norm_, held against torch's in
        # its own tests): torch's vector_norm of the per-tensor norms can differ in the last bit,
        # on some CPUs, and one bit of a master can flip a weight's bf16 rounding two steps later
        norms.append(clip_grad_norm_(masters, MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters, strict=True):
                p.copy_(master)
        losses.append(loss.loss.item())
    engine.remove()
    return {"loss": losses, "norm": norms, "weights": dict(zip(names, masters, strict=True))}


@pytest.mark.timeout(120)
def test_one_process_is_the_plain_policy() -> None:
    ref = reference(param_dtype="bf16")
    plain = plain_policy()
    torch.testing.assert_close(ref["loss"], plain["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(ref["norm"], plain["norm"], rtol=1e-6, atol=0)
    for name, weight in plain["weights"].items():
        torch.testing.assert_close(ref["weights"][name], weight.detach(), rtol=0, atol=1e-6)
    # the parameters were bf16 (half the fp32 run's bytes), each its master rounded, and the run
    # is not the fp32 one (the option did something)
    fp32 = reference()
    assert ref["param_bytes"] * 2 == fp32["param_bytes"], (ref["param_bytes"], fp32["param_bytes"])
    assert ref["master_bytes"] == fp32["param_bytes"]
    assert ref["params_are_masters_rounded"]
    assert ref["masters_finer"]
    assert ref["loss"][-1] != fp32["loss"][-1]
    assert ref["whole_after_remove"]  # the model is its fp32 masters once the engine is gone


def assert_close_to(ref: dict, r: dict, where: str) -> None:
    def say(m: str) -> str:
        return f"{where}: {m}"

    torch.testing.assert_close(r["loss"], ref["loss"], rtol=2e-4, atol=0, msg=say)
    torch.testing.assert_close(r["norm"], ref["norm"], rtol=6e-3, atol=0, msg=say)
    for name, local in r["weights"].items():
        expected = expected_slice(r, name, ref["weights"][name])
        assert local.dtype == torch.float32, (where, name, local.dtype)  # the masters
        torch.testing.assert_close(local, expected, rtol=0, atol=3e-3, msg=say)
    assert r["params_are_masters_rounded"], where
    assert r["masters_finer"], where  # fp32 masters, not rounded to bf16 at any step
    assert r["reduce_dtypes"] <= {torch.float32}, (where, r["reduce_dtypes"])  # fp32 buckets


@pytest.mark.timeout(300)
def test_layouts_and_checkpoints_match_one_process(tmp_path) -> None:
    ref = reference(param_dtype="bf16")
    cases = LAYOUTS + CHECKPOINTS + [case for case, _ in OFFLOAD] + OFFLOAD_CHECKPOINTS
    per_rank = run_on_ranks(
        run_layouts, 2, cases, str(tmp_path), timeout_s=280, start_method="fork"
    )
    for i, (layout, schedule, *_) in enumerate(LAYOUTS):
        zero = next((int(o[-1]) for o in schedule.split(":") if o.startswith("zero")), 0)
        for rank, r in enumerate(per_rank):
            assert_close_to(ref, r[i], f"{layout} {schedule}")
            # the planner's state model prices bf16 weights as the step held them
            dims = ParallelDims(*layout, rank)
            predicted = rank_state(CONFIG, dims, zero, param_dtype="bf16")
            assert predicted == r[i]["state"], (layout, schedule, rank, predicted, r[i]["state"])
            # and the grads the step holds beyond it (bf16 grads accumulated)
            m = LAYOUTS[i][2]
            step_grads = step_grad_bytes(CONFIG, dims, zero, m > 1, param_dtype="bf16")
            held = r[i]["accumulated_bytes"]
            assert step_grads == held, (layout, schedule, rank, step_grads, held)
    offloaded = len(LAYOUTS) + len(CHECKPOINTS)
    check_offload(per_rank, offloaded, ref)
    chains = (
        (len(LAYOUTS), 0),
        (len(LAYOUTS) + 3, 3),
        (offloaded + len(OFFLOAD), 3),
        (len(LAYOUTS) + 6, ZERO3),
    )
    for first, uninterrupted in chains:  # (the first case of a chain, its uninterrupted run)
        for r in per_rank:
            saved, fp32_loaded, resumed = r[first : first + 3]
            whole = r[uninterrupted]
            for name, master in saved["weights"].items():  # an fp32 run loads the masters
                assert fp32_loaded["weights"][name].dtype == torch.float32
                assert torch.equal(fp32_loaded["weights"][name], master), (first, name)
            # a bf16 run from the fp32 run's checkpoint repeats the uninterrupted steps exactly
            assert resumed["loss"] == whole["loss"][2:], (first, resumed["loss"], whole["loss"])
            for name, weight in resumed["weights"].items():
                assert torch.equal(weight, whole["weights"][name]), (first, name)
    # bytes per rank: bf16 parameters (2 a parameter), and under zero=1 over dp2 the fp32 masters
    # and AdamW's two fp32 moments of half the rows each (4 / 2 and 8 / 2); at zero=0 whole
    numel = ref["master_bytes"] // 4  # the model's parameters (one process: every master whole)
    for zero, i in ((0, 0), (1, 3)):
        ranks = [r[i] for r in per_rank]
        for r in ranks:
            assert r["param_bytes"] == 2 * numel, (zero, r["param_bytes"], numel)
            share = 1 if zero == 0 else 2
            assert abs(r["master_bytes"] - 4 * numel / share) <= 256, (zero, r["master_bytes"])
            assert abs(r["moment_bytes"] - 8 * numel / share) <= 512, (zero, r["moment_bytes"])
        if zero:  # every row's master and moments on exactly one rank
            assert sum(r["master_bytes"] for r in ranks) == 4 * numel
            assert sum(r["moment_bytes"] for r in ranks) == 8 * numel
    # zero=3: between steps no bf16 weight of a cut parameter (its rows are the fp32 masters: 16
    # bytes a parameter over the group with grads and moments), the uncut ones whole in bf16 and
    # fp32; in the step the units gathered in bf16, 2 bytes a parameter, as ``gathered_bytes``
    # prices them (per block: the rest and two blocks; kept whole: the stage, beside the masters)
    for i in range(ZERO3, ZERO3 + 4):
        layout, schedule, *_ = LAYOUTS[i]
        per_block = zero3_reshards_after_forward(layout[1], schedule.split(":")[0])
        for rank, r in enumerate(per_rank):
            res, where = r[i], (layout, schedule, rank)
            assert res["held_param_bytes"] == res["master_bytes"] + res["uncut_bytes"], where
            assert res["held_after_eval"] == res["held_param_bytes"], where
            assert res["whole_after_remove"], where  # the fp32 masters, whole
            predicted = gathered_bytes(
                CONFIG, ParallelDims(*layout, rank), reshard_after_forward=per_block,
                param_dtype="bf16",
            )  # fmt: skip
            in_step = res["rest_bytes"] + res["two_blocks_bytes"] if per_block else None
            if in_step is None:  # every cut weight whole in bf16
                in_step = res["param_bytes"] - res["uncut_bytes"]
            assert predicted == in_step, (where, predicted, in_step)
            assert res["gathered_peak"] == res["uncut_bytes"] + in_step, where
            assert not res["gather_buffer_borrowed"], where
            assert res["gather_dtypes"] == {torch.bfloat16}, (where, res["gather_dtypes"])


def check_offload(per_rank: list[list[dict]], first: int, ref: dict) -> None:
    """Offload against the same run without it. The host steps the same fp32 tensors with the
    same AdamW on the same grads, so on CPU the runs agree to the bit; the bounds are the ones
    the brief asks for (fp32 against one process as test_equivalence.py: 1e-5) and this file's
    for bf16 weights, with equality on top where the counterpart is the same layout."""
    fp32 = reference()
    for i, ((layout, schedule, _), counterpart) in enumerate(OFFLOAD):
        where = f"{layout} {schedule}"
        for r in per_rank:
            got = r[first + i]
            assert got["offloaded"] > 0, where  # the optimizer stepped host copies
            if counterpart is None:
                torch.testing.assert_close(got["loss"], fp32["loss"], rtol=1e-5, atol=0)
                for name, local in got["weights"].items():
                    expected = expected_slice(got, name, fp32["weights"][name])
                    torch.testing.assert_close(local, expected, rtol=0, atol=1e-5)
                continue
            assert_close_to(ref, got, where)
            same = r[counterpart]
            assert got["loss"] == same["loss"], (where, got["loss"], same["loss"])
            for name, weight in got["weights"].items():
                assert torch.equal(weight, same["weights"][name]), (where, name)
            # while the host stepped, the device held no fp32 master (their storage freed)
            assert got["device_masters_at_step"] == 0, (where, got["device_masters_at_step"])
            assert got["moment_bytes"] == same["moment_bytes"], where  # the same state, on host


def test_precision_must_be_bf16_mixed() -> None:
    from types import SimpleNamespace

    from lightning_titan.lightning.strategy import check_param_precision

    check_param_precision("bf16", SimpleNamespace(precision="bf16-mixed"))
    check_param_precision("fp32", SimpleNamespace(precision="32-true"))
    for precision in ("32-true", "bf16-true", "16-mixed"):
        with pytest.raises(ValueError, match="use --trainer.precision=bf16-mixed"):
            check_param_precision("bf16", SimpleNamespace(precision=precision))


def test_options_refuse_what_is_not_built() -> None:
    TrainOptions(param_dtype="bf16", zero=3)  # built: zero=3 gathers bf16 from fp32 master rows
    with pytest.raises(ValueError, match="param_dtype='bf16' needs reducer='bucketed'"):
        TrainOptions(param_dtype="bf16", reducer="per_param")
    with pytest.raises(ValueError, match="param_dtype='fp16' is not a parameter dtype"):
        TrainOptions(param_dtype="fp16")
    with pytest.raises(ValueError, match="offload_optimizer=True with zero=3 is not built"):
        TrainOptions(offload_optimizer=True, zero=3)
    with pytest.raises(ValueError, match="offload_optimizer='yes' must be True or False"):
        TrainOptions(offload_optimizer="yes")
    weight = nn.Parameter(torch.zeros(3))
    capturable = torch.optim.AdamW([weight], capturable=True)
    with pytest.raises(ValueError, match="build it with capturable=False"):
        HostOptimizer([capturable])
