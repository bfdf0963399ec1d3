"""CPU-side proxies for what would crash, hang or crawl under CUDA/NCCL (issue 22).

No GPU here: each test imitates the CUDA behaviour that matters (a generator must live on the device
it draws on; every device-to-host read is a stream sync; payload dtypes under autocast) on CPU.
"""

from __future__ import annotations

import torch
from host_reads import HostReads, HostToDevice
from torch.overrides import TorchFunctionMode

from lightning_titan.model.decoder import ModelConfig, StageModel

SEED = 1234


def small_config(**overrides) -> ModelConfig:
    base = dict(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, n_experts=8)
    return ModelConfig(**{**base, "seq_len": 16, **overrides})


class GeneratorOnItsDevice(TorchFunctionMode):
    """Raise, as CUDA does, on a random draw whose generator lives on another device than the tensor
    it fills or creates. Enter it *outside* a ``with torch.device(...)`` context, so that it sees the
    device that context adds to factory calls."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        if generator is not None:
            if args and isinstance(args[0], torch.Tensor) and "device" not in kwargs:
                target = args[0].device  # an in-place draw (normal_, uniform_, ...)
            else:
                target = torch.device(kwargs.get("device") or torch.get_default_device())
            if target.type != generator.device.type:
                raise RuntimeError(
                    f"Expected a '{target.type}' device type for generator but found "
                    f"'{generator.device.type}' ({func.__name__})"
                )
        return func(*args, **kwargs)


def test_the_proxy_rejects_a_cpu_generator_under_another_device_context():
    import pytest

    with GeneratorOnItsDevice(), torch.device("meta"):
        with pytest.raises(RuntimeError, match="Expected a 'meta' device type for generator"):
            torch.randn(3, generator=torch.Generator())
        torch.randn(3, generator=torch.Generator(), device="cpu")


def test_init_under_a_device_context_draws_on_cpu_and_equals_the_cpu_init():
    """Lightning runs configure_model under ``with root_device:``; on CUDA a CPU generator must not
    meet a CUDA factory call. Params on CPU, the ambient device another one: values must not change."""
    reference = StageModel(small_config(), pp_rank=1, pp=2, ep_rank=1, ep=2)
    reference.init_weights(SEED)
    with GeneratorOnItsDevice(), torch.device("meta"):
        # built on the context's device (meta: nothing to compare, only no draw may be rejected)
        StageModel(small_config(), pp_rank=0, pp=2).init_weights(SEED)
    stage = StageModel(small_config(), pp_rank=1, pp=2, ep_rank=1, ep=2)
    with GeneratorOnItsDevice(), torch.device("meta"):
        stage.init_weights(SEED)
    want = dict(reference.named_parameters())
    for name, p in stage.named_parameters():
        assert p.device.type == "cpu"
        torch.testing.assert_close(p, want[name], rtol=0, atol=0, msg=name)


# ---- device-to-host reads: each is a stream sync on CUDA ------------------------------------------


# Tensor -> Python reads, and ops whose CUDA kernels read a size or a value back to the host.
def test_the_host_read_counter_sees_python_reads():
    x = torch.ones(3)
    with HostReads() as reads:
        bool(x.sum() > 0), x.tolist(), x[0].item(), torch.bincount(x.long())
        if x[0] == 1:
            pass
    assert reads.calls == ["__bool__", "tolist", "item", "bincount", "__bool__"]


def test_the_host_to_device_counter_sees_copies_and_not_scalar_kernels():
    buffer, host = torch.zeros(8), torch.ones(2)
    with HostToDevice() as copies:
        buffer[3] = 1.0  # a Python scalar by item assignment: lifted, then copied
        torch.tensor([1, 2], device="cpu")
        buffer[:1].fill_(torch.tensor(2.0))
        lifted = torch.tensor([1.0, 2.0])
        buffer[:2].copy_(lifted)
        lifted.to("cpu", torch.float64)
        buffer[3:4].fill_(1.0)  # kernels whose Python scalar is an argument: no copy
        buffer.mul_(0.5), torch.full((2,), 3.0), buffer[:2].copy_(host)
    assert copies.calls == ["lift_fresh", "copy_", "lift_fresh", "lift_fresh", "fill_",
                            "lift_fresh", "copy_", "_to_copy"], copies.calls  # fmt: skip


def test_moe_layer_reads_the_host_once_per_forward_and_never_in_backward():
    """Nor copies anything onto the device: the grouped GEMMs' offsets are the dispatch's counts,
    summed on the device (padded as on CUDA here, the grouped path forced)."""
    from lightning_titan.model.moe.layer import MoELayer

    layer = MoELayer(16, 24, 8, 2)
    x = torch.randn(2, 5, 16, requires_grad=True)
    for grouped in (None, True):
        layer.experts.grouped_mm, layer.experts.align_rows = grouped, 16 if grouped else None
        with HostReads() as reads, HostToDevice() as copies:
            out, aux = layer(x)
            forward = list(reads.calls)
            (out.square().sum() + aux.sum()).backward()
        assert forward == ["tolist"], forward  # the split sizes of the local experts
        assert reads.calls == forward, reads.calls
        assert copies.calls == [], copies.calls


# ---- p2p: wire dtype under autocast, send-only batches not waited at once -------------------------


class _Work:
    def __init__(self, log: list, what: str) -> None:
        self.log, self.what = log, what

    def wait(self) -> bool:
        self.log.append(("wait", self.what))
        return True

    def is_completed(self) -> bool:  # not yet: ``finish`` waits for it
        return False


def _fake_p2p(monkeypatch) -> list:
    """Replace torch.distributed's point-to-point calls by recorders: (call, dtype) and waits."""
    import torch.distributed as dist

    log: list = []

    def isend(tensor, dst, group=None, tag=0):
        log.append(("isend", tensor.dtype))
        return _Work(log, "isend")

    def irecv(tensor, src, group=None, tag=0):
        log.append(("irecv", tensor.dtype))
        return _Work(log, "irecv")

    def batch(ops):
        return [op[0](op[1], op[2]) for op in ops]

    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "irecv", irecv)
    monkeypatch.setattr(dist, "P2POp", lambda op, t, peer, group=None, tag=0: (op, t, peer))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    return log


def _middle_stage_links(early: bool):
    from lightning_titan.parallel.mesh import ParallelDims
    from lightning_titan.parallel.pipeline.p2p import StageLinks

    links = StageLinks(ParallelDims(1, 3, 1, 1), None, torch.float32, torch.device("cpu"))
    links.early = early
    links.start((2, 3, 4), forward=2, backward=2)
    return links


def test_p2p_sends_in_the_autocast_dtype_and_returns_the_stage_dtype(monkeypatch):
    for autocast, want in ((False, torch.float32), (True, torch.bfloat16)):
        for early in (True, False):
            log = _fake_p2p(monkeypatch)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                links = _middle_stage_links(early)
                got = links.recv_forward()
                links.send_forward(torch.randn(2, 3, 4))
                back = links.send_backward_recv_forward(torch.randn(2, 3, 4))
                links.finish()
            assert got.dtype == back.dtype == torch.float32  # the stage computes as in one process
            payloads = [dtype for call, dtype in log if call in ("isend", "irecv")]
            assert payloads and set(payloads) == {want}, (autocast, early, log)


def test_paired_p2p_holds_at_most_two_send_only_batches(monkeypatch):
    """Under NCCL a wait makes this rank's compute stream wait for the send to complete, i.e. for
    the peer to receive it: a send-only batch is not waited at once. A later batch with a receive
    is, and NCCL runs a communicator's batches in order, so the sends before it are done then: they
    are dropped (waited, at no cost). More than ``SENDS_IN_FLIGHT`` send-only batches in a row wait
    for the oldest, so a step holds O(1) sent buffers, not O(M) (issue 43)."""
    from lightning_titan.parallel.pipeline.p2p import SENDS_IN_FLIGHT

    log = _fake_p2p(monkeypatch)
    links = _middle_stage_links(early=False)
    links.send_forward(torch.randn(2, 3, 4))
    assert log == [("isend", torch.float32)], log  # not waited yet
    links.recv_backward()  # a batch with a receive is waited at once (its buffer is used next)
    assert log[-2:] == [("wait", "irecv"), ("wait", "isend")], log  # and the send before it dropped
    assert not links._sends
    del log[:]
    for _ in range(SENDS_IN_FLIGHT + 1):
        links.send_forward(torch.randn(2, 3, 4))
    assert log == [("isend", torch.float32)] * (SENDS_IN_FLIGHT + 1) + [("wait", "isend")], log
    assert len(links._sends) == SENDS_IN_FLIGHT
    links.finish()
    assert log[-SENDS_IN_FLIGHT:] == [("wait", "isend")] * SENDS_IN_FLIGHT and not links._sends


def test_a_rank_without_grads_measures_its_norm_on_the_parameters_device():
    """The norm is all-reduced over the model group: under NCCL it must be a CUDA tensor also on a rank
    none of whose parameters got a grad (meta stands in for CUDA here)."""
    from lightning_titan.parallel.dp.clipping import clip_grad_norm_

    expert = [torch.nn.Parameter(torch.zeros(2, 3, device="meta"))]
    non_expert = [torch.nn.Parameter(torch.zeros(4, device="meta"))]
    norm = clip_grad_norm_(iter(expert + non_expert), 1.0, counted=iter(expert))
    assert norm.device.type == "meta"


# ---- tracing on CUDA: events, one wait at stop; ExpertLoad: one read per logged step -------------


class _FakeEvent:
    """A CUDA event on a fake GPU clock (ms), advanced by the test."""

    now_ms = 0.0

    def record(self) -> None:
        self.at = _FakeEvent.now_ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: _FakeEvent) -> float:
        return other.at - self.at


def test_cuda_tracing_times_spans_by_events_without_a_sync_per_span(monkeypatch):
    from lightning_titan.runtime import tracing

    def no_sync(*args):
        raise AssertionError("torch.cuda.synchronize() in a span")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    monkeypatch.setattr(tracing, "_new_cuda_event", _FakeEvent, raising=False)
    _FakeEvent.now_ms = 0.0
    tracing.start(0, synchronize=True)
    with tracing.span("forward", "f"):
        _FakeEvent.now_ms = 2.0  # the GPU reaches the span's end 2 ms after the anchor
        with tracing.span("all_to_all", "a"):
            _FakeEvent.now_ms = 3.5
    spans = {s.name: s for s in tracing.stop()}
    assert spans["f"].duration_ns == 3_500_000
    assert spans["a"].start_ns - spans["f"].start_ns == 2_000_000
    assert spans["a"].duration_ns == 1_500_000


def test_expert_load_reads_the_table_once_per_logged_step():
    from types import SimpleNamespace

    from lightning_titan.lightning.callbacks import ExpertLoad

    callback = ExpertLoad(plot_path=None)
    callback._shape = (2, 4)
    callback._counts = {0: torch.tensor([3.0, 1.0, 0.0, 0.0]), 1: torch.tensor([1.0, 1, 1, 1])}
    logged = {}
    trainer = SimpleNamespace(global_step=1, strategy=SimpleNamespace(root_device="cpu"))
    module = SimpleNamespace(log_dict=lambda metrics, **kw: logged.update(metrics))
    with HostReads() as reads:
        callback.on_train_batch_end(trainer, module, None, None, 0)
    assert reads.calls == ["tolist"], reads.calls
    assert logged["expert_load/layer0/max_over_mean"] == 3.0
    assert logged["expert_load/layer0/expert1"] == 0.25
    assert callback.history == [(1, [[0.75, 0.25, 0.0, 0.0], [0.25] * 4])]
