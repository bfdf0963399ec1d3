"""Every schedule on the GPU code path under NCCL's ordering equals one process (issue 43).

On CPU ``StageLinks`` takes another path than on GPUs (receives posted ahead, sends not waited), and gloo
buffers sends anyway, so a schedule that deadlocks on NCCL passes there. Here the links take the GPU
path (``batch_isend_irecv`` pairs) over ``nccl_strict.StrictStream``: one stream per rank running its
batches in order, a send done only once the peer's receive is posted, messages matched by order.
gpipe, 1f1b, zb_h1, interleaved_1f1b and zbv train on pp2 and pp4, with and without ep (dualpipev on
pp2 x ep2 and pp4); every case's
validation pass runs its forward-only order; all compared with one process as test_equivalence does.
The sends in flight stay bounded (``p2p.SENDS_IN_FLIGHT`` batches, whatever M). And ZBV's old exchange
(each output sent in a batch of its own, the receives after it) deadlocks under the strict transport,
naming the two ranks that each wait for the other to post a receive.
"""

import pytest
from engine_harness import (
    CONFIG,
    DEEP_CONFIG,
    assert_matches_reference,
    reference,
    run_layouts,
    train,
)
from nccl_strict import StrictP2PStuck

from lightning_titan.parallel.mesh import ParallelDims, build_process_groups
from lightning_titan.parallel.pipeline import zbv
from lightning_titan.parallel.pipeline.p2p import SENDS_IN_FLIGHT
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.parallel.pipeline.stage import PipelineStage
from lightning_titan.runtime.launch import run_on_ranks

SCHEDULES = ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b:v2", "zbv"]
# (layout (dp, pp, ep), M, config) per world size: pp2; pp4 and pp2 x ep2; pp4 x ep2. M = 8 on pp2:
# gpipe's first stage sends 8 activations before it receives anything (the window's bound bites)
LAYOUTS = {
    2: [((1, 2, 1), 8, CONFIG)],
    4: [((1, 4, 1), 4, DEEP_CONFIG), ((1, 2, 2), 4, CONFIG)],
    8: [((1, 4, 2), 4, DEEP_CONFIG)],
}


# DualPipeV (M >= 2P), whose pairs send two messages to one peer in one batch: on pp2 x ep2, and
# on pp4 with its middle ranks (pp4 x ep2 would need M = 8 of a per-rank batch of 4)
DUALPIPEV = {
    2: [],
    4: [
        ((1, 2, 2), "dualpipev:strict", 4, CONFIG),
        ((1, 4, 1), "dualpipev:strict", 8, DEEP_CONFIG),
    ],
    8: [],
}


def strict_cases(world: int) -> list[tuple]:
    return [
        (layout, f"{schedule}:strict", m, config)
        for layout, m, config in LAYOUTS[world]
        for schedule in SCHEDULES
    ] + DUALPIPEV[world]


def old_run(stage, m, train):
    """``zbv._run`` before the fix: after each action, take the messages up to what the next action
    needs (none, often: then the output goes out alone)."""
    pp, p = stage.pp, stage.pp_rank
    actions = zbv.order(pp, p, m, train)
    pending = {peer: zbv.stream(pp, peer, p, m, train) for peer in (p - 1, p + 1)}

    def due(action):
        need = None if action is None else zbv.needs(pp, p, action)
        if need is None or need[1] not in pending[need[0]]:
            return []
        peer, msg = need
        upto = pending[peer].index(msg) + 1
        taken, pending[peer] = pending[peer][:upto], pending[peer][upto:]
        return [(peer, t) for t in taken]

    run = {
        "F": stage.forward_chunk,
        "B": stage.backward_input_chunk,
        "W": stage.backward_weight_chunk,
    }
    stage.exchange_messages(None, due(actions[0]))
    for k, action in enumerate(actions):
        run[action[0]](*action[1:])
        stage.exchange_messages(action, due(actions[k + 1] if k + 1 < len(actions) else None))


def old_exchange_messages(self, done, take):
    """``PipelineStage.exchange_messages`` before the fix: the output in a send-only batch, then
    each receive in a batch of its own."""
    if done is not None and done[0] in ("F", "B"):
        kind, chunk, i = done
        out = self._outbox.pop(("y" if kind == "F" else "dx", chunk, i))
        target = zbv.output(self.pp, self.pp_rank, done)
        if target is not None:
            to_next = target[0] == self.pp_rank + 1
            self.links.exchange(out if to_next else None, None if to_next else out)
        elif out is not None:
            self._inbox[("x", 1, i) if kind == "F" else ("g", 0, i)] = out.detach()
    for peer, (what, chunk, i) in take:
        from_prev = peer == self.pp_rank - 1
        x, g = self.links.exchange(recv_forward=from_prev, recv_backward=not from_prev)
        self._inbox["x" if what == "act" else "g", chunk, i] = x if from_prev else g


def old_zbv_waits(rank: int, world_size: int, deadline_s: float) -> str:
    """Spawned: one zbv step on pp2 as it ran before the fix, under the strict transport; what the
    rank waited for when its stream gave up (the pair is closed then: the last thing this process
    runs)."""
    zbv._run = old_run  # this process only (a fork)
    PipelineStage.exchange_messages = old_exchange_messages
    dims = ParallelDims(1, 2, 1, rank)
    split = StageSplit(2, None, v_shape=True)
    try:
        train(
            dims, build_process_groups(dims), "zbv", 2, steps=1, split=split, strict_p2p=deadline_s
        )
    except StrictP2PStuck as e:
        return str(e)
    return "finished"


@pytest.fixture(scope="module")
def refs():
    return {id(CONFIG): reference(CONFIG), id(DEEP_CONFIG): reference(DEEP_CONFIG)}


def check(refs: dict, cases: list[tuple], per_rank: list[list[dict]]) -> None:
    for i, (layout, schedule, m, config) in enumerate(cases):
        results = [ranks[i] for ranks in per_rank]
        assert_matches_reference(refs[id(config)], results, f"{layout} {schedule} M={m}")
        live = [r["sends_in_flight"] for r in results]
        assert max(live) <= SENDS_IN_FLIGHT, (layout, schedule, m, live)
        if schedule.startswith("gpipe") and m > SENDS_IN_FLIGHT:  # stage 0's M sends reach it
            assert live[0] == SENDS_IN_FLIGHT, (layout, schedule, m, live)


@pytest.mark.timeout(300)
def test_pp2_schedules_equal_one_process_and_old_zbv_deadlocks(refs):
    cases = strict_cases(2)
    per_rank = run_on_ranks(run_layouts, 2, cases, timeout_s=240, start_method="fork")
    check(refs, cases, per_rank)
    # the planted revert: ZBV's old exchange, pp2 M=2 (rank 0 sends a0_1 and waits for a1_0 while
    # rank 1 sends a1_0 and waits for a0_1)
    waits = run_on_ranks(old_zbv_waits, 2, 10.0, timeout_s=120, start_method="fork")
    print("\n".join(waits))
    for rank, peer in ((0, 1), (1, 0)):
        assert f"rank {rank}'s p2p stream gave up" in waits[rank], waits
        assert f"to rank {peer} " in waits[rank] and "post the matching receive" in waits[rank], (
            waits
        )


@pytest.mark.slow  # the fast tier keeps pp2 and the deadlock; CI runs these too
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [4, 8])
def test_pp4_and_ep_schedules_equal_one_process(refs, world):
    cases = strict_cases(world)  # about 15 s a world size on 2 shared cores
    per_rank = run_on_ranks(run_layouts, world, cases, timeout_s=240, start_method="fork")
    check(refs, cases, per_rank)
