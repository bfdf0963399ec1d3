"""`titan generate`'s decoding: greedy equals transformers' greedy `generate` for a tiny model of
every family (loaded from its folder) and on our exported model; sampling keeps to the top-p nucleus
and is seeded."""

import pytest
import torch
from hf_tiny import FAMILIES, VOCAB, build, build_mixtral

from lightning_titan import ModelConfig, StageModel
from lightning_titan.hf import load as hf_load
from lightning_titan.hf.export import write_hf_folder
from lightning_titan.tools.generate import generate, next_token

NEW = 12
SEQ = 15  # the last token is picked from all 4 + 11 before it: the window is exactly seq_len


@pytest.mark.parametrize("family", ["mixtral", *FAMILIES])
def test_greedy_generation_equals_transformers_for_every_family(tmp_path, family):
    """Every attention kind (GQA with RoPE, QK-norms, biases, gpt-oss's window of 5 and sinks, MLA
    with YaRN) past its window: the tokens transformers' greedy ``generate`` picks, one by one."""
    theirs = build_mixtral(tmp_path) if family == "mixtral" else build(family, tmp_path)
    model = StageModel(hf_load.config_from_folder(tmp_path, ModelConfig(seq_len=SEQ))).eval()
    hf_load.load_stage(model, tmp_path)
    prompt = torch.randint(0, VOCAB - 1, (4,), generator=torch.Generator().manual_seed(1)).tolist()
    eos = theirs.generation_config.eos_token_id  # OLMoE's; the others have none
    ours = generate(model, prompt, NEW, stop_ids=() if eos is None else (eos,))
    out = theirs.generate(
        torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=VOCAB - 1
    )[0, len(prompt) :].tolist()
    assert ours == (out[:-1] if out[-1] == eos else out)


def test_greedy_generation_equals_transformers_on_the_exported_model(tmp_path):
    import transformers

    config = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, ffn_dim=24, seq_len=16)
    model = StageModel(config)
    model.init_weights(3)
    model.eval()
    write_hf_folder(model, tmp_path / "hf", byte_tokenizer=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = list(b"abc")
    # 3 + 12 tokens: within seq_len (past it, ours sees the last seq_len tokens only)
    ours = generate(model, prompt, 12)
    ids = torch.tensor([prompt])
    out = theirs.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=256)
    assert ours == out[0, len(prompt) :].tolist()


def test_sampling_keeps_to_the_nucleus_and_is_seeded():
    logits = torch.tensor([2.0, 1.5, 1.0, -3.0]).log_softmax(0)  # probs ~ 0.5, 0.3, 0.18, 0.004
    assert next_token(logits, 0.0, 1.0, torch.Generator()) == 0
    probs = logits.softmax(0)
    top_p = float(probs[:2].sum()) - 1e-3  # the first two tokens' mass, just under
    gen = torch.Generator().manual_seed(0)
    drawn = {next_token(logits, 1.0, top_p, gen) for _ in range(400)}
    assert drawn == {0, 1}
    drawn = {next_token(logits, 1.0, 1.0, gen) for _ in range(400)}
    assert {0, 1, 2} <= drawn
    first = [next_token(logits, 1.0, 1.0, torch.Generator().manual_seed(5)) for _ in range(3)]
    assert len(set(first)) == 1


@pytest.mark.parametrize("flags, match", [
    (["--max-new-tokens", "0"], "--max-new-tokens=0"),
    (["--temperature", "-1"], "--temperature=-1.0"),
    (["--top-p", "1.5"], "--top-p=1.5"),
])  # fmt: skip
def test_bad_flags_are_one_line(flags, match, tmp_path, capsys):
    from lightning_titan.tools.generate import main

    with pytest.raises(SystemExit) as exit_:
        main(["--ckpt", str(tmp_path), "--prompt", "x", *flags])
    assert exit_.value.code == 2 and match in capsys.readouterr().err
