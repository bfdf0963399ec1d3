"""The Hugging Face family registry (hf/families/), without tensors: every family file registers, every
family init_from accepts has a tiny test model that tests it against transformers
(tests/support/hf_tiny.py; Mixtral's is test_hf_load.py's), and a config read from a family's
config.json is that family again on export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_tiny import FAMILIES as TINY

import lightning_titan.hf.families as families_package
from lightning_titan.hf import load as hf_load
from lightning_titan.hf.arch import PLAIN, architecture_of, hf_config
from lightning_titan.hf.families import FAMILIES
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.model.options import FLAT_FIELDS

FAMILY_FILES = sorted(
    p.stem for p in Path(families_package.__file__).parent.glob("*.py") if p.stem != "__init__"
)


def _tested_configs() -> dict[str, dict]:
    """The config.json of every tiny model the suite checks against transformers, by its name."""
    import transformers
    from hf_tiny import hf_config as tiny_config

    out = {name: tiny_config(name).to_dict() for name in TINY}
    mixtral = transformers.MixtralConfig(  # as tests/distributed/test_hf_load.py builds it
        vocab_size=61, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )  # fmt: skip
    return {**out, "mixtral": mixtral.to_dict()}


def test_every_family_file_registers_and_has_a_tiny_model():
    assert len(FAMILIES) == len(FAMILY_FILES), (sorted(FAMILIES), FAMILY_FILES)
    assert set(FAMILIES) == {name.split("-")[0] for name in _tested_configs()}
    assert [f for f in FAMILIES.values() if f.marker is None] == [PLAIN]


def test_a_family_holds_only_family_options():
    for family in FAMILIES.values():
        assert set(family.holds) <= set(FLAT_FIELDS), family.model_type
        if family.marker is not None:
            assert family.marker[0] in FLAT_FIELDS and family.signature, family.model_type


def test_load_accepts_every_registered_model_type_and_only_those(tmp_path):
    """Each family's tiny config.json passes the checks, reads back as that family, and its export's
    config.json is that family again; a model_type no family file has is refused, naming them."""
    for name, hf in _tested_configs().items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(hf))
        config = hf_load.config_from_folder(folder, ModelConfig(seq_len=16))
        family = architecture_of(config)
        assert family is FAMILIES[name.split("-")[0]], name
        assert hf_config(config)["model_type"] == family.model_type
        (folder / "config.json").write_text(json.dumps(hf_config(config)))
        assert hf_load.config_from_folder(folder, ModelConfig(seq_len=16)) == config, name
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    hf = {**_tested_configs()["olmoe"], "model_type": "jamba"}
    (unknown / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=rf"model_type='jamba' .* {sorted(FAMILIES)}"):
        hf_load.config_from_folder(unknown, ModelConfig(seq_len=16))
