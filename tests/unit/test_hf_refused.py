"""What ``init_from`` refuses rather than trains on, each named with the fix before any step: a
DeepSeek-V3 config.json whose group routing or query rank is out of range (by its key, before a
model is built), a YaRN that would train a NaN, and a weight holding NaN or inf (by its name)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import build, hf_config
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_titan.hf import load as hf_load
from lightning_titan.model.decoder import ModelConfig, StageModel

TRAINING = ModelConfig(seq_len=16)


def _config_folder(tmp_path, family: str, **edits):
    """A folder holding only ``family``'s tiny config.json with ``edits`` (None deletes a key)."""
    config = {**hf_config(family).to_dict(), **edits}
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None})
    )
    return tmp_path


@pytest.mark.parametrize(
    "edits,match",
    [
        # n_group=2 groups of 2 experts, topk_group=1 of them, num_experts_per_tok=2 in the tiny model
        ({"topk_group": 0}, r"topk_group=0 is not supported: give an int in 1..n_group=2"),
        ({"topk_group": 3}, r"topk_group=3 is not supported: give an int in 1..n_group=2"),
        ({"n_group": 0}, r"n_group=0 is not supported: give an int >= 1 dividing n_routed_experts=4"),
        ({"n_group": 3}, r"n_group=3 is not supported: give an int >= 1 dividing"),
        ({"n_group": 4}, r"n_group=4 is not supported: it leaves 1 expert per group.*n_group <= "),
        ({"n_group": True}, r"n_group=True is not supported"),
        ({"q_lora_rank": 0}, r"q_lora_rank=0 is not supported: .*an int >= 1\), or null for one q_proj"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 is not supported: give an int in 1..n_routed_experts=4"),
        ({"num_experts_per_tok": 0}, r"num_experts_per_tok=0 is not supported"),
        ({"num_experts_per_tok": 3}, r"topk_group=1 is not supported: 1 group\(s\) of 2 experts hold fewer than num_experts_per_tok=3; give topk_group >= 2"),
    ],
)  # fmt: skip
def test_a_deepseek_config_out_of_range_is_refused_by_its_key(tmp_path, edits, match):
    folder = _config_folder(tmp_path, "deepseek_v3", **edits)
    with pytest.raises(ValueError, match=rf"{folder}/config.json: {match}"):
        hf_load.config_from_folder(folder, TRAINING)


def test_a_missing_group_key_is_one_group_and_a_null_q_rank_one_q_proj(tmp_path):
    folder = _config_folder(
        tmp_path, "deepseek_v3", n_group=None, topk_group=None, q_lora_rank=None
    )
    config = hf_load.config_from_folder(folder, TRAINING)
    assert (config.router_groups, config.router_topk_groups, config.q_lora_rank) == (1, 1, 0)


@pytest.mark.parametrize(
    "rope,match",
    [
        ({"beta_fast": 1.0, "beta_slow": 8.0}, r"rope_yarn beta_fast=1.0 <= beta_slow=8.0"),
        ({"attention_factor": 0.0}, r"rope_yarn\['attention_factor'\]=0.0 must be a finite number > 0"),
        ({"factor": True}, r"rope_yarn\['factor'\]=True must be a finite number > 0"),
    ],
)  # fmt: skip
def test_a_yarn_that_would_train_wrong_is_refused_from_config_json(tmp_path, rope, match):
    rope = {**hf_config("gpt_oss").to_dict()["rope_parameters"], **rope}
    folder = _config_folder(tmp_path, "gpt_oss", rope_parameters=rope)
    with pytest.raises(ValueError, match=match):
        hf_load.config_from_folder(folder, TRAINING)


@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek")
    build("deepseek_v3", folder, shard=False)
    return folder


BIAS = "model.layers.2.mlp.gate.e_score_correction_bias"  # DeepSeek-V3's expert bias (a buffer)
KV_A = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"


@pytest.mark.parametrize(
    "name,values,match",
    [
        (BIAS, [float("inf"), float("-inf")], rf"'{BIAS}' holds 2 non-finite value\(s\) \(NaN or inf\) of 4"),
        (KV_A, [float("nan")], rf"'{KV_A}' holds 1 non-finite value\(s\) \(NaN or inf\) of 512"),
    ],
)  # fmt: skip
def test_a_non_finite_weight_is_refused_by_name(deepseek_folder, tmp_path, name, values, match):
    """Not a NaN loss blamed on the learning rate: the tensor, how many values, and the fix."""
    with safe_open(str(deepseek_folder / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name].view(-1)[: len(values)] = torch.tensor(values)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((deepseek_folder / "config.json").read_text())
    model = StageModel(hf_load.config_from_folder(tmp_path, TRAINING))
    with pytest.raises(ValueError, match=rf"model.safetensors: {match}: the checkpoint is damaged"):
        hf_load.load_stage(model, tmp_path)
    hf_load.load_stage(model, deepseek_folder)  # the intact folder loads


def test_json_nested_past_the_parser_is_named(tmp_path):
    from lightning_titan.hf.folder import read_json

    path = tmp_path / "config.json"
    path.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=r"config.json nests its JSON deeper than"):
        read_json(path)


@pytest.mark.parametrize("entry", [123, None, ["model.safetensors"]])
def test_a_weight_map_entry_that_is_not_a_file_name_is_named(tmp_path, entry):
    import json

    from lightning_titan.hf.load import INDEX_FILE, tensor_files

    index = {"weight_map": {"lm_head.weight": entry}}
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"weight_map\['lm_head.weight'\] = .* is not a file name"):
        tensor_files(tmp_path)


@pytest.mark.timeout(120)  # unchecked, the ten million layers' names took minutes
@pytest.mark.parametrize(
    "family, edits, match",
    [
        ("qwen3_moe", {"num_hidden_layers": 10_000_000}, r"gives 10000000 layers .* hold 4"),
        ("qwen3_moe", {"num_experts": 1_000_000_000}, r"gives 1000000000 experts .* hold 4"),
        ("deepseek_v3", {"n_routed_experts": 1_000_000_000}, r"gives 1000000000 experts"),
    ],
)
def test_a_config_larger_than_its_weights_is_named_before_a_model_is_built(
    tmp_path, family, edits, match
):
    """A config.json edited to a huge model next to the tiny model's weights: named in a blink, not
    after minutes of building names for ten million layers (or a MemoryError)."""
    folder = tmp_path / "hf"
    build(family, folder)
    config = {**json.loads((folder / "config.json").read_text()), **edits}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        model_config = hf_load.config_from_folder(folder, TRAINING)
        hf_load.check_folder(folder, model_config)
