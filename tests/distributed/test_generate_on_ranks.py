"""``titan generate --layout pp2xep2`` through the command: four ranks, each holding its stage's
layers and its experts read from a training checkpoint, print the text one process prints, and
their greedy tokens are transformers' on the exported folder (Mixtral)."""

from __future__ import annotations

import pytest
import torch
from ckpt_tiny import write_checkpoint

from lightning_titan.cli import main
from lightning_titan.data import ByteTokenizer
from lightning_titan.hf.export import export_hf
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.tools import generate as tool

CONFIG = ModelConfig(d_model=32, n_layers=4, n_heads=4, ffn_dim=32, n_experts=4, seq_len=32)
PROMPT, NEW = "def f(", 24  # 30 tokens: within seq_len, where transformers' positions are ours


class IdTokenizer(ByteTokenizer):
    """The byte tokenizer printing each new id as ``<id>``: a wrong byte is never hidden in an
    invalid UTF-8 sequence's replacement character."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp2_ep2_prints_the_one_process_text_and_transformers_greedy_tokens(
    tmp_path, monkeypatch, capsys
):
    import transformers

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, CONFIG)
    monkeypatch.setattr(tool, "tokenizer_of", lambda ckpt: IdTokenizer())
    argv = ["generate", "--ckpt", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", str(NEW)]
    main(argv)
    one_process = capsys.readouterr().out
    main([*argv, "--layout", "pp2xep2"])  # the one launch of four ranks
    assert capsys.readouterr().out == one_process

    export_hf(ckpt, tmp_path / "hf", dtype="fp32", progress=False)
    theirs = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([list(PROMPT.encode())])
    out = theirs.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=256,
                          pad_token_id=256)[0, ids.shape[1]:].tolist()  # fmt: skip
    want = out[: out.index(256)] if 256 in out else out
    assert len(want) > 3  # a stop this early would compare little
    assert one_process == PROMPT + IdTokenizer().decode(want) + "\n"
