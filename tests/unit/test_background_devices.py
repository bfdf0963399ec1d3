"""A background save's device side, on CPU: staged tensors stay host tensors (a DTensor of a CUDA
mesh too: rebuilt around its host shard, not moved back), the writer thread sets its device once,
and it waits for the fence recorded after the host copies before DCP reads a byte.

Without CUDA the hooks are fakes that log what the writer calls; the mesh of a "cuda" DTensor is
built without a backend, so moving its shard to the device raises here."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_titan import ModelConfig, StageModel
from lightning_titan.checkpoint import BackgroundSaves, is_complete_checkpoint, save_sharded
from lightning_titan.checkpoint import sharded as sharded_module
from lightning_titan.checkpoint.devices import DeviceHooks, hooks_for

CONFIG = ModelConfig(
    vocab_size=17, d_model=8, n_layers=2, n_heads=2, ffn_dim=8, n_experts=2, top_k=1
)
LAYOUT = {"dp": 1, "pp": 1, "ep": 1}


class FakeEvent:
    def __init__(self, log: list[tuple[str, str]]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append(("fence waited", threading.current_thread().name))


class FakeHooks(DeviceHooks):
    """Logs (what, on which thread): the device set, fences recorded and waited for."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self.log: list[tuple[str, str]] = []

    def set_device(self) -> None:
        self.log.append(("set_device", threading.current_thread().name))

    def record_fence(self) -> FakeEvent:
        self.log.append(("fence recorded", threading.current_thread().name))
        return FakeEvent(self.log)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_staged_tensors_are_host_copies_and_dtensors_keep_their_placements(one_rank):
    cuda_mesh = DeviceMesh("cuda", [0], _init_backend=False)  # no device needed to build it
    cpu_mesh = DeviceMesh("cpu", [0])
    on_cuda_mesh = DTensor.from_local(torch.arange(6.0).view(3, 2), cpu_mesh, [Shard(0)])
    on_cuda_mesh = DTensor(on_cuda_mesh.to_local(), type(on_cuda_mesh._spec)(
        cuda_mesh, (Shard(0),), tensor_meta=on_cuda_mesh._spec.tensor_meta), requires_grad=False)  # fmt: skip
    state = {
        "dtensor": DTensor.from_local(torch.ones(4, 2), cpu_mesh, [Shard(1)]),
        "cuda_mesh": on_cuda_mesh,
        "plain": torch.full((5,), 3.0),
        "step": 7,
    }
    pin = torch.cuda.is_available()  # where CUDA exists, staging buffers are pinned
    staged = BackgroundSaves(FakeHooks(pin_memory=pin)).stage(state).state
    assert staged["step"] == 7
    for key in ("dtensor", "cuda_mesh", "plain"):
        source, copy = state[key], staged[key]
        if isinstance(source, DTensor):
            assert isinstance(copy, DTensor), key
            assert copy.device_mesh is source.device_mesh and copy.placements == source.placements
            assert copy.shape == source.shape and copy.stride() == source.stride(), key
            source, copy = source.to_local(), copy.to_local()
        assert copy.device.type == "cpu", f"{key} staged on {copy.device}"
        assert copy.is_pinned() == pin, key
        assert copy.data_ptr() != source.data_ptr() and torch.equal(copy, source), key


def test_the_writer_sets_its_device_once_and_waits_for_the_fence_before_writing(
    tmp_path, monkeypatch
):
    hooks = FakeHooks()
    real_save = sharded_module.dcp.save

    def logged_save(*args, **kwargs):
        hooks.log.append(("write", threading.current_thread().name))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(sharded_module.dcp, "save", logged_save)
    saves = BackgroundSaves(hooks)
    model = StageModel(CONFIG)
    model.init_weights(1)
    for name in ("a.ckpt", "b.ckpt"):
        save_sharded(tmp_path / name, model, [], {}, layout=LAYOUT, background=saves)
    saves.wait()
    assert all(is_complete_checkpoint(tmp_path / n) for n in ("a.ckpt", "b.ckpt"))
    main, writer = threading.current_thread().name, "titan-checkpoint-writer"
    assert hooks.log == [
        ("fence recorded", main),
        ("set_device", writer),
        ("fence waited", writer),
        ("write", writer),
        ("fence recorded", main),
        ("fence waited", writer),
        ("write", writer),
    ], hooks.log


def test_cpu_state_gets_cpu_hooks():
    assert type(hooks_for([torch.zeros(2)])) is DeviceHooks
    assert not DeviceHooks().pin_memory
