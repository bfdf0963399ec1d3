"""zero=3 (each rank keeps only its rows of the parameters between their uses) trains the model of
one process, and holds what it says.

One spawn per world size runs every case; the parent compares each rank with the single-process
run (per-step loss, aux, grad norm rtol 1e-5, final weights atol 1e-5, gathered to be read) and
checks memory: between steps (the grads reduced, before the update) the parameters and the
optimizer's leaves hold each rank's share of the weights (within 5 %: rows cut unevenly; exactly
the rows `titan plan` prices), after an evaluation too. During the step, where each block is
gathered around its use (pp=1 under gpipe or 1f1b): two blocks whole (the one computing and the
next one, prefetched) beyond the rest of the stage (embedding, norm, head, kept for the step) and
the parameters nothing cuts, and no more; every block found in flight (prefetched) but the last
one in the backward, kept from its forward, and every prefetch used; under activation checkpointing
too (the recompute gathers the block, keeps it for its backward and prefetches nothing). Under a pipeline
and the other schedules: the whole stage at every forward and every grad accumulation of the step,
the optimizer's rows views into it. A zero=3 checkpoint resumes at zero=0 under another layout and
the other way round, and one saved under a pipeline resumes at pp=1, exactly. On 8 ranks: dp2 x pp2 x
ep2 (1F1B, ZBV, activation checkpointing, and DualPipeV on global batches of 16 against a
16-sequence single process), tp2 x pp2 x ep2 (1F1B, DualPipeV), cp2 x pp2 x ep2, dp4 x ep2, and a
dp2 x pp2 x ep2 zero=3 checkpoint resumed at zero=0 under dp4 x ep2 and back.
"""

from types import SimpleNamespace

import pytest
import torch
from engine_harness import (
    ACKPT_CONFIG,
    CONFIG,
    MAX_NORM,
    SELECTIVE_CONFIG,
    assert_matches_reference,
    reference,
    run_layouts,
)

from lightning_titan.parallel.dp.zero import ZeroShards
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.plan.memory import gathered_bytes, rank_state, step_grad_bytes
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.train.options import (
    TrainOptions,
    Workload,
    preflight,
    zero3_reshards_after_forward,
)

# (layout (dp, pp, ep[, tp[, cp]]), schedule, M): pp=1 under every other axis, one and two
# microbatches, the fused AdamW (whose leaves zero=3 makes dense anyway); pp=2 under the schedules
# (the W pass of zb_h1 and zbv, two chunks, the overlapped V) and pp=1 under those that keep the
# stage whole too
CASES = {
    2: [
        ((2, 1, 1), "1f1b:zero3", 1),
        ((2, 1, 1), "gpipe:zero3", 2),
        ((2, 1, 1), "1f1b:zero3:adamw=fused", 2),
        ((2, 1, 1), "1f1b:zero3", 2, ACKPT_CONFIG),  # the recompute inside the backward gathers
        ((2, 1, 1), "1f1b:zero3:late_stop", 1, ACKPT_CONFIG),  # and runs the block to its end
        ((2, 1, 1), "1f1b:zero3", 2, SELECTIVE_CONFIG),  # norms recomputed from gathered weights
        ((1, 1, 2), "1f1b:zero3", 2),  # ep2: the experts whole, the rest over ep
        ((1, 1, 1, 2), "1f1b:zero3", 1),  # tp2: the norms, routers and experts over tp
        ((1, 1, 1, 1, 2), "1f1b:zero3", 1),  # cp2
        ((1, 1, 2), "1f1b_overlap:zero3", 2),  # pp=1, overlapped: kept whole for the step
        ((2, 1, 1), "zb_h1:zero3", 2),  # pp=1, the W pass after the B pass
    ],
    4: [
        ((2, 1, 2), "1f1b:zero3", 2),  # dp2 x ep2
        ((2, 1, 1, 2), "1f1b:zero3", 1),  # dp2 x tp2
        ((4, 1, 1), "gpipe:zero3", 2),  # dp4: rows cut unevenly (61 vocabulary rows)
        ((2, 1, 1, 1, 2), "1f1b:zero3", 1),  # dp2 x cp2
        ((2, 2, 1), "1f1b:zero3", 2),  # dp2 x pp2: each stage whole for its step
        ((2, 2, 1), "gpipe:zero3", 2, ACKPT_CONFIG),  # the recompute reads the kept blocks
        ((2, 2, 1), "zb_h1:zero3", 4),  # the W pass, after later microbatches' forwards
        ((2, 2, 1), "interleaved_1f1b:v2:zero3", 2),  # two chunks a rank
        ((2, 2, 1), "zbv:zero3", 4),  # the V, with its W pass
        ((1, 2, 2), "dualpipev:zero3", 4),  # pp2 x ep2, overlapped; the experts whole (dp=1)
        ((1, 2, 1, 2), "1f1b:zero3", 2),  # pp2 x tp2
    ],
    8: [
        ((2, 2, 2), "1f1b:zero3", 2),  # dp2 x pp2 x ep2
        ((2, 2, 2), "1f1b:zero3", 2, ACKPT_CONFIG),
        ((2, 2, 2), "zbv:zero3", 2),
        ((1, 2, 2, 2), "1f1b:zero3", 2),  # tp2 x pp2 x ep2
        ((1, 2, 2, 2), "dualpipev:zero3", 4),
        # dp2 x pp2 x ep2 reads 2 sequences a replica of 8, too few for dualpipev's M >= 2P: the
        # run and its reference take 16 (``reference(batch=16)``)
        ((2, 2, 2), "dualpipev:batch=16:zero3", 4),
        ((1, 2, 2, 1, 2), "1f1b:zero3", 2),  # cp2 x pp2 x ep2
        ((4, 1, 2), "1f1b:zero3", 1),  # dp4 x ep2, each block gathered around its use
    ],
}

# checkpoints, in this order on the same path: a zero=3 save resumed at zero=0 under another layout,
# and a zero=0 save under tp2 resumed at zero=3 (each save: steps 0-1; each resume: steps 2-4); on
# four ranks a zero=3 save under dp2 x pp2 resumed at dp4
CHECKPOINTS = {
    2: [
        ((2, 1, 1), "1f1b:zero3:save=2", 1),
        ((1, 1, 2), "1f1b:resume=2", 2),
        ((1, 1, 1, 2), "1f1b:save=2", 1),
        ((2, 1, 1), "1f1b:zero3:resume=2", 2),
    ],
    # a zero=3 save under a pipeline resumed at pp=1 (and zero=3)
    4: [
        ((2, 2, 1), "1f1b:zero3:save=2", 2),
        ((4, 1, 1), "gpipe:zero3:resume=2", 2),
    ],
    8: [  # zero=3 under dp2 x pp2 x ep2 to zero=0 under dp4 x ep2, and back
        ((2, 2, 2), "1f1b:zero3:save=2", 2),
        ((4, 1, 2), "1f1b:resume=2", 1),
        ((4, 1, 2), "1f1b:save=2", 1),
        ((2, 2, 2), "1f1b:zero3:resume=2", 2),
    ],
}


@pytest.fixture(scope="module")
def ref():
    result = reference()
    assert min(result["norm"]) > MAX_NORM, "clipping must bite for the test to check it"
    return result


@pytest.fixture(scope="module")
def wide_ref():
    """The single process on global batches of 16 (the ``:batch=16`` cases)."""
    return reference(batch=16)


def shares(result: dict, layout: tuple) -> tuple[float, int]:
    """The bytes a rank's rows of the weights take if each parameter is cut over its ZeRO group
    (stated from the layout, as in test_equivalence.zero_share), and the bytes of those that no
    group cuts (a group of one rank; a 1-D parameter of the experts: dim 1 does not exist)."""
    dp, _, ep, tp, cp = (*layout, 1, 1)[:5]
    rows = whole = 0.0
    for name, w in result["weights"].items():
        nbytes = w.numel() * w.element_size()
        if name in result["expert_names"]:
            n = dp * cp * tp
            if w.dim() < 2:
                whole += nbytes
                continue
        elif name in result["tp_dims"] and tp > 1:
            n = dp * ep * cp
        else:
            n = dp * ep * cp * tp
        if n == 1:
            whole += nbytes
        else:
            rows += nbytes / n
    return rows, int(whole)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", sorted(CASES))
def test_zero3_equals_one_process_and_holds_its_rows(ref, wide_ref, world, tmp_path):
    cases = CASES[world] + CHECKPOINTS[world]
    per_rank = run_on_ranks(
        run_layouts, world, cases, str(tmp_path), timeout_s=580, start_method="fork"
    )
    later = {**ref, **{k: ref[k][2:] for k in ("loss", "aux", "norm", "dropped")}}
    for i, (layout, schedule, m, *config) in enumerate(cases):
        results = [per_rank[r][i] for r in range(world)]
        label = f"{layout} {schedule} M={m}{' activation checkpointing' if config else ''}"
        case_ref = wide_ref if ":batch=16" in schedule else ref
        if ":save=" in schedule:  # its first two steps
            for r in results:
                torch.testing.assert_close(r["loss"], ref["loss"][:2], rtol=1e-5, atol=0)
        else:  # a resumed run: the rest of the curve and the final weights
            assert_matches_reference(later if ":resume=" in schedule else case_ref, results, label)
        if ":zero3" not in schedule:
            continue
        per_block = zero3_reshards_after_forward(layout[1], schedule.split(":")[0])
        for rank, r in enumerate(results):
            # what `titan plan` predicts for this rank: its rows between steps, and what it
            # gathers in the step on top of them
            dims = ParallelDims(*layout[:3], rank, *layout[3:])
            model_config = config[0] if config else CONFIG
            state = rank_state(model_config, dims, 3, r["split"])
            gathered = gathered_bytes(model_config, dims, r["split"], None, per_block)
            assert state["expert_params"] + state["non_expert_params"] == r["held_param_bytes"]
            step_grads = step_grad_bytes(model_config, dims, 3, m > 1, r["split"])
            assert step_grads == r["accumulated_bytes"], (label, rank, step_grads)
            in_step = r["rest_bytes"] + r["two_blocks_bytes"] if per_block else r["param_bytes"]
            assert gathered + (0 if per_block else r["held_param_bytes"]) == in_step, label
            assert r["whole_after_remove"], (label, r["coords"], "the model is not whole after it")
            rows, whole = shares(r, layout)
            held = r["held_param_bytes"]
            # between steps: the rows (in the leaves) and the parameters nothing cuts, nothing more
            assert abs(held / (rows + whole) - 1) <= 0.05, (label, r["coords"], held, rows, whole)
            # and after an evaluation's forwards
            assert r["held_after_eval"] == held, (label, r["coords"], r["held_after_eval"], held)
            assert r["uncut_bytes"] == whole, (label, r["coords"], r["uncut_bytes"], whole)
            assert not r["gather_buffer_borrowed"], (label, "the gathers use the reducer's buffer")
            if not per_block:
                # the stage whole at every forward and grad accumulation of the step, kept from
                # its first forward to the reduce-scatter, each rank's rows held inside it (no
                # second copy: zero=2's peak)
                seen = (r["gathered_low"], r["gathered_peak"], r["with_leaves_peak"])
                assert seen == (r["param_bytes"],) * 3, (label, r["coords"], seen)
                continue
            # at any moment of a forward or backward: the rest of the stage and two blocks whole
            # beyond that, the one computing and the next one prefetched (the parameters'
            # storages, filled from the prefetch's issue; the leaves are apart): reached, no more
            limit = whole + r["rest_bytes"] + r["two_blocks_bytes"]
            assert r["gathered_peak"] == limit, (label, r["coords"], r["gathered_peak"], limit)
            assert r["gathered_peak"] < r["param_bytes"], (label, "every block was whole at once")
            # each forward prefetches its first block under the embedding and each next one under
            # the block before; each backward finds its first block (the last) kept from the
            # forward (gpipe: the last microbatch's only, the others' gathered at their use) and
            # prefetches the others; every prefetch used (the recompute issues none)
            seen = r["block_gathers"]
            n = r["n_blocks"]
            backwards = seen["kept"] + seen["gathered"]
            gpipe = schedule.startswith("gpipe")
            assert seen["wasted"] == 0 and seen["kept"] > 0, (label, r["coords"], seen)
            assert seen["gathered"] == (m - 1) * seen["kept"] * gpipe, (label, r["coords"], seen)
            forwards, left = divmod(seen["prefetched"] - (n - 1) * backwards, n)
            assert left == 0 and forwards > backwards, (label, r["coords"], seen)  # evaluations


def test_zero3_refuses_what_it_does_not_run_with():
    with pytest.raises(ValueError, match="zero=3 reduce-scatters flat gradient buckets"):
        TrainOptions(zero=3, reducer="per_param")
    with pytest.raises(ValueError, match="or 3 \\(and the parameters\\)"):
        TrainOptions(zero=4)
    # a save of a parameter whose storage is freed (zero=3 outside Engine.whole_params)
    p = torch.nn.Parameter(torch.ones(4, 2))
    shard = SimpleNamespace(param=p, leaf=torch.nn.Parameter(torch.ones(2, 2)))
    shards = ZeroShards([SimpleNamespace(shards={id(p): shard})])
    shards.check_whole("save")  # whole
    p.data.untyped_storage().resize_(0)
    with pytest.raises(
        ValueError, match="a checkpoint save under zero=3 needs the parameters whole"
    ):
        shards.check_whole("save")


def test_zero3_frees_each_block_after_its_forward_only_where_one_stage_runs_one_microbatch():
    assert zero3_reshards_after_forward(1, "1f1b") and zero3_reshards_after_forward(1, "gpipe")
    for pp, schedule in [(2, "1f1b"), (2, "gpipe"), (1, "1f1b_overlap"), (1, "zb_h1"), (2, "zbv")]:
        assert not zero3_reshards_after_forward(pp, schedule), (pp, schedule)


def test_the_command_takes_zero3_under_a_pipeline_and_every_schedule():
    """The command's parse-time check and the launcher's preflight let zero=3 through under pp > 1
    and the overlapped schedules."""
    from lightning_titan import TitanStrategy
    from lightning_titan.lightning.arguments import check_layout_fits

    trainer = SimpleNamespace(devices=4, num_nodes=1, accelerator="cpu")
    check_layout_fits(TitanStrategy(dp=2, pp=2, zero=3), CONFIG, trainer)
    check_layout_fits(TitanStrategy(dp=2, ep=2, zero=3, schedule="1f1b_overlap"), CONFIG, trainer)
    check_layout_fits(TitanStrategy(pp=2, ep=2, zero=3, schedule="dualpipev"), CONFIG, trainer)
    check_layout_fits(TitanStrategy(dp=4, zero=3), CONFIG, trainer)
    # the launcher's checks, before any rank starts
    preflight(ParallelDims(1, 2, 1, 0), TrainOptions(zero=3), Workload())
    preflight(ParallelDims(2, 1, 1, 0), TrainOptions(zero=3), Workload())
