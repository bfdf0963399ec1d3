"""`titan generate`'s decoding: greedy equals transformers' greedy `generate` for a tiny model of
every family (loaded from its folder) and on our exported model; sampling keeps to the top-p nucleus
and is seeded."""

import pytest
import torch
from hf_tiny import FAMILIES, VOCAB, build, build_mixtral

from lightning_titan import ModelConfig, StageModel
from lightning_titan.hf import load as hf_load
from lightning_titan.hf.export import write_hf_folder
from lightning_titan.model.kv_cache import KVCache
from lightning_titan.tools.generate import generate, next_token

NEW = 12
SEQ = 15  # the last token is picked from all 4 + 11 before it: the window is exactly seq_len


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("family", ["mixtral", *FAMILIES])
def test_greedy_generation_equals_transformers_for_every_family(tmp_path, family, kv_cache):
    """Every attention kind (GQA with RoPE, QK-norms, biases, gpt-oss's window of 5 and sinks, MLA
    with YaRN) past its window, with the KV cache (the prompt at once, then a token a forward) and
    without: the tokens transformers' greedy ``generate`` picks, one by one."""
    theirs = build_mixtral(tmp_path) if family == "mixtral" else build(family, tmp_path)
    model = StageModel(hf_load.config_from_folder(tmp_path, ModelConfig(seq_len=SEQ))).eval()
    hf_load.load_stage(model, tmp_path)
    prompt = torch.randint(0, VOCAB - 1, (4,), generator=torch.Generator().manual_seed(1)).tolist()
    eos = theirs.generation_config.eos_token_id  # OLMoE's; the others have none
    ours = generate(model, prompt, NEW, stop_ids=() if eos is None else (eos,), kv_cache=kv_cache)
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


def test_the_cache_runs_the_prompt_once_then_a_token_a_forward_until_seq_len():
    """Past ``seq_len`` the cache cannot go on (positions the model never saw): each token is then a
    forward over the last ``seq_len`` tokens, as without the cache, so the tokens stay the same."""
    model = StageModel(ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, seq_len=16))
    model.init_weights(5)
    model.eval()
    lengths: list[int] = []
    model.register_forward_pre_hook(lambda _, args: lengths.append(args[0].shape[1]))
    cached = generate(model, [1, 2, 3], 20)
    # the text grows from 3 to 22 tokens: 16 fit the cache (3 at once, then 13 alone), then windows
    assert lengths == [3] + [1] * 13 + [16] * 6
    assert cached == generate(model, [1, 2, 3], 20, kv_cache=False)


def test_a_cache_is_refused_where_it_cannot_hold_the_keys():
    model = StageModel(ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, seq_len=8))
    model.init_weights(0)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="one document a sequence"):
        model(tokens, documents=torch.zeros(1, 8, dtype=torch.long), cache=KVCache(8))
    cache = KVCache(8)
    model(tokens[:, :6], cache=cache)
    with pytest.raises(ValueError, match="9 positions do not fit a cache of 8"):
        model(tokens[:, :3], cache=cache)


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


def test_chat_asks_for_the_reply_to_one_user_turn(tmp_path, monkeypatch, capsys):
    """``--chat``: the model reads the prompt as a user turn and the assistant's header (the
    built-in template of the byte tokenizer) and the reply alone is printed; a template that
    refuses the turn is one line."""
    from lightning_titan.data import ByteTokenizer
    from lightning_titan.tools import generate as tool

    model = StageModel(ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, seq_len=64))
    model.init_weights(1)
    model.eval()
    read: list[list[int]] = []
    model.register_forward_pre_hook(lambda _, args: read.append(args[0][0].tolist()))
    monkeypatch.setattr(tool, "load_full_model", lambda ckpt: model)
    monkeypatch.setattr(tool, "tokenizer_of", lambda ckpt: ByteTokenizer())
    ckpt = tmp_path / "ckpt"
    ckpt.write_text("")  # not a folder: resolve hands it on as it is
    argv = ["--ckpt", str(ckpt), "--prompt", "hi", "--max-new-tokens", "5"]
    tool.main([*argv, "--chat"])
    assert read[0] == list(b"<|user|>\nhi") + [256] + list(b"<|assistant|>\n")
    reply = generate(model, read[0], 5, stop_ids=(256,))
    assert capsys.readouterr().out == ByteTokenizer().decode(reply) + "\n"
    tool.main(argv)
    assert capsys.readouterr().out.startswith("hi")

    def refuse(text, tokenizer):
        raise ValueError("cannot be rendered in the chat template of tokenizer 't' (no user turns)")

    monkeypatch.setattr(tool, "reply_prompt", refuse)
    with pytest.raises(SystemExit) as exit_:
        tool.main([*argv, "--chat"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--chat: the prompt cannot be rendered" in err


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
