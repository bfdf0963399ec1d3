"""``titan generate --layout``, the parts without ranks: each stage of a layout reads exactly its
own tensors of a checkpoint, and a layout the model or the machine cannot take is one line before
any rank starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ckpt_tiny import write_checkpoint

from lightning_titan.checkpoint import read_checkpoint_info
from lightning_titan.checkpoint import stage as stage_reader
from lightning_titan.checkpoint.state import split_expert_key
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.tools import generate_layout

CONFIG = ModelConfig(d_model=32, n_layers=4, n_heads=4, ffn_dim=32, n_experts=4, seq_len=32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("generate_layout") / "ckpt"
    return path, write_checkpoint(path, CONFIG)


def test_each_stage_of_pp2_ep2_reads_its_layers_and_experts_only(ckpt, monkeypatch):
    path, full = ckpt
    whole = full.state_dict()
    requested: list[str] = []
    load = stage_reader.storage.load

    def recording(state, *args, **kwargs):
        requested.extend(state)
        return load(state, *args, **kwargs)

    monkeypatch.setattr(stage_reader.storage, "load", recording)
    for pp_rank in range(2):
        for ep_rank in range(2):
            model = StageModel(CONFIG, pp_rank=pp_rank, pp=2, ep_rank=ep_rank, ep=2)
            requested.clear()
            read = stage_reader.load_stage(path, model)
            start, end = model.expert_range
            for name, value in model.state_dict().items():
                want = whole[name]
                if want.shape != value.shape:  # stacked experts: this rank's rows
                    want = want[start:end]
                assert torch.equal(value, want), (pp_rank, ep_rank, name)
            # only this stage's layers and this rank's experts were asked of the files
            layers, experts = set(), set()
            for key in requested:
                name, expert = split_expert_key(key.removeprefix("model/model."))
                if name.startswith("layers."):
                    layers.add(int(name.split(".")[1]))
                if expert is not None:
                    experts.add(expert)
            first, last = model.layer_range
            assert layers == set(range(first, last)), (pp_rank, layers)
            assert experts == set(range(start, end)), (ep_rank, experts)
            assert ("model/model.embed.weight" in requested) == (pp_rank == 0)
            assert ("model/model.lm_head.weight" in requested) == (pp_rank == 1)
            assert read == sum(v.numel() * v.element_size() for v in model.state_dict().values())


def test_a_stage_of_another_config_is_refused(ckpt):
    path, _ = ckpt
    other = dataclasses.replace(CONFIG, rope_theta=500000.0)  # the same shapes
    with pytest.raises(ValueError, match="checkpoint has rope_theta=10000.0"):
        stage_reader.load_stage(path, StageModel(other, pp_rank=1, pp=2))


@pytest.mark.parametrize("layout, match", [
    ("bogus", "--layout=bogus is not a layout"),
    ("pp2xtp2", "generation runs under pp and ep only, not tp2"),
    ("dp2xep2", "not dp2"),
    ("ep3", "n_experts=4 is not divisible by ep=3"),
    ("pp3", "n_layers=4 is not divisible by pp=3"),
])  # fmt: skip
def test_a_layout_the_model_cannot_take_is_one_line_before_any_rank(
    layout, match, ckpt, monkeypatch, capsys
):
    from lightning_titan.tools.generate import main

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(generate_layout, "run_on_ranks", no_ranks)
    path, _ = ckpt
    with pytest.raises(SystemExit) as exit_:
        main(["--ckpt", str(path), "--prompt", "x", "--layout", layout])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and match in err[-1], err


def test_a_world_larger_than_the_gpus_and_lora_are_refused(ckpt):
    info = read_checkpoint_info(ckpt[0])
    assert generate_layout.check_layout("pp2xep2", info, gpus=4).world_size == 4
    assert generate_layout.check_layout("pp2xep2", info, gpus=0).world_size == 4  # CPU ranks
    with pytest.raises(ValueError, match="takes 4 GPUs, one a rank, and this machine has 3"):
        generate_layout.check_layout("pp2xep2", info, gpus=3)
    lora = {**info, "meta": {"hyper_parameters": {"lora": {"rank": 4}}}}
    with pytest.raises(ValueError, match="LoRA adapters, which generate in one process only"):
        generate_layout.check_layout("pp2", lora, gpus=0)


def test_a_rank_that_fails_is_one_line(ckpt, monkeypatch, capsys):
    from lightning_titan.tools.generate import main

    def failing(*args, **kwargs):
        raise RuntimeError(
            "rank 2 failed:\nTraceback (most recent call last):\n  File 'x.py', line 1\n"
            "ValueError: corrupt checkpoint c: shard __1_0.distcp is 3 bytes\n"
        )

    monkeypatch.setattr(generate_layout, "generate_on_layout", failing)
    with pytest.raises(SystemExit) as exit_:
        main(["--ckpt", str(ckpt[0]), "--prompt", "x", "--layout", "pp2xep2"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err == (
        "titan generate --layout=pp2xep2: rank 2 failed: ValueError: corrupt checkpoint c: shard "
        "__1_0.distcp is 3 bytes\n"
    )
