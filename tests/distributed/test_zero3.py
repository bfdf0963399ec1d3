"""zero=3 (each rank keeps only its rows of the parameters, gathered per block) trains the model of
one process, and holds what it says.

One spawn per world size runs every case; the parent compares each rank with the single-process
run (per-step loss, aux, grad norm rtol 1e-5, final weights atol 1e-5, gathered to be read) and
checks memory: between steps (the grads reduced, before the update) the parameters and the
optimizer's leaves hold each rank's share of the weights (within 5 %: rows cut unevenly), and in a
forward or backward at most one block whole beyond the rest of the stage (embedding, norm, head,
kept for the step) and the parameters nothing cuts; under activation checkpointing too (the recompute
gathers the block and keeps it for its backward). A zero=3 checkpoint resumes at zero=0 under
another layout and the other way round, exactly. What it does not run with yet (pp > 1, the
overlapped and multi-chunk schedules) is refused in one line, at every place ``zero`` is checked.
"""

from types import SimpleNamespace

import pytest
import torch
from engine_harness import (
    ACKPT_CONFIG,
    CONFIG,
    MAX_NORM,
    assert_matches_reference,
    reference,
    run_layouts,
)

from lightning_titan.parallel.dp.zero import ZeroShards
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.train.options import TrainOptions, Workload, check_zero3, preflight

# (layout (dp, pp, ep[, tp[, cp]]), schedule, M): pp=1 under every other axis, one and two
# microbatches, the fused AdamW (whose leaves zero=3 makes dense anyway)
CASES = {
    2: [
        ((2, 1, 1), "1f1b:zero3", 1),
        ((2, 1, 1), "gpipe:zero3", 2),
        ((2, 1, 1), "1f1b:zero3:adamw=fused", 2),
        ((2, 1, 1), "1f1b:zero3", 2, ACKPT_CONFIG),  # the recompute inside the backward gathers
        ((2, 1, 1), "1f1b:zero3:late_stop", 1, ACKPT_CONFIG),  # and runs the block to its end
        ((1, 1, 2), "1f1b:zero3", 2),  # ep2: the experts whole, the rest over ep
        ((1, 1, 1, 2), "1f1b:zero3", 1),  # tp2: the norms, routers and experts over tp
        ((1, 1, 1, 1, 2), "1f1b:zero3", 1),  # cp2
    ],
    4: [
        ((2, 1, 2), "1f1b:zero3", 2),  # dp2 x ep2
        ((2, 1, 1, 2), "1f1b:zero3", 1),  # dp2 x tp2
        ((4, 1, 1), "gpipe:zero3", 2),  # dp4: rows cut unevenly (61 vocabulary rows)
        ((2, 1, 1, 1, 2), "1f1b:zero3", 1),  # dp2 x cp2
    ],
}

# checkpoints, in this order on the same path: a zero=3 save resumed at zero=0 under another layout,
# and a zero=0 save under tp2 resumed at zero=3 (each save: steps 0-1; each resume: steps 2-4)
CHECKPOINTS = {
    2: [
        ((2, 1, 1), "1f1b:zero3:save=2", 1),
        ((1, 1, 2), "1f1b:resume=2", 2),
        ((1, 1, 1, 2), "1f1b:save=2", 1),
        ((2, 1, 1), "1f1b:zero3:resume=2", 2),
    ],
    4: [],
}


@pytest.fixture(scope="module")
def ref():
    result = reference()
    assert min(result["norm"]) > MAX_NORM, "clipping must bite for the test to check it"
    return result


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
def test_zero3_equals_one_process_and_holds_its_rows(ref, world, tmp_path):
    cases = CASES[world] + CHECKPOINTS[world]
    per_rank = run_on_ranks(
        run_layouts, world, cases, str(tmp_path), timeout_s=580, start_method="fork"
    )
    later = {**ref, **{k: ref[k][2:] for k in ("loss", "aux", "norm", "dropped")}}
    for i, (layout, schedule, m, *config) in enumerate(cases):
        results = [per_rank[r][i] for r in range(world)]
        label = f"{layout} {schedule} M={m}{' activation checkpointing' if config else ''}"
        if ":save=" in schedule:  # its first two steps
            for r in results:
                torch.testing.assert_close(r["loss"], ref["loss"][:2], rtol=1e-5, atol=0)
        else:  # a resumed run: the rest of the curve and the final weights
            assert_matches_reference(later if ":resume=" in schedule else ref, results, label)
        if ":zero3" not in schedule:
            continue
        for r in results:
            assert r["whole_after_remove"], (label, r["coords"], "the model is not whole after it")
            rows, whole = shares(r, layout)
            held = r["held_param_bytes"]
            # between steps: the rows (in the leaves) and the parameters nothing cuts, nothing more
            assert abs(held / (rows + whole) - 1) <= 0.05, (label, r["coords"], held, rows, whole)
            # at any moment of a forward or backward: the rest of the stage and one block whole
            # beyond that (the parameters' storages; the leaves are apart)
            assert r["uncut_bytes"] == whole, (label, r["coords"], r["uncut_bytes"], whole)
            limit = whole + r["rest_bytes"] + r["block_bytes"]
            assert r["gathered_peak"] <= limit, (label, r["coords"], r["gathered_peak"], limit)
            assert r["gathered_peak"] < r["param_bytes"], (label, "every block was whole at once")
            assert not r["gather_buffer_borrowed"], (label, "the gathers use the reducer's buffer")


def test_zero3_refuses_what_it_does_not_run_with_yet():
    with pytest.raises(
        ValueError, match=r"^zero=3 runs with pp=1 for now \(got pp=2\); use zero=2"
    ):
        check_zero3(3, 2, "1f1b")
    with pytest.raises(ValueError, match=r"^zero=3 runs with schedule 'gpipe' or '1f1b' for now"):
        check_zero3(3, 1, "1f1b_overlap")
    check_zero3(3, 1, "gpipe")
    check_zero3(2, 4, "zbv")  # other levels: nothing to refuse here
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


def test_the_command_refuses_zero3_where_it_does_not_run_yet():
    """The launcher's preflight and the command's parse-time check name the same fix."""
    from lightning_titan import TitanStrategy
    from lightning_titan.lightning.arguments import check_layout_fits

    trainer = SimpleNamespace(devices=4, num_nodes=1, accelerator="cpu")
    with pytest.raises(ValueError, match="zero=3 runs with pp=1 for now"):
        check_layout_fits(TitanStrategy(dp=2, pp=2, zero=3), CONFIG, trainer)
    with pytest.raises(ValueError, match="zero=3 runs with schedule 'gpipe' or '1f1b'"):
        check_layout_fits(
            TitanStrategy(dp=2, ep=2, zero=3, schedule="1f1b_overlap"), CONFIG, trainer
        )
    check_layout_fits(TitanStrategy(dp=4, zero=3), CONFIG, trainer)
    # the launcher's checks, before any rank starts
    with pytest.raises(ValueError, match="zero=3 runs with pp=1 for now"):
        preflight(ParallelDims(1, 2, 1, 0), TrainOptions(zero=3), Workload())
    preflight(ParallelDims(2, 1, 1, 0), TrainOptions(zero=3), Workload())
