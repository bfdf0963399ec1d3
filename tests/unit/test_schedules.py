"""Schedules without processes: each stage runs in a thread over rendezvous channels (a send completes
only when the peer receives it, the strictest transport), so a deadlock or a mismatched message fails the
test, and every stage's compute order is checked against the textbook order.

Interleaved 1F1B (v chunks per rank, the ring of ranks) runs over ONE channel per ordered pair of ranks
for both streams (what NCCL gives: messages matched by order, not by tag), so activations and grads
between the same two ranks must also come in the order the receiver takes them."""

import queue
import threading

import pytest

from lightning_titan.parallel.pipeline import interleaved, zbv
from lightning_titan.parallel.pipeline.interleaved import interleaved_1f1b, interleaved_forward_only
from lightning_titan.parallel.pipeline.schedules import (
    forward_only,
    get_schedule,
    gpipe,
    one_f_one_b,
    zb_h1,
)

TIMEOUT = 10.0


class Network:
    def __init__(self):
        self.channels = {}
        self.lock = threading.Lock()

    def channel(self, src, dst):
        with self.lock:
            return self.channels.setdefault((src, dst), queue.Queue())

    def post_send(self, src, dst, payload):
        done = threading.Event()
        self.channel(src, dst).put((payload, done))
        return done

    def recv(self, src, dst):
        payload, done = self.channel(src, dst).get(timeout=TIMEOUT)
        done.set()
        return payload


class FakeStage:
    """Records compute order; payloads name (kind, microbatch) so a mismatch is caught at the receiver."""

    def __init__(self, net, pp, pp_rank):
        self.net, self.pp, self.pp_rank = net, pp, pp_rank
        self.order = []

    def _send(self, dst, payload):
        if 0 <= dst < self.pp:
            assert self.net.post_send(self.pp_rank, dst, payload).wait(TIMEOUT), (
                f"send {payload} hung"
            )

    def _recv(self, src, expected):
        if 0 <= src < self.pp:
            got = self.net.recv(src, self.pp_rank)
            assert got == expected, f"stage {self.pp_rank} expected {expected}, got {got}"
            return got
        return None

    def _pair(self, dst, payload, expected):
        if not 0 <= dst < self.pp:
            return None
        done = self.net.post_send(self.pp_rank, dst, payload)
        got = self.net.recv(dst, self.pp_rank)
        assert got == expected, f"stage {self.pp_rank} expected {expected}, got {got}"
        assert done.wait(TIMEOUT)
        return got

    def forward(self, i, x):
        self.order.append(("F", i))
        return ("act", i)

    def backward(self, i, g):
        self.order.append(("B", i))
        return ("grad", i)

    def backward_input(self, i, g):
        self.order.append(("B", i))
        return ("grad", i)

    def backward_weight(self, i):
        assert ("B", i) in self.order, f"stage {self.pp_rank}: W{i} before B{i}"
        assert ("W", i) not in self.order, f"stage {self.pp_rank}: W{i} twice"
        self.order.append(("W", i))

    def recv_forward(self, i):
        return self._recv(self.pp_rank - 1, ("act", i))

    def send_forward(self, i, y):
        self._send(self.pp_rank + 1, ("act", i))

    def recv_backward(self, i):
        return self._recv(self.pp_rank + 1, ("grad", i))

    def send_backward(self, i, dx):
        self._send(self.pp_rank - 1, ("grad", i))

    def send_forward_recv_backward(self, i, y, j):
        return self._pair(self.pp_rank + 1, ("act", i), ("grad", j))

    def send_backward_recv_forward(self, j, dx, i):
        return self._pair(self.pp_rank - 1, ("grad", j), ("act", i))


def run_pipeline(schedule, pp, m, make_stage=FakeStage, network=Network):
    net = network()
    stages = [make_stage(net, pp, p) for p in range(pp)]
    errors = []

    def target(stage):
        try:
            schedule(stage, m)
        except BaseException as e:  # noqa: BLE001
            errors.append((stage.pp_rank, repr(e)))

    threads = [threading.Thread(target=target, args=(s,), daemon=True) for s in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 3)
    assert not any(t.is_alive() for t in threads), f"{schedule.__name__} P={pp} M={m} deadlocked"
    assert not errors, errors
    assert all(q.empty() for q in net.channels.values()), "a message was sent but never received"
    return [s.order for s in stages]


def expected_1f1b(pp, p, m):
    warmup = min(m, pp - p - 1)
    order = [("F", i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", j) for j in range(m - warmup, m)]


GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]


@pytest.mark.parametrize("pp,m", GRID)
def test_gpipe_order(pp, m):
    for order in run_pipeline(gpipe, pp, m):
        assert order == [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


@pytest.mark.parametrize("pp,m", GRID)
def test_1f1b_order(pp, m):
    for p, order in enumerate(run_pipeline(one_f_one_b, pp, m)):
        assert order == expected_1f1b(pp, p, m)


@pytest.mark.parametrize("pp,m", [(4, 8), (8, 16), (4, 2)])
def test_1f1b_bounds_live_microbatches(pp, m):
    for p, order in enumerate(run_pipeline(one_f_one_b, pp, m)):
        live = peak = 0
        for kind, _ in order:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(m, pp - p)


def expected_zb_h1(pp, p, m):
    """1F1B's F and B order; stage p runs W of microbatch j after B of microbatch j + p (the rest at
    the end): the deferred W's fill the cooldown."""
    order = []
    for kind, i in expected_1f1b(pp, p, m):
        order.append((kind, i))
        if kind == "B" and i >= p:
            order.append(("W", i - p))
    return order + [("W", j) for j in range(max(0, m - p), m)]


@pytest.mark.parametrize("pp,m", [(p, m) for p in (1, 2, 3, 4) for m in range(1, 17)])
def test_zb_h1_order_and_live_microbatches(pp, m):
    for p, order in enumerate(run_pipeline(zb_h1, pp, m)):
        assert order == expected_zb_h1(pp, p, m)
        live = peak = 0  # a microbatch's activations live from its F until its W
        for kind, _ in order:
            live += {"F": 1, "B": 0, "W": -1}[kind]
            peak = max(peak, live)
        assert peak == min(m, pp), (p, peak)  # 1F1B's peak (stage 0's), on every stage
        assert [i for kind, i in order if kind == "W"] == list(range(m))


@pytest.mark.parametrize("pp,m", [(1, 3), (4, 2), (4, 6)])
def test_forward_only(pp, m):
    for order in run_pipeline(forward_only, pp, m):
        assert order == [("F", i) for i in range(m)]


def test_unknown_schedule_names_choices():
    with pytest.raises(ValueError, match="'zigzag'.*1f1b.*gpipe"):
        get_schedule("zigzag")


class ChunkedFakeStage:
    """A rank holding ``v`` chunks (virtual stage s = chunk s // pp of rank s % pp). Payloads name the
    receiver's (kind, chunk, microbatch); each receive is checked against the next entry of its stream
    (``interleaved.stream_ids``, which the real stage files received tensors by), and every forward and
    backward against what it needs to have received."""

    def __init__(self, net, pp, pp_rank, v, m):
        self.net, self.pp, self.pp_rank, self.num_chunks = net, pp, pp_rank, v
        acts, grads = interleaved.stream_ids(pp, pp_rank, v, m)
        self.streams = {"act": iter(acts), "grad": iter(grads)}
        self.received, self.order = set(), []

    def forward_chunk(self, chunk, i):
        if interleaved.has_prev(self.pp_rank, chunk):
            assert ("act", chunk, i) in self.received, (
                f"{self.pp_rank}: F{chunk},{i} before its input"
            )
        self.order.append(("F", chunk, i))

    def backward_chunk(self, chunk, i):
        assert ("F", chunk, i) in self.order, f"{self.pp_rank}: B{chunk},{i} before its forward"
        if interleaved.has_next(self.pp, self.pp_rank, self.num_chunks, chunk):
            assert ("grad", chunk, i) in self.received, (
                f"{self.pp_rank}: B{chunk},{i} before its grad"
            )
        self.order.append(("B", chunk, i))

    def exchange(
        self, send_forward=None, send_backward=None, recv_forward=False, recv_backward=False
    ):
        pp, p, v = self.pp, self.pp_rank, self.num_chunks
        sends = []
        if send_forward is not None and interleaved.has_next(pp, p, v, send_forward[0]):
            chunk, i = send_forward  # the last rank's chunk c feeds the first rank's chunk c + 1
            sends.append(((p + 1) % pp, ("act", chunk + (p == pp - 1), i)))
        if send_backward is not None and interleaved.has_prev(p, send_backward[0]):
            chunk, i = send_backward
            sends.append(((p - 1) % pp, ("grad", chunk - (p == 0), i)))
        done = [self.net.post_send(p, dst, payload) for dst, payload in sends]
        for kind, src, asked in (
            ("act", (p - 1) % pp, recv_forward),
            ("grad", (p + 1) % pp, recv_backward),
        ):
            if asked:
                got, want = self.net.recv(src, p), (kind, *next(self.streams[kind]))
                assert got == want, f"stage {p} expected {want}, got {got}"
                self.received.add(got)
        assert all(d.wait(TIMEOUT) for d in done), f"stage {p}: a send of {sends} hung"


def megatron_order(pp, p, v, m):
    """Megatron-LM's interleaved order: forwards in groups of pp microbatches chunk by chunk, backwards
    with the chunks reversed; (pp - p - 1) * 2 + (v - 1) * pp warmup forwards, then 1F1B."""

    def forward_id(k):
        group, r = divmod(k, pp * v)
        return r // pp, group * pp + r % pp

    total = v * m
    warmup = min(total, (pp - p - 1) * 2 + (v - 1) * pp)
    order = [("F", *forward_id(k)) for k in range(warmup)]
    for k in range(total - warmup):
        chunk, i = forward_id(k)
        order += [("F", *forward_id(warmup + k)), ("B", v - 1 - chunk, i)]
    for k in range(total - warmup, total):
        chunk, i = forward_id(k)
        order.append(("B", v - 1 - chunk, i))
    return order


INTERLEAVED_GRID = [(p, v, m) for p in (2, 3, 4) for v in (2, 3) for m in range(1, 17)]


@pytest.mark.parametrize("pp,v,m", INTERLEAVED_GRID)
def test_interleaved_1f1b_order_messages_and_live_activations(pp, v, m):
    def make(net, pp_, p):
        return ChunkedFakeStage(net, pp_, p, v, m)

    if m % pp:
        with pytest.raises(
            AssertionError, match=rf"num_microbatches={m} does not work.*multiple of {pp}"
        ):
            run_pipeline(interleaved_1f1b, pp, m, make)
        return
    for p, order in enumerate(run_pipeline(interleaved_1f1b, pp, m, make)):
        assert order == megatron_order(pp, p, v, m)
        live = peak = 0
        for kind, *_ in order:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        # the bound, in chunk-microbatches (each 1/v of a stage's activations)
        assert peak == min(v * m, (pp - p - 1) * 2 + (v - 1) * pp + 1), (p, peak)


class CpuChunkedFakeStage(ChunkedFakeStage):
    """What PipelineStage runs on CPU (``StageLinks.early``): a chunk's output and input grad go out
    when the chunk makes them and no send waits (gloo's isend, the receive posted ahead), one channel
    per stream (gloo matches by tag); ``exchange`` only marks receives due, and a chunk takes the due
    messages of its stream when it needs its input. A take waits for a message the peer sends
    without waiting for anything but its own takes: a cycle of those deadlocks the test."""

    def __init__(self, net, pp, pp_rank, v, m):
        super().__init__(net, pp, pp_rank, v, m)
        self.due = {"act": 0, "grad": 0}

    def _take_until(self, kind, chunk, i):
        src = (self.pp_rank + (-1 if kind == "act" else 1)) % self.pp
        while (kind, chunk, i) not in self.received and self.due[kind]:
            self.due[kind] -= 1
            got, want = self.net.recv((src, kind), self.pp_rank), (kind, *next(self.streams[kind]))
            assert got == want, f"stage {self.pp_rank} expected {want}, got {got}"
            self.received.add(got)

    def forward_chunk(self, chunk, i):
        pp, p, v = self.pp, self.pp_rank, self.num_chunks
        if interleaved.has_prev(p, chunk):
            self._take_until("act", chunk, i)
        super().forward_chunk(chunk, i)
        if interleaved.has_next(pp, p, v, chunk):
            self.net.post_send((p, "act"), (p + 1) % pp, ("act", chunk + (p == pp - 1), i))

    def backward_chunk(self, chunk, i):
        pp, p, v = self.pp, self.pp_rank, self.num_chunks
        if interleaved.has_next(pp, p, v, chunk):
            self._take_until("grad", chunk, i)
        super().backward_chunk(chunk, i)
        if interleaved.has_prev(p, chunk):
            self.net.post_send((p, "grad"), (p - 1) % pp, ("grad", chunk - (p == 0), i))

    def exchange(
        self, send_forward=None, send_backward=None, recv_forward=False, recv_backward=False
    ):
        self.due["act"] += recv_forward
        self.due["grad"] += recv_backward


@pytest.mark.parametrize("pp,v,m", [c for c in INTERLEAVED_GRID if c[2] % c[0] == 0])
def test_interleaved_1f1b_on_the_cpu_transport(pp, v, m):
    """Sent at once, taken when needed: no deadlock, every message matched and taken in the step,
    the same compute order."""

    stages = []

    def make(net, pp_, p):
        stages.append(CpuChunkedFakeStage(net, pp_, p, v, m))
        return stages[-1]

    for p, order in enumerate(run_pipeline(interleaved_1f1b, pp, m, make)):
        assert order == megatron_order(pp, p, v, m)
    assert all(s.due == {"act": 0, "grad": 0} for s in stages)


@pytest.mark.parametrize("pp,v,m", [(2, 2, 2), (3, 2, 6), (4, 3, 8), (4, 2, 4)])
def test_interleaved_forward_only(pp, v, m):
    def make(net, pp_, p):
        return ChunkedFakeStage(net, pp_, p, v, m)

    for p, order in enumerate(run_pipeline(interleaved_forward_only, pp, m, make)):
        assert order == [o for o in megatron_order(pp, p, v, m) if o[0] == "F"]


def test_interleaved_needs_chunks_and_stages():
    with pytest.raises(ValueError, match=r"needs virtual_stages >= 2 \(got 1\)"):
        interleaved.check_microbatches(2, 1, 4)
    with pytest.raises(ValueError, match=r"needs pp >= 2"):
        interleaved.check_microbatches(1, 2, 4)
    with pytest.raises(
        ValueError,
        match=r"num_microbatches=6 does not work; use a multiple of 4 "
        r"\(M = 4, 8, 12, ...\)",
    ):
        interleaved.check_microbatches(4, 2, 6)


class PostedNetwork(Network):
    """Channels whose receiver has the receive of the next message posted as soon as it took the one
    before (``StageLinks`` on CPU): a send completes once every earlier message of its channel was
    taken, not only when the receiver needs it."""

    def __init__(self):
        super().__init__()
        self.sent, self.taken, self.done = {}, {}, {}

    def post_send(self, src, dst, payload):
        done = threading.Event()
        with self.lock:
            index = self.sent.get((src, dst), 0)
            self.sent[src, dst] = index + 1
            self.done[src, dst, index] = done
            if self.taken.get((src, dst), 0) >= index:
                done.set()
        self.channel(src, dst).put((payload, threading.Event()))
        return done

    def recv(self, src, dst):
        payload, _ = self.channel(src, dst).get(timeout=TIMEOUT)
        with self.lock:
            taken = self.taken[src, dst] = self.taken.get((src, dst), 0) + 1
            if (src, dst, taken) in self.done:
                self.done[src, dst, taken].set()
        return payload


class ZbvFakeStage:
    """A rank of the V (chunk 0 = virtual stage r, chunk 1 = virtual stage 2P-1-r) over one channel per
    ordered pair of ranks: every received message is checked against what the action list says comes
    next from that peer, and every action against what it needs (its input received, or on the last
    rank handed over by its other chunk; its B before its W)."""

    def __init__(self, net, pp, pp_rank, m):
        self.net, self.pp, self.pp_rank, self.m = net, pp, pp_rank, m
        self.received, self.order = set(), []
        self.in_flight = None

    def _ready(self, action):
        need = zbv.needs(self.pp, self.pp_rank, action)
        assert need is None or need[1] in self.received, f"{self.pp_rank}: {action} before {need}"

    def forward_chunk(self, chunk, i):
        self._ready(("F", chunk, i))
        if chunk == 1 and self.pp_rank == self.pp - 1:  # the turn of the V stays on the rank
            assert ("F", 0, i) in self.order, f"last rank: F1,{i} before F0,{i}"
        self.order.append(("F", chunk, i))

    def backward_input_chunk(self, chunk, i):
        assert ("F", chunk, i) in self.order, f"{self.pp_rank}: B{chunk},{i} before its forward"
        self._ready(("B", chunk, i))
        if chunk == 0 and self.pp_rank == self.pp - 1:
            assert ("B", 1, i) in self.order, f"last rank: B0,{i} before B1,{i}"
        self.order.append(("B", chunk, i))

    def backward_weight_chunk(self, chunk, i):
        assert ("B", chunk, i) in self.order, f"{self.pp_rank}: W{chunk},{i} before its B"
        assert ("W", chunk, i) not in self.order, f"{self.pp_rank}: W{chunk},{i} twice"
        self.order.append(("W", chunk, i))

    def backward_chunk(self, chunk, i):  # dualpipev's BW: B and W at once
        self.backward_input_chunk(chunk, i)
        self.backward_weight_chunk(chunk, i)

    def overlap_chunks(self, f, b):
        """dualpipev's pair: both inputs are in before either half runs (they run interleaved, the
        backward first: it frees faster than the forward saves, so it counts first)."""
        self._ready(("F", *f))
        self._ready(("B", *b))
        assert f[0] != b[0], f"{self.pp_rank}: a pair within one chunk {f} {b}"
        self.backward_chunk(*b)
        self.forward_chunk(*f)

    def exchange_messages(self, done, take):
        """As ``StageLinks`` on CPU: a send waits for the one before it, then goes out; the receives
        are taken after it."""
        p = self.pp_rank
        for out in (zbv.output(self.pp, p, a) for a in done or ()):
            if out is None:
                continue
            self.finish()
            self.in_flight = (out, self.net.post_send(p, *out))
        for peer, want in take:
            got = self.net.recv(peer, p)
            assert got == want, f"stage {p} expected {want} from {peer}, got {got}"
            self.received.add(got)

    def finish(self):
        if self.in_flight is not None:
            out, done = self.in_flight
            assert done.wait(TIMEOUT), f"stage {self.pp_rank}: the send of {out} hung"
        self.in_flight = None


def live_peak(order):
    """Chunk-microbatches whose activations are live (F run, W not yet), at the most."""
    live = peak = 0
    for kind, *_ in order:
        live += {"F": 1, "B": 0, "W": -1}[kind]
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("pp,m", [(p, m) for p in (2, 3, 4) for m in range(1, 17)])
def test_zbv_order_messages_and_live_activations(pp, m):
    def make(net, pp_, p):
        return ZbvFakeStage(net, pp_, p, m)

    def zbv_step(stage, m_):  # the stage's run() waits for the last send after the schedule
        zbv.zbv(stage, m_)
        stage.finish()

    for p, order in enumerate(run_pipeline(zbv_step, pp, m, make, PostedNetwork)):
        assert order == zbv.order(pp, p, m)
        for kind in "FBW":  # every chunk-microbatch once per kind, each chunk's in microbatch order
            for chunk in (0, 1):
                assert [i for k, c, i in order if (k, c) == (kind, chunk)] == list(range(m))
        assert live_peak(order) <= 2 * pp, (p, live_peak(order))  # 1F1B's: P whole stages
    if m >= 2 * pp - 1:  # the V full: rank 0 holds the bound, as 1F1B's stage 0 does
        assert live_peak(zbv.order(pp, 0, m)) == 2 * pp


@pytest.mark.parametrize("pp,m", [(p, m) for p in (2, 3, 4) for m in range(2 * p, 2 * p + 7)])
def test_dualpipev_order_messages_and_live_activations(pp, m):
    """DualPipeV over the fake network: every input in before its tick, each pair a forward of one
    chunk with the whole backward of the other, and 2P chunk-microbatches live on every rank but
    the last, which holds 2P+1 (its first forward of chunk 0 and backward of chunk 1 run apart);
    zbv holds 2P on rank 0."""

    def make(net, pp_, p):
        return ZbvFakeStage(net, pp_, p, m)

    def step(stage, m_):
        zbv.dualpipev(stage, m_)
        stage.finish()

    for p, order in enumerate(run_pipeline(step, pp, m, make, PostedNetwork)):
        for kind in "FBW":
            for chunk in (0, 1):
                assert [i for k, c, i in order if (k, c) == (kind, chunk)] == list(range(m))
        assert live_peak(order) == 2 * pp + (p == pp - 1), (p, live_peak(order))
        ticks = zbv.dualpipev_order(pp, p, m)
        pairs = [t for t in ticks if len(t) == 2]
        assert all(f[0] == "F" and b[0] == "BW" and f[1] != b[1] for f, b in pairs)
        # the steady state: two pairs per microbatch beyond the V's fill, fewer on the last rank
        assert len(pairs) == 2 * (m - 2 * pp + p + 1) + (pp - p - 1) - (p == pp - 1)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_dualpipev_order_is_torchs(pp):
    """The same ticks as torch's ScheduleDualPipeV (its OVERLAP_F_B a pair; its stage r our chunk
    0, its stage 2P-1-r our chunk 1; FULL_BACKWARD our BW, BACKWARD_INPUT our B)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as torch_schedules

    t = torch_schedules
    kinds = {t.FORWARD: "F", t.BACKWARD_INPUT: "B", t.BACKWARD_WEIGHT: "W", t.FULL_BACKWARD: "BW"}
    for m in range(2 * pp, 2 * pp + 6):
        plan = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
        for rank in range(pp):
            theirs = t.ScheduleDualPipeV._calculate_single_rank_operations(plan, rank)

            def ours_of(a, rank=rank):
                return (kinds[a.computation_type], int(a.stage_index != rank), a.microbatch_index)

            expected = [
                tuple(ours_of(s) for s in a.sub_actions)
                if a.computation_type == t.OVERLAP_F_B
                else (ours_of(a),)
                for a in theirs
                if a is not None
            ]
            assert zbv.dualpipev_order(pp, rank, m) == expected, (pp, m, rank)


@pytest.mark.parametrize("pp,m", [(p, m) for p in (2, 3, 4) for m in (1, 2, 5, 8, 13)])
def test_zbv_order_is_torchs(pp, m):
    """The same actions as torch's ScheduleZBVZeroBubble (its order without the idle slots; its
    stage r is our chunk 0, its stage 2P-1-r our chunk 1; its I is our B)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import (
        BACKWARD_INPUT,
        BACKWARD_WEIGHT,
        FORWARD,
        ScheduleZBVZeroBubble,
    )

    plan = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
    for rank in range(pp):
        theirs = ScheduleZBVZeroBubble._calculate_single_rank_operations(plan, rank)
        kinds = {FORWARD: "F", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W"}
        ours = [
            (kinds[a.computation_type], 0 if a.stage_index == rank else 1, a.microbatch_index)
            for a in theirs
            if a is not None
        ]
        assert zbv.order(pp, rank, m) == ours


def test_zbv_options_name_the_fix():
    from lightning_titan.lightning.strategy import TitanStrategy

    assert TitanStrategy(pp=2, schedule="zbv").options.virtual_stages == 2  # the V's two chunks
    with pytest.raises(ValueError, match=r"virtual_stages=1 does not work; use .*virtual_stages=2"):
        TitanStrategy(pp=2, schedule="zbv", virtual_stages=1)
    with pytest.raises(ValueError, match=r"virtual_stages=3 does not work"):
        TitanStrategy(pp=2, schedule="zbv", virtual_stages=3)
    with pytest.raises(ValueError, match=r"needs pp >= 2 \(got pp=1\)"):
        TitanStrategy(pp=1, schedule="zbv", virtual_stages=2)
    with pytest.raises(ValueError, match=r"virtual_stages=2 needs a schedule over several chunks"):
        TitanStrategy(pp=2, schedule="1f1b", virtual_stages=2)
    TitanStrategy(pp=2, schedule="zbv", virtual_stages=2, num_microbatches=1)  # any M >= 1 runs


def test_zbv_v_placement_of_layers():
    from lightning_titan.model.decoder import ModelConfig, StageModel
    from lightning_titan.parallel.pipeline.split import StageSplit

    v = StageSplit(virtual_stages=2, v_shape=True)
    # 8 layers over 2P = 8 chunks on P = 4 ranks: rank r holds layer r and layer 7 - r
    assert [v.chunk_ranges(8, 4, r) for r in range(4)] == [
        [(0, 1), (7, 8)], [(1, 2), (6, 7)], [(2, 3), (5, 6)], [(3, 4), (4, 5)],
    ]  # fmt: skip
    uneven = StageSplit(virtual_stages=2, stage_layers=[0, 2, 3, 1], v_shape=True)
    assert [uneven.chunk_ranges(6, 2, r) for r in range(2)] == [[(0, 0), (5, 6)], [(0, 2), (2, 5)]]
    with pytest.raises(ValueError, match=r"n_layers=6 is not divisible by .* = 8; change n_layers"):
        v.counts(6, 4)
    config = ModelConfig(vocab_size=32, d_model=16, n_layers=4, n_heads=2, n_experts=2, seq_len=8)
    first, last = (StageModel(config, pp=2, pp_rank=r, split=v) for r in (0, 1))
    # rank 0: the embedding (chunk 0) and the head (chunk 1); the last rank neither
    assert first.embeds(0) and first.heads(1) and not (first.embeds(1) or first.heads(0))
    assert hasattr(first, "embed") and hasattr(first, "lm_head")
    assert not (
        hasattr(last, "embed") or hasattr(last, "lm_head") or last.embeds(0) or last.heads(1)
    )
    # global layer names, so a checkpoint of one layout loads in any other
    assert sorted(first.layers) == ["0", "3"] and sorted(last.layers) == ["1", "2"]


class ZbvBatches:
    """A zbv stage that records each exchange as the batch the GPU path posts: (sends, receives),
    each (peer, message)."""

    def __init__(self, pp, pp_rank):
        self.pp, self.pp_rank, self.batches = pp, pp_rank, []

    def forward_chunk(self, chunk, i):
        pass

    backward_input_chunk = backward_weight_chunk = backward_chunk = forward_chunk

    def overlap_chunks(self, f, b):
        pass

    def exchange_messages(self, done, take):
        outs = [out for a in done or () if (out := zbv.output(self.pp, self.pp_rank, a))]
        if outs or take:
            self.batches.append((outs, list(take)))


def nccl_replay(batches, window):
    """Run every rank's batches as NCCL does (one stream per rank: a batch starts when the one before
    it has finished, and ends when each of its messages met the peer's batch that takes or sends
    it, running). The host posts batches in order, waits for each with a receive and, past
    ``window`` send-only batches, for the oldest (``StageLinks``). Returns how far each rank got."""
    pp = len(batches)
    where = {}  # (src, dst, message, "send" | "recv") -> batch index on that side
    for r, mine in enumerate(batches):
        for k, (sends, takes) in enumerate(mine):
            where.update({(r, dst, msg, "send"): k for dst, msg in sends})
            where.update({(src, r, msg, "recv"): k for src, msg in takes})
    issued, head, waits, unwaited = [0] * pp, [0] * pp, [None] * pp, [[] for _ in range(pp)]

    def running(r, k):  # batch k of rank r is running or done
        return head[r] > k or head[r] == k < issued[r]

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while waits[r] is None and issued[r] < len(batches[r]):
                k = issued[r]
                issued[r], progress = k + 1, True
                if batches[r][k][1]:
                    waits[r] = k
                else:
                    unwaited[r].append(k)
                    if len(unwaited[r]) > window:
                        waits[r] = unwaited[r].pop(0)
            while head[r] < issued[r]:
                sends, takes = batches[r][head[r]]
                peers = [(dst, where[r, dst, msg, "recv"]) for dst, msg in sends]
                peers += [(src, where[src, r, msg, "send"]) for src, msg in takes]
                if not all(running(peer, k) for peer, k in peers):
                    break
                head[r], progress = head[r] + 1, True
            if waits[r] is not None and head[r] > waits[r]:
                waits[r], progress = None, True
    return head


@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_zbv_batches_run_under_nccl_ordering(pp):
    """Every message of the V is posted by both ranks in the same step (``zbv.timetable``), so
    NCCL's in-order streams never hold a send whose receive is behind the peer's own send."""
    from lightning_titan.parallel.pipeline.p2p import SENDS_IN_FLIGHT

    runs = [(zbv.zbv, m) for m in range(1, 17)] + [(zbv.zbv_forward_only, m) for m in range(1, 17)]
    runs += [(zbv.dualpipev, m) for m in range(2 * pp, 2 * pp + 9)]
    for schedule, m in runs:
        for train in (schedule is not zbv.zbv_forward_only,):
            ranks = [ZbvBatches(pp, p) for p in range(pp)]
            for stage in ranks:
                schedule(stage, m)
            batches = [s.batches for s in ranks]
            for window in (0, SENDS_IN_FLIGHT):
                got = nccl_replay(batches, window)
                assert got == [len(b) for b in batches], (pp, m, train, window, got)


def test_overlapped_schedules_name_the_fix():
    """Each overlapped schedule says what it needs where it is given: one stage for 1f1b_overlap,
    the V and M >= 2P for dualpipev, ep > 1 for both, and neither activation checkpointing nor
    compile (checked before any rank starts, with the model); by default they get the microbatches
    their pairs need."""
    from dataclasses import replace

    from lightning_titan.lightning.module import TitanLM
    from lightning_titan.lightning.strategy import TitanStrategy
    from lightning_titan.lightning.workload import workload
    from lightning_titan.model.config import ModelConfig
    from lightning_titan.parallel.mesh import ParallelDims
    from lightning_titan.train.options import TrainOptions
    from lightning_titan.train.options import check_overlap as check

    def check_overlap(dims, options, module):  # what the strategy reads of the module, checked
        work = workload(module, None)
        check(dims, options, recompute=work.recompute, compiled=work.compiled)

    with pytest.raises(ValueError, match=r"one stage \(pp=1\), got pp=2.*use schedule='dualpipev'"):
        TitanStrategy(pp=2, ep=2, schedule="1f1b_overlap")
    with pytest.raises(ValueError, match=r"needs num_microbatches >= 4 on pp=2, got 2"):
        TitanStrategy(pp=2, ep=2, schedule="dualpipev", num_microbatches=2)
    with pytest.raises(ValueError, match=r"needs pp >= 2 \(got pp=1\).*schedule='1f1b_overlap'"):
        TitanStrategy(pp=1, ep=2, schedule="dualpipev")
    assert TrainOptions(schedule="dualpipev", virtual_stages=2).microbatches(8, pp=2) == 4
    assert TrainOptions(schedule="1f1b_overlap").microbatches(8, pp=1) == 2
    # the pair's backward runs first and frees faster than its forward saves: 1F1B's one microbatch
    from lightning_titan.parallel.pipeline import theory

    assert theory.live_peak("1f1b_overlap", 1, 0, 1, 4, [1]) == (1, 1)
    assert TitanStrategy(pp=2, ep=2, schedule="dualpipev").options.virtual_stages == 2
    from typing import get_args

    from lightning_titan.parallel.pipeline.schedules import SCHEDULES
    from lightning_titan.train.options import Schedule

    assert set(get_args(Schedule)) == set(SCHEDULES)  # the CLI's choices are every schedule

    config = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_experts=4, vocab_size=64, seq_len=16)
    plain = TitanLM(config)
    options = TrainOptions(schedule="1f1b_overlap")
    check_overlap(ParallelDims(1, 1, 2, 0), options, plain)  # ep=2, eager, no recompute: fine
    with pytest.raises(ValueError, match=r"ep=1 has none; use schedule='1f1b'"):
        check_overlap(ParallelDims(2, 1, 1, 0), options, plain)
    recompute = TitanLM(replace(config, activation_checkpointing=True))
    for module, field in (
        (recompute, "activation_checkpointing"),
        (TitanLM(config, compile=True), "compile"),
    ):
        with pytest.raises(ValueError, match=rf"does not run with {field}=true.*set {field}=false"):
            check_overlap(ParallelDims(1, 1, 2, 0), options, module)
    check_overlap(ParallelDims(2, 1, 1, 0), TrainOptions(), recompute)  # other schedules: no check
