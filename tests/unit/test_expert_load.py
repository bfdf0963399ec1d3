"""ExpertLoad (lightning/callbacks.py): max/mean load per layer over training, with the expert bias
and, from the same tokens, without it (the router's unbiased top-K). In one process, through the
callback's hooks; tests/distributed/test_bench.py runs it under ``titan fit`` on two pipeline stages."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch
from torch import nn

from lightning_titan.lightning import plots
from lightning_titan.lightning.callbacks import ExpertLoad, balance_summary
from lightning_titan.model.decoder import ModelConfig, StageModel

CONFIG = ModelConfig(d_model=32, n_layers=2, n_heads=4, ffn_dim=24, n_experts=4, seq_len=8)


class Module(nn.Module):
    """What the callback needs of a LightningModule: the modules and log_dict."""

    def __init__(self, model: StageModel) -> None:
        super().__init__()
        self.model = model
        self.logged: dict[str, float] = {}

    def log_dict(self, metrics: dict, **kwargs) -> None:
        self.logged.update(metrics)


def run_steps(config: ModelConfig, steps: int, bias: list[float] | None = None):
    model = StageModel(config)
    model.init_weights(0)
    if bias is not None:
        for block in model.layers.values():
            block.moe.expert_bias.copy_(torch.tensor(bias))
    module, callback = Module(model), ExpertLoad(plot_path=None)
    trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(root_device="cpu"),
                              is_global_zero=True)  # fmt: skip
    callback.on_train_start(trainer, module)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        model(torch.randint(0, config.vocab_size, (4, config.seq_len), generator=g))
        trainer.global_step = step + 1
        callback.on_train_batch_end(trainer, module, None, None, step)
    return model, module.logged, callback


def max_over_mean(counts: torch.Tensor) -> float:
    counts = counts.double()
    return (counts.max() / counts.mean()).item()


def test_with_the_bias_both_loads_are_logged_and_plotted_over_training(tmp_path):
    config = replace(CONFIG, router_bias_update_rate=1e-3)
    # expert 0 wins every token's first choice: with the bias the load is as uneven as top-2 allows
    model, logged, callback = run_steps(config, 3, bias=[9.0, 0.0, 0.0, 0.0])
    for layer, block in enumerate(model.layers.values()):
        moe = block.moe
        assert moe.tokens_per_expert[0] == 4 * config.seq_len  # every token visits expert 0
        ratio = logged[f"expert_load/layer{layer}/max_over_mean"]
        unbiased = logged[f"expert_load/layer{layer}/max_over_mean_unbiased"]
        assert ratio == max_over_mean(moe.tokens_per_expert) == 2.0  # E / K
        assert unbiased == max_over_mean(moe.unbiased_tokens_per_expert) < ratio
    assert [step for step, _, _ in callback.balance] == [1, 2, 3]
    assert all(len(row[1]) == len(row[2]) == 2 for row in callback.balance)
    summary = balance_summary(callback.balance)
    assert "layer 1 unbiased" in summary and "2.00 -> 2.00, mean 2.00" in summary
    if plots.available():  # the shares per layer, and a last panel: max/mean with and without
        plots.plot_expert_load(callback.history, tmp_path / "load.png", callback.balance)
        assert (tmp_path / "load.png").stat().st_size > 0


def test_without_the_bias_only_the_actual_load():
    model, logged, callback = run_steps(CONFIG, 2)
    assert "expert_load/layer0/max_over_mean_unbiased" not in logged
    moe = model.layers["1"].moe
    assert logged["expert_load/layer1/max_over_mean"] == max_over_mean(moe.tokens_per_expert)
    assert callback.balance[-1][2] is None and "unbiased" not in balance_summary(callback.balance)
