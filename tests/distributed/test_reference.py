"""Our training step against an independent reference (tests/mixtral_reference.py: plain PyTorch, no
project code): the same weights and global batch must give the same loss, aux loss, gradient norm and
gradient of every parameter, for one process, dp2 x pp2 x ep2, tp2 x pp2 x ep2 and cp2 x tp2 x pp2 (each
rank its slice of every gradient), with the aux and z losses on; and
the composed clipping must scale every gradient by max_norm / norm. Each case runs twice: on plain
targets and on targets partly ignored (-100, another count on each rank and microbatch), whose loss is
the mean over the counted targets of the global batch.
"""

import pytest
import torch
from engine_harness import (
    CONFIG,
    expected_slice,
    full_initial_weights,
    global_batch,
    grads_of_one_step,
)
from mixtral_reference import loss_and_grads

from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups
from lightning_titan.runtime.launch import run_on_ranks

MAX_NORM = 0.05  # well under the reference norm, so clipping bites


def reference_of(masked: bool):
    inputs, targets = global_batch(0, masked=masked)
    values, grads = loss_and_grads(full_initial_weights(), inputs, targets, CONFIG)
    values["norm"] = torch.linalg.vector_norm(
        torch.stack([g.norm() for g in grads.values()])
    ).item()
    assert values["norm"] > 2 * MAX_NORM, "clipping must bite for the test to check it"
    assert values["aux"] > 0 and CONFIG.z_loss_coef > 0 and CONFIG.aux_loss_coef > 0
    assert all(g.abs().max() > 0 for g in grads.values()), "every parameter gets a gradient"
    return values, grads


@pytest.fixture(scope="module")
def refs():
    """masked -> the reference's values and grads (masked: targets partly -100)."""
    return {masked: reference_of(masked) for masked in (False, True)}


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    # summation orders differ (dense vs dispatched experts, microbatches, reducers): fp32 rounding
    atol = 1e-5 * theirs.abs().max().item() + 1e-9
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_matches(ref, results: list[dict], label: str) -> None:
    values, grads = ref
    scale = MAX_NORM / values["norm"]
    for r in results:
        where = f"{label} rank coords {r['coords']}"
        for key in ("loss", "aux"):
            assert r[key] == pytest.approx(values[key], rel=1e-5), f"{where} {key}"
        assert r["norm"] == pytest.approx([values["norm"]] * 2, rel=1e-5), f"{where} norm"
        for name, local in r["grads"][0].items():
            expected = expected_slice(r, name, grads[name])
            _close(local, expected, f"{where} pre-clip grad {name}")
            _close(r["grads"][1][name], expected * scale, f"{where} clipped grad {name}")
    held = set().union(*(r["grads"][0] for r in results))
    assert held == set(grads), f"{label}: parameters nobody holds: {set(grads) - held}"


def test_one_process_equals_the_independent_reference(refs):
    dims = ParallelDims(1, 1, 1, 0)
    for masked, ref in refs.items():
        inputs, targets = global_batch(0, masked=masked)
        for m in (1, 2):
            result = grads_of_one_step(
                dims, ProcessGroups(None, None, None, None), inputs, targets, m, (None, MAX_NORM)
            )
            assert_matches(ref, [result], f"one process M={m} masked={masked}")


def _one_step(rank: int, world_size: int, layout: tuple[int, ...]) -> dict[bool, dict]:
    """masked -> this rank's step on the plain and on the partly ignored targets, in one spawn."""
    dims = ParallelDims(*layout[:3], rank, *layout[3:])
    groups, out = build_process_groups(dims), {}
    for masked in (False, True):
        inputs, targets = global_batch(0, masked=masked)
        out[masked] = grads_of_one_step(dims, groups, inputs, targets, 2, (None, MAX_NORM))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "layout",
    [(2, 2, 2, 1, 1), (1, 2, 2, 2, 1), (1, 2, 1, 2, 2)],
    ids=["dp2_pp2_ep2", "tp2_pp2_ep2", "cp2_tp2_pp2"],
)
def test_eight_ranks_equal_the_independent_reference(refs, layout):
    results = run_on_ranks(_one_step, 8, layout, timeout_s=200, start_method="fork")
    for masked, ref in refs.items():
        label = f"(dp, pp, ep, tp, cp) = {layout} masked={masked}"
        assert_matches(ref, [r[masked] for r in results], label)
