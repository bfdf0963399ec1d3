"""Schedules without processes: each stage runs in a thread over rendezvous channels (a send completes
only when the peer receives it, the strictest transport), so a deadlock or a mismatched message fails the
test, and every stage's compute order is checked against the textbook order."""

import queue
import threading

import pytest

from lightning_titan.pipeline.schedules import forward_only, get_schedule, gpipe, one_f_one_b

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


def run_pipeline(schedule, pp, m):
    net = Network()
    stages = [FakeStage(net, pp, p) for p in range(pp)]
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


@pytest.mark.parametrize("pp,m", [(1, 3), (4, 2), (4, 6)])
def test_forward_only(pp, m):
    for order in run_pipeline(forward_only, pp, m):
        assert order == [("F", i) for i in range(m)]


def test_unknown_schedule_names_choices():
    with pytest.raises(ValueError, match="'zigzag'.*1f1b.*gpipe"):
        get_schedule("zigzag")
