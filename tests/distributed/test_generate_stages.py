"""Generation under pp2 x ep2: each rank holds its stage's layers and its experts (loaded from the
Hugging Face folder), and the greedy tokens are transformers' for every family's tiny model, with
the KV cache and without."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import FAMILIES, VOCAB, build, build_mixtral

from lightning_titan.hf import load as hf_load
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.mesh import ParallelDims, build_process_groups
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.tools.generate import generate

NEW, SEQ = 12, 15  # as tests/unit/test_generate.py: the last token sees all seq_len tokens
PROMPT = [3, 14, 15, 9]


def _on_ranks(rank: int, world_size: int, folders: dict[str, str]) -> dict:
    dims = ParallelDims(1, 2, 2, rank)
    groups = build_process_groups(dims)
    out = {}
    for family, folder in folders.items():
        config = hf_load.config_from_folder(folder, ModelConfig(seq_len=SEQ))
        model = StageModel(
            config, pp_rank=dims.pp_rank, pp=2, ep_rank=dims.ep_rank, ep=2, ep_group=groups.ep
        ).eval()
        hf_load.load_stage(model, folder)
        for kv_cache in (True, False):
            out[family, kv_cache] = generate(
                model, PROMPT, NEW, stop_ids=(VOCAB - 1,), kv_cache=kv_cache, pp_group=groups.pp
            )
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp2_ep2_generates_transformers_greedy_tokens(tmp_path):
    expected, folders = {}, {}
    for family in ["mixtral", *FAMILIES]:
        folder = tmp_path / family
        theirs = build_mixtral(folder) if family == "mixtral" else build(family, folder)
        out = theirs.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, pad_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
        )[0, len(PROMPT) :].tolist()  # fmt: skip
        expected[family] = out[:-1] if out[-1] == VOCAB - 1 else out
        folders[family] = str(folder)
    per_rank = run_on_ranks(_on_ranks, 4, folders, timeout_s=500, start_method="fork")
    for family, want in expected.items():
        assert len(want) > 3, family  # a stop this early would compare little
        for kv_cache in (True, False):
            for rank, got in enumerate(per_rank):
                assert got[family, kv_cache] == want, (family, kv_cache, rank)
