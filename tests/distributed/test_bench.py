"""Measurement: the span analysis on simulated schedules and synthetic spans, the saved-tensor meter,
the recorder wired into the stack, and ``titan bench --quick`` end to end on 2 ranks (tp2 and its
torch ``parallelize_module`` peer included)."""

import json
import time
from dataclasses import asdict, replace

import pytest
import torch

from lightning_titan.lightning import plots
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups
from lightning_titan.parallel.pipeline.schedules import get_schedule
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.plan.memory import layout_state
from lightning_titan.runtime import holders, tracing
from lightning_titan.runtime.saved_tensors import SavedTensorMeter
from lightning_titan.tools.bench.cases import A2A_BLOCKING, OURS
from lightning_titan.tools.bench.overlap_report import exposure, overlap_markdown, overlap_rows
from lightning_titan.tools.bench.paired import Ratio, all_of, median_interval
from lightning_titan.tools.bench.runners import token_loss_sum
from lightning_titan.train.engine import Engine
from lightning_titan.train.step import TrainStep


class _OrderOnly:
    """A stage that only records the order in which a schedule calls forward and backward."""

    def __init__(self, pp, pp_rank):
        self.pp, self.pp_rank, self.order = pp, pp_rank, []

    def forward(self, i, x):
        self.order.append(("forward", i))

    def backward(self, i, g):
        self.order.append(("backward", i))

    def backward_input(self, i, g):  # zero-bubble: B, then W later
        self.order.append(("backward_input", i))

    def backward_weight(self, i):
        self.order.append(("backward_weight", i))

    def __getattr__(self, name):  # every send / recv: nothing to move here
        return lambda *args: None


def simulate(schedule, pp, m, fwd_ns=1000, bwd_ns=2000, slowdown=None, latency_ns=0, stretch=None):
    """Spans of a pipeline whose stages run ``schedule``'s order as early as the data dependencies allow:
    forward i on stage p after forward i on p-1; backward i after forward i and after backward i on p+1.
    ``slowdown``: stage -> factor on all its spans; ``stretch``: (stage, kind, i) -> factor on one."""
    orders = []
    for p in range(pp):
        stage = _OrderOnly(pp, p)
        get_schedule(schedule)(stage, m)
        orders.append(stage.order)
    done, free, nxt, spans = {}, [0] * pp, [0] * pp, []
    while any(nxt[p] < len(orders[p]) for p in range(pp)):
        progressed = False
        for p in range(pp):
            if nxt[p] == len(orders[p]):
                continue
            kind, i = orders[p][nxt[p]]
            deps = [("forward", p - 1, i)] if kind == "forward" and p > 0 else []
            if kind in ("backward", "backward_input"):  # the grad from p + 1: its B (or backward)
                deps = [("forward", p, i)] + ([(kind, p + 1, i)] if p < pp - 1 else [])
            if kind == "backward_weight":
                deps = [("backward_input", p, i)]
            if all(d in done for d in deps):
                # a message between stages arrives latency_ns after it was sent
                start = max([free[p]] + [done[d] + latency_ns * (d[1] != p) for d in deps])
                scale = (slowdown or {}).get(p, 1) * (stretch or {}).get((p, kind, i), 1)
                cost = {"forward": fwd_ns, "backward": bwd_ns}.get(kind, bwd_ns / 2)  # B, W: half
                end = start + scale * cost
                done[(kind, p, i)], free[p] = end, end
                span_kind = "forward" if kind == "forward" else "backward"
                spans.append(tracing.Span(span_kind, kind, p, start, end, args={"mb": i}))
                nxt[p] += 1
                progressed = True
        assert progressed, f"{schedule} deadlocks in the simulation"
    return spans


class _ChunkOrder:
    """A rank of ``v`` chunks that records the order interleaved 1F1B runs them in."""

    def __init__(self, pp, pp_rank, v):
        self.pp, self.pp_rank, self.num_chunks, self.order = pp, pp_rank, v, []

    def forward_chunk(self, chunk, i):
        self.order.append(("forward", chunk, i))

    def backward_chunk(self, chunk, i):
        self.order.append(("backward", chunk, i))

    def exchange(self, **messages):
        pass


def simulate_interleaved(pp, v, m, fwd_ns=1000, bwd_ns=2000):
    """Like ``simulate`` over virtual stages s = chunk * pp + rank, each 1/v of a stage's work:
    forward (s, i) after forward (s - 1, i); backward (s, i) after it and backward (s + 1, i)."""
    orders = []
    for p in range(pp):
        stage = _ChunkOrder(pp, p, v)
        get_schedule("interleaved_1f1b")(stage, m)
        orders.append(stage.order)
    done, free, nxt, spans = {}, [0] * pp, [0] * pp, []
    while any(nxt[p] < len(orders[p]) for p in range(pp)):
        progressed = False
        for p in range(pp):
            if nxt[p] == len(orders[p]):
                continue
            kind, chunk, i = orders[p][nxt[p]]
            s = chunk * pp + p
            deps = [("forward", s - 1, i)] if kind == "forward" and s > 0 else []
            if kind == "backward":
                deps = [("forward", s, i)] + ([("backward", s + 1, i)] if s < pp * v - 1 else [])
            if all(d in done for d in deps):
                start = max([free[p]] + [done[d] for d in deps])
                end = start + (fwd_ns if kind == "forward" else bwd_ns) / v
                done[(kind, s, i)], free[p] = end, end
                spans.append(
                    tracing.Span(kind, kind, p, start, end, args={"mb": i, "chunk": chunk})
                )
                nxt[p] += 1
                progressed = True
        assert progressed, f"interleaved P={pp} v={v} M={m} deadlocks in the simulation"
    return spans


@pytest.mark.parametrize(
    "pp,v,m", [(2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 16), (3, 2, 6), (4, 3, 8)]
)
def test_interleaved_bubble_of_ideal_pipelines_is_the_virtual_stage_one(pp, v, m):
    """Megatron's order reaches (P-1)/(v*M+P-1) on every stage when the stages cost the same."""
    for b in tracing.measure_bubbles(simulate_interleaved(pp, v, m), [list(range(pp))]):
        assert b.measured == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-9)
        assert b.measured < (pp - 1) / (m + pp - 1)  # 1F1B's


def test_the_timeline_says_m_and_v_under_interleaving_not_v_times_m():
    """Issue 17's bug: the v*M forwards of an interleaved stage were reported as M."""
    from lightning_titan.lightning.callbacks import _theory_label

    bubbles = tracing.measure_bubbles(simulate_interleaved(4, 2, 8), [list(range(4))])
    assert {(b.num_microbatches, b.virtual_stages) for b in bubbles} == {(8, 2)}
    assert bubbles[0].theory == pytest.approx(3 / (2 * 8 + 3))
    label = _theory_label(asdict(bubbles[0]))
    assert "(v*M+P-1)" in label and "M=8, v=2" in label
    one_chunk = tracing.measure_bubbles(simulate("1f1b", 4, 8), [list(range(4))])[0]
    assert _theory_label(asdict(one_chunk)).endswith("(M=8)")


@pytest.mark.parametrize(
    "spans",
    [simulate_interleaved(4, 2, 8, bwd_ns=2600), simulate("zb_h1", 4, 8, slowdown={3: 1.4})],
    ids=["interleaved", "zb_h1"],
)
def test_the_compute_only_replay_knows_chunks_and_deferred_weight_grads(spans):
    """Spans already as early as their dependencies allow replay to themselves: the replay reads
    chunk ids as virtual stages and waits a W only for its own B."""
    replayed = tracing.replay_without_communication(
        [
            replace(s, name="backward_weight" if s.name == "backward_weight" else s.kind)
            for s in spans
        ],
        [[0, 1, 2, 3]],
    )
    assert sorted((s.rank, s.start_ns, s.end_ns) for s in replayed) == sorted(
        (s.rank, s.start_ns, s.end_ns) for s in spans
    )


def test_the_replay_sends_the_input_grad_upstream_before_the_deferred_weight_grad():
    """Stage 1 runs F0 B0 W0 with a long W0; stage 0, still busy with forwards, starts its B0 when
    stage 1's B0 ends, not its W0."""

    def span(name, rank, start, end, mb):
        kind = "forward" if name == "forward" else "backward"
        return tracing.Span(kind, name, rank, start, end, args={"mb": mb})

    spans = [span("forward", 0, 0, 10, 0), span("forward", 0, 10, 20, 1), span("forward", 0, 20, 30, 2),
             span("backward", 0, 60, 80, 0),
             span("forward", 1, 10, 20, 0), span("backward", 1, 20, 40, 0),
             span("backward_weight", 1, 40, 140, 0)]  # fmt: skip
    replayed = {
        (s.rank, s.name, s.args["mb"]): s
        for s in tracing.replay_without_communication(spans, [[0, 1]])
    }
    assert replayed[(0, "backward", 0)].start_ns == 40


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (3, 7)])
def test_zb_h1_bubble_is_below_1f1b_at_the_same_m(pp, m):
    """Ideal stages, backward = B + W of half its time each: deferring W into the cooldown leaves
    every stage of ZB-H1 idle less than under 1F1B (the W's fill what 1F1B waits for)."""
    zb = tracing.measure_bubbles(simulate("zb_h1", pp, m), [list(range(pp))])
    one_f_one_b = tracing.measure_bubbles(simulate("1f1b", pp, m), [list(range(pp))])
    for ours, theirs in zip(zb, one_f_one_b, strict=True):
        assert ours.measured < theirs.measured - 0.02, (ours, theirs)


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (3, 5), (4, 8), (4, 16)])
def test_zbv_ideal_bubble_is_below_zb_h1_and_replays_along_the_v(pp, m):
    """ZBV's order replayed with F = B = W per chunk (the replay follows each span's V stage: rank r
    holds r and 2P-1-r): idle less than ZB-H1 at the same M, and 2P chunk-microbatches live at most."""
    from lightning_titan.parallel.pipeline import theory

    zbv = theory.ideal_bubble("zbv", pp, 2, m)
    assert zbv < theory.ideal_bubble("zb_h1", pp, 1, m), zbv
    for p in range(pp):
        assert theory.live_peak("zbv", pp, p, 2, m, [1, 1])[1] <= 2 * pp


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 8), (4, 4), (4, 16), (3, 7)])
def test_measured_bubble_of_ideal_pipelines_is_the_textbook_one(schedule, pp, m):
    spans = simulate(schedule, pp, m)
    bubbles = tracing.measure_bubbles(spans, [list(range(pp))])
    assert [b.stage for b in bubbles] == list(range(pp))
    for b in bubbles:
        # independent of the formula in tracing: busy M*(F+B) of a (M+P-1)*(F+B) flush
        assert b.measured == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
        assert b.theory == pytest.approx((pp - 1) / (m + pp - 1)) and b.num_microbatches == m


def test_a_slow_stage_shows_up_as_bubble_on_the_others():
    bubbles = tracing.measure_bubbles(simulate("1f1b", 2, 8, slowdown={1: 2}), [[0, 1]])
    # stage 1 twice as slow: it paces the pipeline, stage 0 idles about half the time
    assert bubbles[0].measured > 0.4 and bubbles[1].measured < tracing.theory_bubble(2, 8)


def test_replay_removes_communication_delay_but_keeps_compute_imbalance():
    pipelines, theory = [[0, 1, 2, 3]], tracing.theory_bubble(4, 16)
    late = simulate("1f1b", 4, 16, latency_ns=300)
    assert tracing.measure_bubbles(late, pipelines)[0].measured > theory + 0.05
    replay = tracing.replay_without_communication(late, pipelines)
    assert all(
        b.measured == pytest.approx(theory) for b in tracing.measure_bubbles(replay, pipelines)
    )
    slow = simulate("1f1b", 4, 16, slowdown={2: 1.5})
    kept = tracing.measure_bubbles(tracing.replay_without_communication(slow, pipelines), pipelines)
    assert kept[0].measured > theory + 0.1


def test_bubble_breakdown_tells_uneven_stages_jitter_and_transfers_apart():
    pipelines, theory = [[0, 1]], tracing.theory_bubble(2, 8)

    def worst(spans):
        return max(tracing.bubble_breakdown(spans, pipelines), key=lambda b: b["measured"])

    # a few slow microbatches (jitter), stages equal on the median, free transfers
    jitter = worst(simulate("1f1b", 2, 8, stretch={(1, "backward", 2): 3, (1, "backward", 5): 3}))
    assert jitter["steady_compute"] == pytest.approx(theory)
    assert jitter["compute_only"] > theory + 0.05
    assert jitter["measured"] == pytest.approx(jitter["compute_only"])
    # an uneven stage: steady compute already shows it
    uneven = worst(simulate("1f1b", 2, 8, slowdown={1: 1.5}))
    assert uneven["steady_compute"] == pytest.approx(uneven["compute_only"])
    assert uneven["steady_compute"] > theory + 0.05
    # slow transfers only: both replays give the theory, the measurement does not
    late = worst(simulate("1f1b", 2, 8, latency_ns=500))
    assert late["steady_compute"] == pytest.approx(theory)
    assert late["compute_only"] == pytest.approx(theory)
    assert late["measured"] > theory + 0.05


def test_spans_carry_their_threads_cpu_time():
    """A span that computes holds its CPU time, one that waits (a rank whose core went elsewhere,
    or blocked in a transfer) next to none: the replay at CPU lengths rests on this."""
    tracing.start(0)
    with tracing.span("forward", "computes"):
        start = time.thread_time_ns()
        while time.thread_time_ns() - start < 20_000_000:  # 20 ms of this thread's CPU, any load
            pass
    with tracing.span("forward", "waits"):
        time.sleep(0.02)
    computes, waits = tracing.stop()
    # (the two clocks tick apart by a few microseconds)
    assert computes.cpu_ns >= 20_000_000 and computes.duration_ns > computes.cpu_ns - 1_000_000
    assert waits.cpu_ns < 2_000_000 and waits.duration_ns >= 20_000_000


def test_the_cpu_time_replay_drops_a_shared_cores_waits_and_keeps_uneven_stages():
    pipelines, theory = [[0, 1]], tracing.theory_bubble(2, 8)

    def with_cpu(spans, extra_wall=None):
        # wall lengths stretched where a rank lost its core; the CPU time is what it computed
        return [replace(s, cpu_ns=s.duration_ns,
                        end_ns=s.end_ns + (extra_wall or {}).get((s.rank, s.args["mb"], s.kind), 0))
                for s in spans]  # fmt: skip

    waited = with_cpu(simulate("1f1b", 2, 8), {(1, 2, "backward"): 4000, (0, 5, "forward"): 3000})
    worst = max(tracing.bubble_breakdown(waited, pipelines), key=lambda b: b["compute_only"])
    assert worst["compute_only"] > theory + 0.05
    assert worst["cpu_compute"] == pytest.approx(theory)
    uneven = with_cpu(simulate("1f1b", 2, 8, slowdown={1: 1.5}))
    worst = max(tracing.bubble_breakdown(uneven, pipelines), key=lambda b: b["measured"])
    assert (
        worst["cpu_compute"] == pytest.approx(worst["compute_only"])
        and worst["cpu_compute"] > theory + 0.05
    )
    # made-up spans without CPU times: no CPU replay, not a wrong one
    assert all(
        b["cpu_compute"] is None
        for b in tracing.bubble_breakdown(simulate("1f1b", 2, 8), pipelines)
    )


def test_median_lengths_are_taken_per_chunk():
    """Interleaved, a rank's chunks differ (the last one also runs the head and the loss): one
    median over both would even them out and hide the imbalance the replay is there to show."""
    spans = simulate_interleaved(2, 2, 4)
    slow = [replace(s, end_ns=s.start_ns + 3 * s.duration_ns) if s.args["chunk"] == 1 and s.rank == 1
            else s for s in spans]  # fmt: skip
    steady = tracing.with_steady_compute(slow)
    for before, after in zip(slow, steady, strict=True):
        assert (
            after.duration_ns == before.duration_ns
        )  # each (rank, kind, chunk) was steady already


def test_exclusive_time_goes_to_the_innermost_span():
    forward = tracing.Span("forward", "forward", 0, 0, 100)
    a2a = [
        tracing.Span("all_to_all", "tokens", 0, 20, 30),
        tracing.Span("all_to_all", "t", 0, 50, 70),
    ]
    other_thread = tracing.Span("all_reduce", "launch", 0, 60, 65, thread=2)
    got = tracing.exclusive_ns([forward, *a2a, other_thread], window=(0, 120))
    assert got == {"forward": 70, "all_to_all": 25, "all_reduce": 5, "other": 20}
    per_kind = tracing.time_by_kind([forward, *a2a])
    assert per_kind["forward"] == pytest.approx(70e-6) and per_kind["all_to_all"] == pytest.approx(
        30e-6
    )


def _exchange(name, start, launched, waited, end, cpu, rank=0, thread=0):
    """An all-to-all's spans: in flight [start, end] (``cpu`` ns of work under it), its launch
    [start, launched] and its wait [waited, end], the last two at 1 ns of CPU each."""
    return [
        tracing.Span("in_flight", name, rank, start, end, thread=thread, cpu_ns=cpu + 2),
        tracing.Span("all_to_all", name, rank, start, launched, thread=thread, cpu_ns=1),
        tracing.Span("all_to_all", name, rank, waited, end, thread=thread, cpu_ns=1),
    ]


def test_overlap_exposure_measured_and_replayed():
    """Exposed = launch + wait, not the time in flight (compute under it keeps its kind); the replay
    gives each overlapped exchange its blocking length less the CPU work between launch and wait."""
    forward = [tracing.Span("forward", "f", 0, 0, 100, cpu_ns=100)]
    counts = [tracing.Span("all_to_all", "counts", 0, 2, 4, cpu_ns=0)]
    blocking = forward + counts + _exchange("dispatch", 10, 11, 12, 40, 0)  # 30 ns, waited at once
    overlapped = forward + counts + _exchange("dispatch", 10, 11, 30, 40, cpu=19)
    assert tracing.exclusive_ns(overlapped, (0, 100)) == {"forward": 87, "all_to_all": 13}
    e = exposure({OURS: overlapped}, blocking)
    assert e["blocking"] == [{"step_ms": 100e-6, "in_flight_ms": 32e-6, "exposed_ms": 31e-6}]
    ours = e["impls"][OURS]
    assert ours["measured"] == [{"step_ms": 100e-6, "in_flight_ms": 32e-6, "exposed_ms": 13e-6}]
    # dispatch: 30 ns in flight waited at once, 19 ns of work under it -> 11; counts: its 2 ns
    assert ours["replay"] == [
        {"exposed_ms": pytest.approx(13e-6), "step_ms": pytest.approx(100e-6)}
    ]
    e |= {"schedules": {A2A_BLOCKING: "1f1b", OURS: "1f1b"}, "activations": {}}
    row = {"case": "ep2", "ep_overlap": e, "microbatches": 2,
           "impls": {OURS: {"step_ms": 1.0}, A2A_BLOCKING: {"step_ms": 1.2}}}  # fmt: skip
    blocked, got = overlap_rows([row])
    assert blocked["impl"] == A2A_BLOCKING and "replay" not in blocked
    assert got["ratio"] == pytest.approx(1.2) and got["replay_met"] is True  # 13 of 100
    assert "| ep2 | 1f1b | 2 | 1.0 | 1.20x |" in overlap_markdown([blocked, got])
    # its EP peer waited 20 ns for the same exchange: the transfer's length, without lateness
    peer = [tracing.Span("forward", "f", 1, 0, 100)] + _exchange("dispatch", 15, 16, 16, 35, 0, 1)
    e = exposure({OURS: overlapped}, blocking + peer, groups=[[0, 1]])
    assert e["impls"][OURS]["replay"][0]["exposed_ms"] == pytest.approx(3e-6)  # 20 - 19 + 2


def test_a_pairs_two_threads_count_each_instant_once_for_the_thread_holding_the_rank():
    """1f1b_overlap / dualpipev: the forward (thread 1) and the backward (thread 2) overlap in wall
    time; one computes at a time and hands over at each launch. The time split gives each instant
    to the holder (the forward's own compute is not the backward's because the backward started
    later), exposure counts only waits, and the replay lets the partner's compute between the
    hand-overs hide an exchange."""
    f = tracing.Span("forward", "f", 0, 0, 70, thread=1, cpu_ns=41)  # holds [0,13), [42,70)
    b = tracing.Span("backward", "b", 0, 13, 90, thread=2, cpu_ns=49)  # [13,42), [70,90)
    pair = [f, b, *_exchange("dispatch", 10, 12, 50, 60, 8, thread=1),
            *_exchange("dispatch", 40, 42, 71, 80, 1, thread=2)]  # fmt: skip
    got = tracing.exclusive_ns(pair, (0, 90))
    assert got == {"forward": 29, "backward": 38, "all_to_all": 23}
    blocking = [tracing.Span("forward", "f", 0, 0, 50), tracing.Span("backward", "b", 0, 50, 100),
                *_exchange("dispatch", 10, 11, 11, 40, 0),  # forward's: 30 ns
                *_exchange("dispatch", 60, 61, 61, 85, 0)]  # backward's: 25 ns  # fmt: skip
    e = exposure({OURS: pair}, blocking)["impls"][OURS]
    assert e["measured"] == [{"step_ms": 90e-6, "in_flight_ms": 70e-6, "exposed_ms": 23e-6}]
    # forward's: 8 own + 27 of the backward's compute >= 30; backward's: 25 - (1 + 18) = 6
    assert e["replay"][0]["exposed_ms"] == pytest.approx(6e-6)
    # the chart draws each thread where it held the rank: the forward in two pieces
    pieces = holders.held(pair, tracing.BACKGROUND_KINDS)
    assert sorted((s.start_ns, s.end_ns) for s in pieces if s.kind == "forward") == [
        (0, 13),
        (42, 70),
    ]


def test_time_split_counts_the_zero_parameter_gather():
    spans = [tracing.Span("optimizer", "AdamW", 0, 0, 40_000),
             tracing.Span("all_gather", "zero params", 0, 40_000, 100_000)]  # fmt: skip
    per_kind = tracing.time_by_kind(spans)
    assert per_kind["all_gather"] == pytest.approx(0.06) and per_kind["optimizer"] == 0.04
    assert sum(per_kind.values()) == pytest.approx(0.1)  # the step, nothing dropped


def test_chrome_trace_has_one_process_per_rank_in_microseconds():
    spans = [tracing.Span("forward", "forward", 1, 5_000, 9_000, step=3, args={"mb": 2}),
             tracing.Span("p2p", "send_forward", 0, 2_000, 3_000)]  # fmt: skip
    trace = json.loads(json.dumps(plots.chrome_trace(spans, {0: "rank 0 (pp0)"})))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["name"], e["ts"], e["dur"]) for e in events} == {
        (1, "forward 2", 3.0, 4.0),
        (0, "send_forward", 0.0, 1.0),
    }
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert names == {0: "rank 0 (pp0)", 1: "rank 1"}


def test_saved_tensor_meter_counts_each_storage_once_and_releases_it():
    n = 1000
    w = torch.nn.Parameter(torch.randn(n))
    x = torch.randn(n, requires_grad=True)
    meter = SavedTensorMeter(exclude=[w])
    with meter:
        a = x.exp()  # saves its output a
        b = a.sin()  # saves its input a: the same storage, counted once
        c = b.cos()  # saves b: a second storage
        d = (c * w).sum()  # saves c (counted) and w (a parameter: not counted)
    assert meter.peak == 3 * n * 4
    d.backward()
    del a, b, c, d
    assert meter.current == 0 and meter.peak == 3 * n * 4


def test_saved_tensor_meter_releases_a_graph_split_into_input_and_weight_grads():
    """ZB-H1's B retains the graph and W runs only the weight path: the input path's saved outputs
    (exp's here) must still go when the graph does; the meter once held them in a cycle with their
    grad_fn and reported every microbatch of a step as live."""
    from lightning_titan.parallel.pipeline import backward_split

    w = torch.nn.Parameter(torch.randn(8, 8))
    meter = SavedTensorMeter(exclude=[w])
    with meter:
        for _ in range(3):
            x = torch.randn(4, 8, requires_grad=True)
            objective = (x.exp() @ w).sum()
            dx, weight_grads = backward_split.split(objective, x, [w])
            weight_grads.run()
            del objective, weight_grads
        assert meter.current == 0 and meter.peak == 4 * 8 * 4  # one microbatch's exp output
    torch.testing.assert_close(dx, (w.sum(1) * x.exp()).detach())


def test_recording_is_off_by_default_and_the_stack_reports_its_spans():
    config = ModelConfig(vocab_size=31, d_model=16, n_layers=2, n_heads=2, ffn_dim=8, n_experts=2,
                         seq_len=6)  # fmt: skip
    model = StageModel(config)
    model.init_weights(0)
    engine = Engine(model, ParallelDims(1, 1, 1), ProcessGroups(None, None, None, None))
    tokens = torch.randint(0, 31, (4, 7))
    engine.forward_backward(model, tokens[:, :-1], tokens[:, 1:], 2, token_loss_sum)
    assert not tracing.is_recording() and tracing.stop() == []
    tracing.start(rank=3, step=9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    TrainStep(engine, optimizer, max_norm=1.0).run(
        model, tokens[:, :-1], tokens[:, 1:], 2, token_loss_sum
    )
    spans = tracing.stop()
    kinds = [s.kind for s in spans]
    assert kinds.count("forward") == 2 and kinds.count("backward") == 2
    assert kinds.count("optimizer") == 1
    assert {s.rank for s in spans} == {3} and {s.step for s in spans} == {9}
    assert all(s.end_ns >= s.start_ns for s in spans)
    assert sorted(s.args["mb"] for s in spans if s.kind == "forward") == [0, 1]
    with pytest.raises(RuntimeError, match="already recording"):
        tracing.start(0)
        tracing.start(0)
    tracing.stop()


def _state(expert_opt, non_expert_opt, params=100):
    return {"expert_params": params, "non_expert_params": params, "expert_grads": params,
            "non_expert_grads": params, "expert_optimizer": expert_opt,
            "non_expert_optimizer": non_expert_opt}  # fmt: skip


def test_the_median_interval_is_the_sign_tests_at_90_percent():
    """The k-th smallest and k-th largest of n values, k the largest with 2 P(Binomial(n, 1/2) < k)
    <= 0.1 (the standard table: n=5 the extremes, n=9 the second, n=15 the fourth, n=21 the
    seventh); none below 5 values, where even the extremes miss the median 1 time in 8."""
    for n, k in ((5, 1), (9, 2), (15, 4), (21, 7)):
        values = [float(v) for v in reversed(range(n))]  # any order: it sorts
        assert median_interval(values) == (k - 1, n - k), n
    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None
    assert median_interval([float(v) for v in range(15)], confidence=0.5) == (5, 9)


def test_a_ratio_pairs_the_rounds_and_decides_a_target_only_where_its_interval_does():
    """Round i of one implementation against round i of the other (timed back to back), not the
    fastest of one against the slowest of the other; a target is met or missed only when the whole
    interval is on one side of it."""
    loaded = {"step_ms": 15.0, "rounds_ms": [10.0, 20.0, 10.0, 20.0, 10.0]}  # both slowed alike
    same = Ratio.of(loaded, loaded)
    assert same == Ratio(1.0, (1.0, 1.0)) and same.cell == "1.00x (1.00-1.00)"

    def rounds(*ratios):
        return {"rounds_ms": [10.0 * r for r in ratios]}, {"rounds_ms": [10.0] * len(ratios)}

    within = Ratio.of(*rounds(1.04, 1.01, 1.045, 1.02, 1.03))
    assert within.median == pytest.approx(1.03) and within.interval == pytest.approx((1.01, 1.045))
    assert within.at_most(1.05) is True and within.at_least(1.05) is False
    straddles = Ratio.of(*rounds(0.98, 1.02, 1.03, 1.04, 1.09))
    assert straddles.at_most(1.05) is None and straddles.at_least(1.05) is None
    assert straddles.cell == "1.03x (0.98-1.09)"
    above = Ratio.of(*rounds(1.06, 1.07, 1.2, 1.08, 1.1))
    assert above.at_most(1.05) is False and above.at_least(1.05) is True
    # fewer than 5 rounds give no interval: the median alone decides, as one number did before
    few = Ratio.of({"step_ms": 12.0, "rounds_ms": [10.0, 12.0, 15.0]}, {"step_ms": 10.0,
                   "rounds_ms": [10.0, 10.0, 10.0]})  # fmt: skip
    assert few == Ratio(1.2, None) and few.cell == "1.20x" and few.at_least(1.05) is True
    assert Ratio.of({"step_ms": 12.0}, {"step_ms": 10.0}) == Ratio(1.2, None)  # no rounds recorded
    assert (
        all_of(True, True) is True and all_of(True, None) is None and all_of(None, False) is False
    )


def test_zero_table_ideal_splits_expert_state_over_dp_and_the_rest_over_dp_times_ep():
    from lightning_titan.tools.bench import report

    def impl(step_ms, states):
        return {"step_ms": step_ms, "cpu_ms": 2 * step_ms, "tokens_per_s": 1e3 / step_ms,
                "state_bytes_per_rank": states}  # fmt: skip

    # dp2 x ep2, per rank at zero=0: 800 B of expert state (its EP share), 1200 B of the rest
    zero0 = [_state(800, 1200)] * 4
    exact = [_state(400, 300)] * 4  # experts over dp=2, the rest over dp*ep=4
    row = {"world": 4, "case": "dp2xep2", "dp": 2, "ep": 2,
           "impls": {"titan": impl(10.0, zero0), "titan_zero1": impl(10.4, exact)}}  # fmt: skip
    (z,) = report.zero_rows([row])
    assert z["ideal"] == pytest.approx(700 / 2000) and z["optimizer_ratio"] == pytest.approx(0.35)
    assert z["memory_met"] and z["time_met"] and z["step_ratio"] == pytest.approx(1.04)
    assert z["mb"]["titan_zero1"] == {"params": 200e-6, "grads": 200e-6, "optimizer": 700e-6}
    row["impls"]["titan_zero1"]["cpu_ms"] = 22.0  # wall within 1.05x, CPU 1.10x: missed
    assert not report.zero_rows([row])[0]["time_met"]
    # everything over 4 ranks is not what zero=1 does with experts: the worst rank is 10% off
    uneven = [_state(400, 300)] * 3 + [_state(400, 370)]
    row["impls"]["titan_zero1"] = impl(11.0, uneven)
    (z,) = report.zero_rows([row])
    assert (
        not z["memory_met"] and not z["time_met"] and z["optimizer_ratio"] == pytest.approx(0.385)
    )
    assert "peer_met" not in z and "| 4 | dp2xep2 |" in "\n".join(report.zero_markdown([z]))
    assert report.peer_ratios([row]) == []  # zero=1 is ours, not a peer


def test_zero_table_ideal_under_tp_splits_each_part_over_its_own_group():
    """dp2 x tp2: experts (whole on both TP ranks) over dp x tp = 4 ranks, the TP-cut weights (200 of
    the 300 non-expert parameter bytes) over dp = 2, norms and routers over dp x tp = 4."""
    from lightning_titan.tools.bench import report

    def impl(states, cut):
        return {"step_ms": 10.0, "cpu_ms": 20.0, "tokens_per_s": 100.0,
                "state_bytes_per_rank": states, "tp_cut_bytes_per_rank": cut}  # fmt: skip

    zero0 = [_state(400, 600, params=300)] * 4
    exact = [_state(100, 250, params=300)] * 4  # 400/4; 600 * (2/3 / 2 + 1/3 / 4)
    row = {"world": 4, "case": "dp2xtp2", "dp": 2, "ep": 1, "tp": 2, "cp": 1,
           "impls": {"titan": impl(zero0, [200] * 4), "titan_zero1": impl(exact, [200] * 4)}}  # fmt: skip
    (z,) = report.zero_rows([row])
    assert z["ideal"] == pytest.approx(0.35) and z["memory_met"]


def test_zero2_table_splits_grads_like_the_state_and_times_against_zero_0():
    from lightning_titan.tools.bench import report

    def impl(step_ms, states):
        return {"step_ms": step_ms, "cpu_ms": 2 * step_ms, "tokens_per_s": 1e3 / step_ms,
                "state_bytes_per_rank": states}  # fmt: skip

    def grads(state, expert, non_expert):
        return {**state, "expert_grads": expert, "non_expert_grads": non_expert}

    # dp2 x ep2, 100 B of expert grads and 100 B of the rest per rank at zero=0: ideal 50 + 25
    zero0 = [_state(800, 1200)] * 4
    zero2 = [grads(_state(400, 300), 50, 25)] * 3 + [grads(_state(400, 300), 50, 30)]
    row = {"world": 4, "case": "dp2xep2", "dp": 2, "ep": 2,
           "impls": {"titan": impl(10.0, zero0), "titan_zero1": impl(10.4, zero0),
                     "titan_zero2": impl(10.2, zero2)}}  # fmt: skip
    (z,) = report.zero_rows([row])
    z2 = z["zero2"]
    assert z2["grads_ideal"] == pytest.approx(0.375) and z2["grads_ratio"] == pytest.approx(0.4)
    assert not z2["grads_met"] and z2["step_ratio"] == pytest.approx(1.02) and z2["time_met"]
    assert z["mb"]["titan_zero2"]["grads"] == pytest.approx(80e-6)
    assert "**ZeRO-2**" in "\n".join(report.zero_markdown([z]))
    assert report.peer_ratios([row]) == []  # zero=2 is ours, not a peer
    # torch FSDP2 shards what zero=2 does: it is timed against ours at zero=2
    row["impls"]["fsdp2"] = impl(10.1, zero2)
    (z,) = report.zero_rows([row])
    z2 = z["zero2"]
    assert z2["peer_step_ratio"] == pytest.approx(10.1 / 10.2) and z2["peer_met"] is False
    assert "| 0.99x | **no** |" in "\n".join(report.zero_markdown([z]))
    (peer,) = report.peer_ratios([row])
    assert peer["baseline"] == "titan_zero2" and peer["ratio"] == pytest.approx(10.1 / 10.2)


def test_the_zero_peer_is_timed_against_ours_at_zero_1():
    from lightning_titan.tools.bench import report

    def impl(step_ms):
        return {"step_ms": step_ms, "cpu_ms": step_ms, "tokens_per_s": 1e3 / step_ms,
                "state_bytes_per_rank": [_state(50, 50)] * 2}  # fmt: skip

    row = {"world": 2, "case": "dp2", "dp": 2, "ep": 1,
           "impls": {"titan": impl(10.0), "titan_zero1": impl(12.0), "ddp": impl(11.0),
                     "ddp_zero": impl(13.0)}}  # fmt: skip
    peers = {p["peer"]: p for p in report.peer_ratios([row])}
    assert peers["ddp"]["baseline"] == "titan" and peers["ddp"]["ratio"] == pytest.approx(1.1)
    assert peers["ddp_zero"]["baseline"] == "titan_zero1" and peers["ddp_zero"]["met"]
    assert peers["ddp_zero"]["ratio"] == pytest.approx(13 / 12)
    (z,) = report.zero_rows([row])
    assert z["peer_step_ratio"] == pytest.approx(13 / 12) and z["peer_met"]


def test_zero3_table_divides_each_part_by_its_group_and_times_against_fsdp2_and_zero2():
    """dp2 x ep2 at zero=0: 100 B of expert and of non-expert params and grads, 800 + 1200 B of
    optimizer state per rank; zero=3 cuts the experts over dp = 2 and the rest over dp x ep = 4, so
    each part's ideal share is (x / 2 + y / 4) / (x + y); one rank 10 % over on its grads misses.
    Time: zero=3 / FSDP2 at most 1.0x and zero=3 / zero=2 at most 1.15x, over the paired rounds."""
    from lightning_titan.tools.bench import report

    def impl(rounds, states, **extra):
        return {"step_ms": sorted(rounds)[len(rounds) // 2], "cpu_ms": 1.0, "tokens_per_s": 1.0,
                "rounds_ms": rounds, "rounds_cpu_ms": [1.0] * len(rounds),
                "state_bytes_per_rank": states, **extra}  # fmt: skip

    zero0 = [_state(800, 1200)] * 4
    rows3 = {"expert_params": 50, "non_expert_params": 25, "expert_grads": 50,
             "non_expert_grads": 25, "expert_optimizer": 400, "non_expert_optimizer": 300}  # fmt: skip
    zero3 = [rows3] * 3 + [{**rows3, "non_expert_grads": 32.5}]  # 82.5 / 75: 10 % over
    rounds = [10.0, 11.0, 10.0, 12.0, 10.0]
    row = {"world": 4, "case": "dp2xep2", "dp": 2, "ep": 2,
           "impls": {"titan": impl(rounds, zero0),
                     "titan_zero2": impl([r / 1.1 for r in rounds], zero0),
                     "titan_zero3": impl(rounds, zero3, param_peak_bytes_per_rank=[900, 1000] * 2,
                                         block_gathers_per_rank=[{"prefetched": 6, "kept": 1,
                                                                  "gathered": 1, "wasted": 0}] * 4)}}  # fmt: skip
    (z,) = report.zero3_rows([row])
    parts = z["parts"]
    assert parts["params"]["ideal"] == pytest.approx(75 / 200) and parts["params"]["met"]
    assert parts["optimizer"]["ratio"] == pytest.approx(0.35) and parts["optimizer"]["met"]
    assert parts["grads"]["ratio"] == pytest.approx(82.5 / 200) and not parts["grads"]["met"]
    assert not z["memory_met"] and z["param_peak_mb"] == {"titan_zero3": 1000e-6}
    assert z["zero2"]["step_ratio"] == pytest.approx(1.1) and z["zero2"]["met"] is True
    assert "peer" not in z  # no FSDP2 under ep: its cells say so
    table = "\n".join(report.zero3_markdown([z]))
    assert (
        "| 4 | dp2xep2 |" in table
        and "| 6 / 1 / 1 / 0 | - | - | - | 1.10x (1.10-1.10) | yes | 1.00x" in table
    )
    # FSDP2 beside it on a dp case: ours no slower over every round, else missed or undecided
    row["case"], row["ep"] = "dp4", 1
    row["impls"]["fsdp2_zero3"] = impl([r * 1.25 for r in rounds], zero3)
    (z,) = report.zero3_rows([row])
    assert z["peer"]["step_ratio"] == pytest.approx(0.8) and z["peer"]["met"] is True
    row["impls"]["fsdp2_zero3"]["rounds_ms"] = [9.0, 12.0, 9.0, 12.0, 9.0]  # straddles 1.0
    assert report.zero3_rows([row])[0]["peer"]["met"] is None
    (peer,) = [p for p in report.peer_ratios([row]) if p["peer"] == "fsdp2_zero3"]
    assert peer["baseline"] == "titan_zero3"


@pytest.mark.slow  # a tool's end-to-end run (about 30 s); the fast tier keeps its parts' tests
@pytest.mark.timeout(300)
def test_bench_quick_runs_end_to_end_on_two_ranks(tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "lightning_titan", "bench", "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "titan bench:" in proc.stdout and "'rows'" not in proc.stdout + proc.stderr
    results = json.loads((tmp_path / "bench.json").read_text())
    for name in ("bench.md", "bench.json", "throughput.png", "breakdown.png", "peers.png", "memory.png",
                 "timeline/pp2_1f1b.json", "timeline/pp2_1f1b.png", "timeline/dp2.json"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0, name
    assert {r["case"] for r in results["rows"]} == {
        "dp2", "pp2 1f1b", "pp2 gpipe", "ep2", "tp2", "cp2"
    }  # fmt: skip
    for row in results["rows"]:
        for impl in row["impls"].values():
            assert impl["tokens_per_s"] > 0 and impl["step_ms"] > 0
    assert {(p["case"], p["peer"], p["baseline"]) for p in results["peers"]} == {
        ("dp2", "titan_per_param", "titan"), ("dp2", "ddp", "titan"),
        ("dp2", "ddp_zero", "titan_zero1"), ("dp2", "fsdp2", "titan_zero2"),
        ("dp2", "fsdp2_zero3", "titan_zero3"),
        ("pp2 1f1b", "torch_pp", "titan"), ("tp2", "torch_tp", "titan")}  # fmt: skip
    # ZeRO-1: each rank keeps about half the AdamW state at dp2, params and grads whole; torch's
    # ZeroRedundancyOptimizer gives each parameter's state to one rank: its ranks add up to zero=0
    dp = next(r for r in results["rows"] if r["case"] == "dp2")
    (zero,) = results["zero"]
    assert zero["case"] == "dp2" and zero["ideal"] == 0.5 and zero["memory_met"]
    assert zero["optimizer_ratio_per_rank"] == pytest.approx([0.5, 0.5], rel=0.05)
    assert zero["mb"]["titan"]["optimizer"] == pytest.approx(2 * zero["mb"]["titan"]["params"])
    for kind in ("params", "grads"):
        assert zero["mb"]["titan_zero1"][kind] == zero["mb"]["titan"][kind] > 0
    states = {impl: v["state_bytes_per_rank"] for impl, v in dp["impls"].items()}
    assert states["ddp"] == states["titan"] == states["titan_per_param"]
    peer_ranks = [s["expert_optimizer"] + s["non_expert_optimizer"] for s in states["ddp_zero"]]
    assert sum(peer_ranks) == pytest.approx(zero["mb"]["titan"]["optimizer"] * 1e6, abs=1)
    assert min(peer_ranks) > 0
    assert zero["step_ratio"] > 0 and zero["peer_step_ratio"] > 0
    # 2 rounds: too few for an interval, so each ratio is the median of its 2 paired rounds'
    dp_impls = dp["impls"]
    zero_pair = ("titan_zero1", "titan")
    for cell, median, (a, b), key in (
            (zero["step_cell"], zero["step_ratio"], zero_pair, "rounds_ms"),
            (zero["cpu_cell"], zero["cpu_ratio"], zero_pair, "rounds_cpu_ms"),
            *((p["ratio_cell"], p["ratio"], (p["peer"], p["baseline"]), "rounds_ms")
              for p in results["peers"] if p["case"] == "dp2")):  # fmt: skip
        pairs = [x / y for x, y in zip(dp_impls[a][key], dp_impls[b][key], strict=True)]
        assert len(pairs) == 2 and median == pytest.approx(sum(pairs) / 2), cell
        assert cell == f"{median:.2f}x"
    split = zero["split_ms"]  # recorded steps: only zero=1 gathers parameters
    assert split["zero0"]["all_gather"] == 0 < split["zero1"]["all_gather"]
    assert split["zero1"]["optimizer"] > 0
    ep = next(r for r in results["rows"] if r["case"] == "ep2")
    assert ep["time_ms"]["all_to_all"] > 0 and ep["state"]["expert_share"] == [0.5, 0.5]
    # 1F1B keeps P - p microbatches' activations on stage p where GPipe keeps all M
    (memory,) = results["memory"]
    m = memory["microbatches"]
    assert memory["ratio_per_stage"] == pytest.approx([2 / m, 1 / m], abs=0.02)
    pp = next(r for r in results["rows"] if r["case"] == "pp2 1f1b")
    assert [b["stage"] for b in pp["bubbles"]] == [0, 1]
    assert all(0 <= b["measured"] < 1 for b in pp["bubbles"])
    trace = json.loads((tmp_path / "timeline" / "pp2_1f1b.json").read_text())
    forwards = [e for e in trace["traceEvents"] if e.get("cat") == "forward"]
    assert sorted({e["pid"] for e in forwards}) == [0, 1] and len(forwards) == 2 * m
    assert "| 2 | pp2 1f1b |" in (tmp_path / "bench.md").read_text()
    assert "**ZeRO-1**" in (tmp_path / "bench.md").read_text()
    # grouped vs loop experts beside the dispatch micro-benchmark (issue 19)
    assert [r["experts"] for r in results["experts"]] == [8, 64]
    assert all(r["loop_fwd_bwd_ms"] > 0 for r in results["experts"])
    assert "**Grouped vs loop experts**" in (tmp_path / "bench.md").read_text()
    # ZeRO-2: each rank keeps half the grads after the step, and half the optimizer state
    z2 = zero["zero2"]
    assert z2["grads_ratio_per_rank"] == pytest.approx([0.5, 0.5], rel=0.05) and z2["grads_met"]
    assert zero["mb"]["titan_zero2"]["optimizer"] == pytest.approx(
        zero["mb"]["titan_zero1"]["optimizer"]
    )
    assert "**ZeRO-2**" in (tmp_path / "bench.md").read_text()
    _check_tp_state(results, (tmp_path / "bench.md").read_text())
    # ZeRO-3: each rank holds half the parameters, grads and optimizer state between steps, as
    # FSDP2's ZeRO-3 does; in the step the rows plus what is gathered (the rest of the stage and
    # two blocks: more than zero=2's whole model on this tiny model, whose embedding and head
    # dominate), FSDP2 one block fewer, it prefetches none here; every block's gather was in
    # flight but the backward's first, the last block kept from its forward (4 blocks, one
    # microbatch a step: 4 + 3 prefetched a step, 1 kept)
    (z3,) = results["zero3"]
    assert z3["case"] == "dp2" and z3["memory_met"]
    for kind in ("params", "grads", "optimizer"):
        assert z3["parts"][kind]["ratio_per_rank"] == pytest.approx([0.5, 0.5], rel=0.05), kind
        assert z3["mb"]["fsdp2_zero3"][kind] == pytest.approx(z3["mb"]["titan_zero3"][kind], 0.05)
    peaks = z3["param_peak_mb"]
    assert peaks["titan_zero2"] == pytest.approx(z3["mb"]["titan"]["params"])
    assert z3["mb"]["titan_zero3"]["params"] < peaks["fsdp2_zero3"] < peaks["titan_zero3"]
    gathers = z3["block_gathers"]
    assert gathers["wasted"] == gathers["gathered"] == 0
    assert gathers["prefetched"] == 7 * gathers["kept"] > 0
    assert z3["peer"]["step_ratio"] > 0 and z3["zero2"]["step_ratio"] > 0
    assert "**ZeRO-3**" in (tmp_path / "bench.md").read_text()
    # titan plan's state model predicts every rank's measured state of every case and zero level
    config = ModelConfig(**results["settings"]["config"])
    for row in results["rows"]:
        degrees = {axis: row[axis] for axis in ("dp", "pp", "ep", "cp", "tp")}
        for impl, level in (
            ("titan", 0),
            ("titan_zero1", 1),
            ("titan_zero2", 2),
            ("titan_zero3", 3),
        ):
            if impl in row["impls"]:
                measured = row["impls"][impl]["state_bytes_per_rank"]
                assert layout_state(config, degrees, level) == measured, (row["case"], impl)
    # CP: each rank saves its positions' activations (about half of DP's, whose ranks hold the
    # same weights and half the batch: the same tokens per rank), plus the gathered keys and values
    (cp,) = results["cp"]
    dp2 = next(r for r in results["rows"] if r["case"] == "dp2")
    assert cp["case"] == "cp2" and cp["saved_mb"] > 0
    assert 0.9 < cp["vs_dp"]["saved_mb"] < 1.3, cp
    assert cp["saved_mb"] < 1.3 * dp2["saved_peak_mb"]
    # the K/V exchange is timed (its own span kind), and only where there is one; TP's sequence
    # collectives likewise
    assert 0 < cp["kv_ms"] < cp["step_split_ms"]
    times = {r["case"]: r["time_ms"] for r in results["rows"]}
    assert times["tp2"]["tp"] > 0 == times["tp2"]["cp"] == times["dp2"]["tp"] == times["cp2"]["tp"]
    assert "**Context parallelism**" in (tmp_path / "bench.md").read_text()


def _check_tp_state(results, table):
    """tp2 of the quick model (d=32, 4 layers, 4 heads, 8 experts, vocabulary 257), by hand: a rank
    holds half of each attention (4 x 4 x 32 x 32 / 2) and 258 / 2 = 129 padded rows of the
    embedding and of the head; norms (2 per layer + the final one), routers and experts whole."""
    tp = next(r for r in results["rows"] if r["case"] == "tp2")
    attention, vocab_rows, whole = 4 * 4 * 32 * 32, 2 * 32, 4 * (2 * 32 + 32 * 8) + 32
    cut_full = attention + 257 * vocab_rows
    cut_ours = attention // 2 + 129 * vocab_rows  # both ranks: 129 rows, the last one padding
    state = tp["state"]
    assert state["tp_cut_share"] == [cut_ours / cut_full] * 2 == state["expected_tp_cut_share"]
    assert state["tp_whole_share"] == [1.0, 1.0] and state["expert_share"] == [1.0, 1.0]
    for s in tp["impls"]["titan"]["state_bytes_per_rank"]:
        assert s["non_expert_params"] == 4 * (cut_ours + whole)  # fp32
        assert s["non_expert_optimizer"] == 2 * s["non_expert_params"]  # AdamW's two moments
    # torch's DTensor cuts 257 rows 129 / 128 and counts its local shards
    peer = tp["impls"]["torch_tp"]["tp_cut_share"]
    assert peer == [cut_ours / cut_full, (attention // 2 + 128 * vocab_rows) / cut_full]
    (entry,) = results["tp"]
    assert entry["case"] == "tp2" and entry["peer"]["ours_over_peer"]["step_ms"] > 0
    assert "**Tensor parallelism**" in table and "| 2 | tp2 |" in table


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_callbacks_under_titan_fit_write_the_timeline_and_log_expert_load(tmp_path):
    """PipelineTimeline and ExpertLoad added from the command line to a pp=2 run: every rank makes the
    same collectives and logs the same keys (a mismatch would hang), rank 0 writes the files."""
    import csv
    import os
    import subprocess
    import sys
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "configs" / "pp.yaml"
    cmd = [sys.executable, "-m", "lightning_titan", "fit", "--config", str(config),
           "--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
           "--trainer.callbacks+=lightning_titan.lightning.callbacks.PipelineTimeline",
           "--trainer.callbacks.steps=[2]", "--trainer.callbacks.out_dir=tl",
           "--trainer.callbacks+=lightning_titan.lightning.callbacks.ExpertLoad",
           "--trainer.callbacks.plot_path=expert_load.png"]  # fmt: skip
    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "stage 1: bubble measured" in proc.stdout + proc.stderr
    # relative paths are inside the run's log folder, beside metrics.csv, not in the working directory
    run = tmp_path / "runs" / "pp" / "version_0"
    assert not (tmp_path / "tl").exists() and not (tmp_path / "expert_load.png").exists()
    trace = json.loads((run / "tl" / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):  # configs/pp.yaml: M = 4
        names = [e["cat"] for e in spans if e["pid"] == rank]
        assert names.count("forward") == 4 and names.count("backward") == 4
        assert "optimizer" in names and "p2p" in names
    bubbles = json.loads((run / "tl" / "bubbles.json").read_text())["bubbles"]
    assert [b["stage"] for b in bubbles] == [0, 1] and bubbles[0]["theory"] == pytest.approx(1 / 5)
    assert (run / "tl" / "timeline.png").stat().st_size > 0
    assert (run / "expert_load.png").stat().st_size > 0
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    logged = [r for r in rows if r.get("expert_load/layer0/expert0")]
    assert len(logged) == 4
    for row in logged:
        for layer in range(4):  # layers 0-1 live on rank 0, 2-3 on rank 1: all are in rank 0's log
            shares = [float(row[f"expert_load/layer{layer}/expert{e}"]) for e in range(8)]
            assert sum(shares) == pytest.approx(1.0)
            assert float(row[f"expert_load/layer{layer}/max_over_mean"]) == pytest.approx(
                max(shares) * 8
            )
    assert any(r.get("timeline/bubble_stage1") for r in rows)


def test_bench_routing_writes_the_three_tables(tmp_path):
    """``titan bench --routing`` at a tiny size, in process: grouped vs loop experts (equal outputs,
    checked inside), FLOP/s against the probe, and max/mean load of the three balancing choices."""
    from lightning_titan.tools.bench import routing
    from lightning_titan.tools.bench.suite import main

    argv = ["--routing", "--mfu-d-models", "32", "--balance-steps", "3", "--dispatch-tokens",
            "256", "--out", str(tmp_path)]  # fmt: skip
    results = main(argv)
    assert [r["experts"] for r in results["experts"]] == [8, 64]
    (mfu,) = results["mfu"]
    assert mfu["d_model"] == 32 and 0 < mfu["mfu"] and mfu["peak_gflops_per_s"] > 0
    assert [r["balancing"] for r in results["balance"]] == list(routing.BALANCING)
    for r in results["balance"]:
        assert len(r["mean_all"]) == 4 and all(v >= 1.0 for v in r["mean_all"])
    table = (tmp_path / "routing.md").read_text()
    for title in (
        "**Grouped vs loop experts**",
        "**Single-rank training FLOP/s",
        "**Load balance**",
    ):
        assert title in table
    assert "| bias alone |" in table and json.loads((tmp_path / "routing.json").read_text())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--worlds", "3"], "no default compositions for world sizes [3]"),
        (["--worlds", "2", "--global-batch", "7"], "use a --global-batch divisible by 2"),
        (["--worlds", "2", "--cases", "tp2", "tp4"], "--cases tp4: no such case"),
        (["--device", "cuda", "--worlds", "1"], "sees no CUDA device; use --device cpu"),
    ],
)
def test_bench_rejects_bad_arguments_before_running_anything(tmp_path, capsys, argv, message):
    from lightning_titan.tools.bench import main

    if "cuda" in argv and torch.cuda.is_available():  # a GPU host: ask for more GPUs than it has
        if torch.cuda.device_count() >= 8:
            pytest.skip("8 or more GPUs: every default world size fits")
        argv, message = ["--device", "cuda", "--worlds", "8"], "need that many GPUs"
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--no-dispatch", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


_TP_CONFIG = dict(d_model=32, ffn_dim=32, seq_len=16, z_loss_coef=0.01)


def _torch_tp_grads(rank, world):
    """One step of the torch TP peer with the optimizer left out: its clipped grads, whole."""
    from torch.distributed.tensor import DTensor

    from lightning_titan.parallel.mesh import build_process_groups
    from lightning_titan.tools.bench.torch_tp import TorchTPRunner

    dims = ParallelDims(1, 1, 1, rank, tp=world)
    runner = TorchTPRunner(ModelConfig(**_TP_CONFIG), dims, build_process_groups(dims),
                           torch.device("cpu"), seed=3, lr=1e-3, max_norm=0.5)  # fmt: skip
    runner.optimizer.step = runner.optimizer.zero_grad = lambda *a, **k: None
    tokens = torch.randint(0, 257, (4, 17), generator=torch.Generator().manual_seed(0))
    runner.step(tokens[:, :-1], tokens[:, 1:])
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            for name, p in runner.model.named_parameters()}  # fmt: skip


@pytest.mark.timeout(120)
def test_the_torch_tp_peer_trains_the_one_process_model():
    """The peer is a fair one only if it computes the same step: its clipped grads (the norm bites)
    equal one process's for every parameter, routers and experts (summed over TP by hand), norms
    (left Partial by SequenceParallel) and the vocab-parallel embedding and head included."""
    import torch.nn.functional as F

    from lightning_titan.runtime.launch import run_on_ranks

    per_rank = run_on_ranks(_torch_tp_grads, 2, timeout_s=100, start_method="fork")
    model = StageModel(ModelConfig(**_TP_CONFIG))
    model.init_weights(3)
    tokens = torch.randint(0, 257, (4, 17), generator=torch.Generator().manual_seed(0))
    logits, aux = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + aux.mean()
    loss.backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5) > 0.5  # clipping bites
    for grads in per_rank:
        assert grads.keys() == dict(model.named_parameters()).keys()
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.timeout(120)
def test_collectives_table_times_what_zero_puts_beside_the_all_reduce():
    from lightning_titan.tools.bench import collectives

    (row,) = collectives.measure([2], [0.1], repeats=2)
    assert row["world"] == 2 and all(row[k] > 0 for k in collectives.KINDS)
    lines = collectives.markdown([row])
    zero2 = row["both ours"] / row["all_reduce"]
    assert lines[-1].startswith("| 2 | 0.1 |") and lines[-1].endswith(f"| {zero2:.2f}x |")


_PIPE_CONFIG = {"d_model": 32, "ffn_dim": 32, "seq_len": 16, "n_layers": 4}


def _torch_pipe_grads(rank, world, schedule, v):
    """One step of the pipelining peer on pp=world with the optimizer left out: this stage's grads."""
    from lightning_titan.parallel.mesh import build_process_groups
    from lightning_titan.parallel.pipeline.split import StageSplit
    from lightning_titan.tools.bench.runners import TorchPipeRunner

    dims = ParallelDims(1, world, 1, rank)
    runner = TorchPipeRunner(ModelConfig(**_PIPE_CONFIG), dims, build_process_groups(dims),
                             torch.device("cpu"), schedule=schedule, num_microbatches=4,
                             split=StageSplit(v, v_shape=schedule == "zbv"))  # fmt: skip
    runner.optimizer.step = runner.optimizer.zero_grad = lambda *a, **k: None
    tokens = torch.randint(0, 257, (8, 17), generator=torch.Generator().manual_seed(0))
    runner.step(tokens[:, :-1], tokens[:, 1:])
    return {name: p.grad for name, p in runner.model.named_parameters()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)]
)
def test_the_torch_pipelining_peers_train_the_one_process_model(schedule, v):
    """ScheduleInterleaved1F1B over two chunks per rank, ScheduleInterleavedZeroBubble over one and
    ScheduleZBVZeroBubble over the V are fair peers only if they compute the same step: each stage's
    clipped grads equal one process's."""
    import torch.nn.functional as F

    from lightning_titan.runtime.launch import run_on_ranks
    from lightning_titan.tools.bench.runners import MAX_NORM, SEED

    per_rank = run_on_ranks(_torch_pipe_grads, 2, schedule, v, timeout_s=100, start_method="fork")
    model = StageModel(ModelConfig(**_PIPE_CONFIG))
    model.init_weights(SEED)
    tokens = torch.randint(0, 257, (8, 17), generator=torch.Generator().manual_seed(0))
    logits, aux = model(tokens[:, :-1])
    (F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + aux.mean()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    grads = {name: g for rank_grads in per_rank for name, g in rank_grads.items()}
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow  # as the quick run above
def test_bench_schedules_runs_end_to_end_and_reports_each_schedule(tmp_path):
    """``titan bench --schedules --quick``: pp2 under 1F1B, interleaved 1F1B (v=2), ZB-H1, ZBV (each
    beside torch's) and the auto split, 8 layers; the table's columns, the checks and the timelines.
    Activations are deterministic: the measured peak per stage is the schedule's theory."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "lightning_titan", "bench", "--schedules", "--quick", "--out",
           str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "bench.json").read_text())
    rows = {s["case"]: s for s in results["schedules"]}
    assert list(rows) == [
        "pp2 1f1b", "pp2 interleaved_1f1b v2", "pp2 zb_h1", "pp2 zbv", "pp2 1f1b auto",
    ]  # fmt: skip
    assert rows["pp2 interleaved_1f1b v2"]["stage_layers"] == [2, 2, 2, 2]
    assert sum(rows["pp2 1f1b auto"]["stage_layers"]) == 8
    for name, s in rows.items():
        assert len(s["measured"]) == len(s["replay"]) == len(s["uneven"]) == 2
        assert (s["ratio"] is None) == (name == "pp2 1f1b auto") and s["step_ms"] > 0
        assert s["saved_mb"] == pytest.approx(s["theory_saved_mb"], rel=0.05), name
        assert (tmp_path / "timeline" / f"{name.replace(' ', '_')}.png").stat().st_size > 0
    m = rows["pp2 1f1b"]["microbatches"]
    assert rows["pp2 interleaved_1f1b v2"]["theory"] == pytest.approx(1 / (2 * m + 1))
    assert rows["pp2 1f1b"]["live"] == [2, 1] and rows["pp2 zb_h1"]["live"] == [2, 2]
    # ZBV: 2P chunk-microbatches (P whole stages, 1F1B's peak) on both ranks, its ideal bubble the least
    assert m >= 3 and rows["pp2 zbv"]["live"] == [4, 4]
    assert rows["pp2 zbv"]["theory"] < rows["pp2 zb_h1"]["theory"]
    checks = {(c["case"], c["check"].split()[0]) for c in results["schedule_checks"]}
    assert ("pp2 zb_h1", "median-length") in checks and ("pp2 1f1b auto", "uneven-stage") in checks
    assert ("pp2 zbv", "median-length") in checks
    assert "**Schedules**" in (tmp_path / "bench.md").read_text()


def test_zero_bubble_theory_is_the_ideal_replay_of_the_zb_h1_order():
    """The bubble's theory under ZB-H1 (W spans apart from B) is (P-1)/(3M+P-1): what its own order
    gives with F = B = W and free transfers; the timeline says which formula it used."""
    from lightning_titan.lightning.callbacks import _theory_label
    from lightning_titan.parallel.pipeline.theory import ideal_spans

    for pp, m in ((2, 4), (4, 8)):
        bubbles = tracing.measure_bubbles(ideal_spans("zb_h1", pp, 1, m), [list(range(pp))])
        assert all(b.split_backward for b in bubbles)
        assert bubbles[0].theory == pytest.approx((pp - 1) / (3 * m + pp - 1))
        assert max(b.measured for b in bubbles) == pytest.approx(bubbles[0].theory, abs=1e-6)
        assert "(P-1)/(3M+P-1)" in _theory_label(asdict(bubbles[0]))
    plain = tracing.measure_bubbles(ideal_spans("1f1b", 2, 1, 4), [[0, 1]])
    assert not plain[0].split_backward and plain[0].theory == pytest.approx(1 / 5)


@pytest.mark.parametrize(
    "pp,split",
    [(2, StageSplit()), (2, StageSplit(1, (3, 1))), (4, StageSplit(1, (0, 2, 2, 0))),
     (2, StageSplit(2)), (2, StageSplit(2, None, v_shape=True))],
)  # fmt: skip
def test_the_state_tables_expected_shares_follow_the_split(pp, split):
    """Per rank, the arithmetic the state table prints beside the measured shares, against the
    parameters a stage model of that split holds: uneven, interleaved and the V (rank 0 holds the
    embedding and the head) included."""
    from lightning_titan.model.grad_kinds import split_expert_parameters
    from lightning_titan.tools.bench.memory import tp_cut_bytes
    from lightning_titan.tools.bench.tp_report import expected_tp_shares

    config = ModelConfig(vocab_size=37, d_model=16, n_layers=4, n_heads=2, ffn_dim=16,
                         n_experts=4, top_k=2, seq_len=8)  # fmt: skip

    def cut_and_whole(model):
        non_expert = sum(p.numel() * p.element_size() for _, p in split_expert_parameters(model)[1])
        cut = tp_cut_bytes(model)
        return cut, non_expert - cut

    full_cut, full_whole = cut_and_whole(StageModel(config))
    for rank in range(pp):
        cut, whole = cut_and_whole(StageModel(config, pp_rank=rank, pp=pp, split=split))
        expected = expected_tp_shares(config, pp, 1, rank, split)
        assert expected == pytest.approx((cut / full_cut, whole / full_whole)), (rank, split)


def test_split_cost_times_a_whole_backward_and_both_halves():
    from lightning_titan.tools.bench.split_cost import measure

    r = measure(32, n_layers=2, batch=1, repeats=2)
    assert set(r) == {"F", "whole", "B", "W", "ratio"} and all(v > 0 for v in r.values())
    assert r["ratio"] == (r["B"] + r["W"]) / r["whole"]
    first = measure(32, n_layers=2, batch=1, repeats=2, pp_rank=0)  # the embedding: B is empty
    assert first["B"] < first["W"] and first["F"] > 0


def test_the_split_cost_replay_gives_the_theory_with_ideal_lengths_and_charges_the_split():
    """With F 1, a whole backward 2 and B = W = 1 on both stages the replay is the theory
    (1/(M+1) for 1F1B, 1/(3M+1) for ZB-H1 on pp2); a split that costs more than the whole backward
    lengthens ZB-H1's step, and the free-split row takes that cost back out."""
    from lightning_titan.tools.bench.split_cost import replay

    ideal = {"F": 1.0, "whole": 2.0, "B": 1.0, "W": 1.0}
    rows = replay([ideal, ideal], m=8)
    assert max(rows["1f1b"][1]) == pytest.approx(1 / 9, abs=1e-6)
    assert max(rows["zb_h1"][1]) == pytest.approx(1 / 25, abs=1e-6)
    assert _same_row(rows["zb_h1, free split"], rows["zb_h1"])
    assert rows["zb_h1"][0] < rows["1f1b"][0]
    costly = dict(ideal, W=2.0)  # the split costs 1.5x the whole backward on both stages
    slow = replay([costly, costly], m=8)
    assert slow["zb_h1"][0] > rows["zb_h1"][0] and _same_row(slow["1f1b"], rows["1f1b"])
    assert _same_row(slow["zb_h1, free split"], rows["zb_h1"])


def _same_row(a, b) -> bool:
    """(step time, [bubble per stage]) rows equal within float tolerance (pytest >= 9.2's approx
    takes no nested sequences)."""
    return a[0] == pytest.approx(b[0]) and list(a[1]) == pytest.approx(list(b[1]))
