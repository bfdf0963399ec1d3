import itertools

import pytest

from lightning_titan.parallel.mesh import GROUP_KINDS, ParallelDims, resolve_degrees

LAYOUTS = [  # (dp, pp, ep, tp, cp)
    (1, 1, 1, 1, 1),
    (2, 1, 1, 1, 1),
    (1, 2, 1, 1, 1),
    (1, 1, 2, 1, 1),
    (2, 2, 2, 1, 1),
    (1, 4, 1, 1, 1),
    (1, 1, 4, 1, 1),
    (3, 2, 4, 1, 1),
    (2, 3, 1, 1, 1),
    (1, 1, 1, 2, 1),
    (2, 2, 2, 2, 1),
    (1, 2, 3, 2, 1),
    (1, 1, 1, 1, 2),
    (2, 2, 1, 2, 2),
    (1, 2, 2, 2, 3),
]
AXES = ("dp", "pp", "ep", "cp", "tp")  # slowest to fastest, stated again here
# the axes that vary inside each group kind, stated again here (docs/concepts.md's table)
VARIES = {
    "ep": {"ep"},
    "pp": {"pp"},
    "tp": {"tp"},
    "cp": {"cp"},
    "sequence": {"cp", "tp"},
    "expert_dp": {"dp", "cp", "tp"},
    "non_expert_dp": {"dp", "ep", "cp"},
    "sequence_dp": {"dp", "ep", "cp", "tp"},
    "model": {"pp", "ep", "tp"},
}
# fold_ep (MoE Parallel Folding): the all-to-all over a stage's ep x cp x tp ranks, the experts'
# grads over dp only, the norm over a replica's cp ranks too (they hold different experts now)
VARIES_FOLDED = {
    **VARIES,
    "ep": {"ep", "cp", "tp"},
    "expert_dp": {"dp"},
    "model": {"pp", "ep", "cp", "tp"},
}


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("dp,pp,ep,tp,cp", LAYOUTS)
def test_coordinates_and_groups_follow_the_formula(dp, pp, ep, tp, cp, fold):
    world = dp * pp * ep * cp * tp
    assert set(GROUP_KINDS) == set(VARIES)
    varies_of = VARIES_FOLDED if fold else VARIES
    grid = list(itertools.product(range(dp), range(pp), range(ep), range(cp), range(tp)))

    def rank_at(d, p, e, c, t):
        return (((d * pp + p) * ep + e) * cp + c) * tp + t

    for d, p, e, c, t in grid:
        rank = rank_at(d, p, e, c, t)
        dims = ParallelDims(dp, pp, ep, rank, tp=tp, cp=cp, fold_ep=fold)
        assert (dims.dp_rank, dims.pp_rank, dims.ep_rank, dims.cp_rank, dims.tp_rank) == (
            d, p, e, c, t
        )  # fmt: skip
        assert dims.data_rank == d * ep + e and dims.data_world == dp * ep
        assert dims.is_first_stage == (p == 0) and dims.is_last_stage == (p == pp - 1)
        assert dims.prev_stage_rank == (None if p == 0 else rank_at(d, p - 1, e, c, t))
        assert dims.next_stage_rank == (None if p == pp - 1 else rank_at(d, p + 1, e, c, t))
        mine = dict(zip(AXES, (d, p, e, c, t), strict=True))
        for kind, varies in varies_of.items():
            want = sorted(
                rank_at(*coords)
                for coords in grid
                if all(coords[i] == mine[a] for i, a in enumerate(AXES) if a not in varies)
            )
            assert dims.group_ranks(kind) == want, (kind, mine)
        # expert ownership: the place in the EP group's ranks, over ep (x cp x tp folded)
        assert dims.expert_world == (ep * cp * tp if fold else ep)
        assert dims.expert_rank == dims.group_ranks("ep").index(rank)
        assert dims.expert_rank == ((e * cp + c) * tp + t if fold else e)
        # the norm counts an expert on every rank folded, else on tp rank 0 only
        assert dims.copied_over("expert_dp") == (() if fold else ("tp",))
        assert dims.copied_over("non_expert_dp") == (("ep", "cp") if fold else ("ep",))
    dims = ParallelDims(dp, pp, ep, 0, tp=tp, cp=cp, fold_ep=fold)
    for kind in GROUP_KINDS:
        groups = dims.all_groups(kind)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), f"{kind} groups must partition the world"


def test_pp_ep_example_from_the_write_up():
    # P_PP = P_EP = 2: ranks (0, 1) are stage 0, (2, 3) stage 1; PP links 0<->2 and 1<->3
    dims = ParallelDims(1, 2, 2, 0)
    assert dims.all_groups("ep") == [[0, 1], [2, 3]]
    assert dims.all_groups("pp") == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    "args,match",
    [
        ((2, 2, 2, 4), r"2\*2\*2\*1\*1 = 8 but the world size is 4"),
        ((-1, -1, 2, 4), "dp and pp are -1: at most one"),
        ((0, 1, 1, 1), "dp=0 is not valid"),
        ((-1, 3, 1, 4), "not divisible"),
        ((1, "2", 1, 2), "pp='2' is not valid"),
    ],
)
def test_resolve_degrees_errors_name_the_values(args, match):
    *degrees, world = args
    with pytest.raises(ValueError, match=match):
        resolve_degrees(
            dict(zip(("dp", "pp", "ep", "cp", "tp"), [*degrees, 1, 1], strict=True)), world
        )


def test_resolve_fills_minus_one():
    assert resolve_degrees({"dp": -1, "pp": 2, "ep": 2}, 8) == {"dp": 2, "pp": 2, "ep": 2}
    assert resolve_degrees({"dp": 1, "pp": -1, "ep": 4}, 8) == {"dp": 1, "pp": 2, "ep": 4}
    assert resolve_degrees({"dp": 2, "pp": 2, "ep": 2}, 8) == {"dp": 2, "pp": 2, "ep": 2}


def test_rank_outside_world_is_rejected():
    with pytest.raises(ValueError, match="rank=8 is outside the world of 8"):
        ParallelDims(2, 2, 2, 8)


def test_folded_ep_on_four_ranks():
    """ep=2 x tp=2 folded: one all-to-all group of all four ranks, each owning a quarter of the
    experts in rank order; the experts' grads reduce over nobody (dp=1), the norm over all four."""
    dims = ParallelDims(1, 1, 2, 0, tp=2, fold_ep=True)
    assert dims.all_groups("ep") == [[0, 1, 2, 3]]
    assert dims.all_groups("expert_dp") == [[0], [1], [2], [3]]
    assert dims.all_groups("model") == [[0, 1, 2, 3]]
    assert dims.all_groups("non_expert_dp") == [[0, 2], [1, 3]]  # attention: still tp2 over ep
    owners = [ParallelDims(1, 1, 2, r, tp=2, fold_ep=True).expert_rank for r in range(4)]
    assert owners == [0, 1, 2, 3]
    unfolded = [ParallelDims(1, 1, 2, r, tp=2).expert_rank for r in range(4)]
    assert unfolded == [0, 0, 1, 1]


def test_fold_ep_must_be_a_bool():
    with pytest.raises(ValueError, match="fold_ep=1 must be True or False"):
        ParallelDims(1, 1, 2, 0, tp=2, fold_ep=1)  # type: ignore[arg-type]
