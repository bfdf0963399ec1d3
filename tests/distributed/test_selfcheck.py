"""The background-save round trip the first-GPU check runs: on CPU, in one process and on two
ranks under tp=2 with ZeRO-1 after an optimizer step, the background save equals the synchronous
one byte for byte, its staged tensors lived in host memory and the writer thread did the write."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from lightning_titan.checkpoint import is_complete_checkpoint
from lightning_titan.checkpoint.selfcheck import background_round_trip
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.dp import zero
from lightning_titan.parallel.mesh import ParallelDims, build_process_groups
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.train.engine import Engine

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_dim=48, n_experts=4)


def _stepped(model: StageModel) -> torch.optim.AdamW:
    """AdamW after one step on grads seeded by name: optimizer state to save."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for name, p in model.named_parameters():
        seed = zlib.crc32(name.encode())
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
    return optimizer


def _check(report: dict) -> None:
    assert report["ok"], report["problems"]
    assert report["identical"] and "meta.pt" in report["compared"], report
    assert any(n.endswith(".distcp") for n in report["compared"]), report
    for rank in report["ranks"]:
        assert rank["staged"] == ["cpu"] and rank["writer"] == ["cpu"], rank
        assert rank["contexts"] == [], rank


def test_round_trip_in_one_process(tmp_path):
    model = StageModel(CONFIG)
    model.init_weights(1)
    optimizer = _stepped(model)
    optimizer.step()
    report = background_round_trip(model, [optimizer], tmp_path)
    _check(report)
    assert len(report["ranks"]) == 1
    assert not is_complete_checkpoint(tmp_path / "sync.ckpt")  # cleared after


def _tp2_zero1(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    dims = ParallelDims(1, 1, 1, rank=rank, tp=2)
    groups = build_process_groups(dims)
    model = StageModel(CONFIG, tp_group=groups.tp)
    model.init_weights(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine(model, dims, groups, zero=1)
    engine.shard_optimizers([optimizer])
    shards = zero.ZeroShards(engine.zero_groups)
    for group in optimizer.param_groups:  # ZeRO-1 steps the shards it put in place of parameters
        for leaf in group["params"]:
            leaf.grad = torch.full_like(leaf, 0.5)
    optimizer.step()
    report = background_round_trip(model, [optimizer], Path(root), zero_shards=shards)
    engine.remove()
    return report


@pytest.mark.timeout(120)
def test_round_trip_on_two_ranks_under_tp2_zero1(tmp_path):
    reports = run_on_ranks(_tp2_zero1, 2, str(tmp_path), timeout_s=100)
    assert reports[0] == reports[1]  # every rank returns the same report
    _check(reports[0])
    assert len(reports[0]["ranks"]) == 2
