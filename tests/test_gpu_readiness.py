"""CPU-side proxies for what would crash, hang or crawl under CUDA/NCCL (issue 22).

No GPU here: each test imitates the CUDA behaviour that matters (a generator must live on the device
it draws on; every device-to-host read is a stream sync; payload dtypes under autocast) on CPU.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from lightning_titan.model import ModelConfig, StageModel

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
        StageModel(small_config(), pp_rank=0, pp=2).init_weights(SEED)  # built on the context's device
    stage = StageModel(small_config(), pp_rank=1, pp=2, ep_rank=1, ep=2)
    with GeneratorOnItsDevice(), torch.device("meta"):
        stage.init_weights(SEED)
    want = dict(reference.named_parameters())
    for name, p in stage.named_parameters():
        assert p.device.type == "cpu"
        torch.testing.assert_close(p, want[name], rtol=0, atol=0, msg=name)
