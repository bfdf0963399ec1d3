"""Schedules without processes: each stage runs in a thread over rendezvous channels (a send completes
only when the peer receives it, the strictest transport), so a deadlock or a mismatched message fails the
test, and every stage's compute order is checked against the textbook order.

Interleaved 1F1B (v chunks per rank, the ring of ranks) runs over ONE channel per ordered pair of ranks
for both streams (what NCCL gives: messages matched by order, not by tag), so activations and grads
between the same two ranks must also come in the order the receiver takes them."""

import queue
import threading

import pytest

from lightning_titan.pipeline import interleaved
from lightning_titan.pipeline.interleaved import interleaved_1f1b, interleaved_forward_only
from lightning_titan.pipeline.schedules import forward_only, get_schedule, gpipe, one_f_one_b, zb_h1

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


def run_pipeline(schedule, pp, m, make_stage=FakeStage):
    net = Network()
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
