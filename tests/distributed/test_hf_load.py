"""init_from: a pretrained Hugging Face Mixtral folder loads into any (dp, pp, ep) layout.

The folders are tiny random Mixtrals built offline (MixtralConfig -> MixtralForCausalLM ->
save_pretrained, once as one file and once sharded with an index). Every weight, norms included, is
random, so a swapped or transposed tensor changes the logits.
"""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_titan.hf import load as hf_load
from lightning_titan.hf.export import export_hf, hf_mixtral_state_dict, load_full_model
from lightning_titan.lightning.module import TitanLM
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups
from lightning_titan.parallel.tensor_parallel import local_slice, tp_cut_modules
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.train.engine import Engine

SEQ_LEN = 12
GLOBAL_BATCH = 8
# aux losses off: transformers' loss (output_router_logits=False) is the token cross-entropy alone
TRAINING = ModelConfig(seq_len=SEQ_LEN, aux_loss_coef=0.0, z_loss_coef=0.0)


def token_loss_sum(logits_MSV: torch.Tensor, targets_MS: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits_MSV.float().flatten(0, 1), targets_MS.flatten(), reduction="sum"
    )


def global_tokens(vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(one-file folder, sharded folder, the transformers model they hold)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=61, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # norms too, and large enough that routing depends on them
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "one")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert (root / "sharded" / hf_load.INDEX_FILE).is_file()
    assert len(list((root / "sharded").glob("*.safetensors"))) > 2
    return root / "one", root / "sharded", model


def originals(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def full_model(folder: Path) -> StageModel:
    model = StageModel(hf_load.config_from_folder(folder, TRAINING))
    hf_load.load_stage(model, folder)
    return model.eval()


def test_config_comes_from_the_folder(hf):
    one, sharded, _ = hf
    for folder in (one, sharded):
        config = hf_load.config_from_folder(folder, TRAINING)
        shape = (config.vocab_size, config.d_model, config.n_layers, config.n_heads)
        assert shape == (61, 32, 4, 4)
        assert (config.n_kv_heads, config.ffn_dim, config.n_experts, config.top_k) == (2, 24, 4, 2)
        assert (config.rope_theta, config.norm_eps, config.seq_len) == (5000.0, 1e-5, SEQ_LEN)
        assert config.aux_loss_coef == 0.0  # a training field: ours, not the folder's
    # given explicitly and equal to the folder: fine
    assert hf_load.config_from_folder(one, ModelConfig(d_model=32, n_experts=4)).d_model == 32


@pytest.mark.parametrize("which", ["one", "sharded"])
def test_logits_loss_and_export_equal_transformers(hf, which):
    folder = hf[0] if which == "one" else hf[1]
    theirs = hf[2]
    model = full_model(folder)
    tokens = global_tokens(61)
    with torch.no_grad():
        want = theirs(input_ids=tokens[:, :-1]).logits
        got, _ = model(tokens[:, :-1])
        # transformers shifts the labels itself: logits at 0..S-1 against tokens 1..S
        their_loss = theirs(input_ids=tokens, labels=tokens).loss.item()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # the first training step's loss, through the engine as TitanLM runs it
    engine = Engine(model, ParallelDims(1, 1, 1, 0), ProcessGroups(None, None, None, None))
    step = engine.forward_backward(model, tokens[:, :-1], tokens[:, 1:], 2, token_loss_sum)
    engine.remove()
    assert step.loss.item() == pytest.approx(their_loss, rel=1e-5)
    # export right after loading gives back exactly the folder's tensors
    exported, original = hf_mixtral_state_dict(model), originals(folder)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def _load_on_ranks(rank: int, world_size: int, folder: str, layout: tuple) -> dict:
    """(dp, pp, ep, tp): this rank's loaded stage, then the strategy's broadcast and one forward."""
    torch.manual_seed(rank)
    dims = ParallelDims(*layout[:3], rank, tp=layout[3])
    groups = build_process_groups(dims)
    config = hf_load.config_from_folder(folder, TRAINING)
    model = StageModel(
        config, pp_rank=dims.pp_rank, pp=dims.pp, ep_rank=dims.ep_rank, ep=dims.ep,
        ep_group=groups.ep, tp_group=groups.tp,
    )  # fmt: skip
    read = hf_load.load_stage(model, folder)
    engine = Engine(model, dims, groups, schedule="1f1b")
    engine.broadcast_replicated()
    tokens = global_tokens(config.vocab_size)
    b = GLOBAL_BATCH // dims.data_world
    rows = slice(dims.data_rank * b, (dims.data_rank + 1) * b)
    loss_fn = model.token_loss_sum if dims.tp > 1 else token_loss_sum
    step = engine.forward_only(model, tokens[rows, :-1], tokens[rows, 1:], 2, loss_fn)
    engine.remove()
    cuts = tp_cut_modules(model)
    cut = {f"{n}.weight": cuts[m].dim for n, m in model.named_modules() if m in cuts}
    return {
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "expert_range": model.expert_range,
        "cut": cut,
        "tp": (dims.tp, dims.tp_rank),
        "loss": step.loss.item(),
        "read": read,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [(2, 2, 2, 1), (1, 2, 2, 2)], ids=["dp2_pp2_ep2", "tp2_pp2_ep2"])
def test_every_rank_of_eight_loads_its_slice(hf, layout):
    one, sharded, theirs = hf
    per_rank = run_on_ranks(
        _load_on_ranks, 8, str(sharded), layout, timeout_s=240, start_method="fork"
    )
    full = {n: p.detach() for n, p in full_model(one).named_parameters()}
    tokens = global_tokens(61)
    with torch.no_grad():
        their_loss = theirs(input_ids=tokens, labels=tokens).loss.item()
    total = sum(t.numel() * t.element_size() for t in originals(one).values())
    held = set()
    for rank, r in enumerate(per_rank):
        start, end = r["expert_range"]
        for name, local in r["weights"].items():
            expected = full[name][start:end] if ".moe.experts." in name else full[name]
            if name in r["cut"]:  # a TP rank's heads or vocabulary rows, padded with zeros
                expected = local_slice(expected, r["cut"][name], *r["tp"])
            assert torch.equal(local, expected), (rank, name)
        held |= set(r["weights"])
        assert r["loss"] == pytest.approx(their_loss, rel=1e-5), rank
        # half the layers, half of their experts: well under the whole file
        assert r["read"] < 0.45 * total, (rank, r["read"], total)
    assert held == set(full)


def _fit(hf_dir: Path, out: Path, run: str) -> list[dict]:
    script = Path(__file__).resolve().parents[1] / "support" / "scripts" / "hf_resume.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, str(script), str(hf_dir), str(out), run]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=out, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"{run}_rank{r}.pt") for r in range(4)]


@pytest.mark.slow  # a Trainer fit and a resume (about 25 s); the loads are tested in-process above
@pytest.mark.timeout(420)
def test_trainer_starts_from_the_folder_and_a_resume_from_the_checkpoint(hf, tmp_path):
    """Under Trainer + TitanStrategy(pp2 x ep2): the broadcast of replicated parameters keeps the
    loaded values, the first step's loss is transformers', and a resumed run with init_from still set
    starts from its checkpoint (restored after configure_model), not from the folder; the fine-tune
    exports back to a folder transformers loads."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "scripts"))
    import hf_resume

    one, sharded, theirs = hf
    full = {n: p.detach() for n, p in full_model(one).named_parameters()}
    tokens = hf_resume.global_tokens(61)
    with torch.no_grad():
        their_loss = theirs(input_ids=tokens, labels=tokens).loss.item()
    first = _fit(sharded, tmp_path, "first")
    resumed = _fit(sharded, tmp_path, "resumed")
    for rank, (a, b) in enumerate(zip(first, resumed, strict=True)):
        start, end = a["expert_range"]
        for name, loaded in a["start"].items():
            expected = full[name][start:end] if ".moe.experts." in name else full[name]
            assert torch.equal(loaded, expected), (rank, name)
            assert torch.equal(b["start"][name], a["end"][name]), (rank, name)
        assert any(not torch.equal(a["end"][n], a["start"][n]) for n in a["start"]), rank
        assert a["loss"] == pytest.approx(their_loss, rel=1e-5), rank
    # the fine-tune exports back to the folder's format: transformers loads it with our logits
    import transformers

    export_hf(tmp_path / "ckpt" / "last.ckpt", tmp_path / "export", dtype="fp32")
    tuned = load_full_model(tmp_path / "ckpt" / "last.ckpt")
    exported = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        ours, _ = tuned(tokens[:, :-1])
        torch.testing.assert_close(
            exported(input_ids=tokens[:, :-1]).logits, ours, rtol=0, atol=1e-4
        )
        assert not torch.allclose(theirs(input_ids=tokens[:, :-1]).logits, ours, atol=1e-3)


# -- bad input: each an error naming the field or tensor and both values -----------------------------
def _copy_folder(src: Path, dst: Path, tensors_edit) -> Path:
    """``src`` as one safetensors file, with ``tensors_edit`` applied to its tensors."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors_edit(originals(src)), str(dst / "model.safetensors"))
    return dst


def _set(**fields):
    return lambda config: {**config, **fields}


@pytest.mark.parametrize(
    "edit,match",
    [
        (_set(model_type="deepseek_v2"), r"model_type='deepseek_v2' is not supported"),
        (
            _set(architectures=["OlmoeForCausalLM"]),
            r"architectures=\['OlmoeForCausalLM'\].*'mixtral'",
        ),
        (_set(tie_word_embeddings=True), r"tie_word_embeddings=True is not supported"),
        (_set(sliding_window=8), r"sliding_window=8 < seq_len=12"),
        (_set(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        (_set(rope_parameters={"rope_type": "yarn", "factor": 4.0}), r"rope_parameters=.*yarn"),
        (_set(head_dim=16), r"head_dim=16 is not supported"),
        (_set(rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_scaling=.*dynamic"),
        (_set(router_jitter_noise=0.1), r"router_jitter_noise=0.1 is not supported"),
    ],
)
def test_unsupported_configs_are_refused(hf, tmp_path, edit, match):
    folder = tmp_path / "bad"
    folder.mkdir()
    config = json.loads((hf[0] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(config)))
    with pytest.raises(ValueError, match=match):
        TitanLM(TRAINING, init_from=str(folder))


def test_disagreeing_field_missing_and_misshaped_tensors_are_named(hf, tmp_path):
    one = hf[0]
    with pytest.raises(
        ValueError, match=r"d_model=48 \(--model.model.d_model\) disagrees with .*hidden_size=32"
    ):
        TitanLM(ModelConfig(d_model=48, seq_len=SEQ_LEN), init_from=str(one))
    with pytest.raises(ValueError, match=r"n_experts=2 .* disagrees with .*num_local_experts=4"):
        TitanLM(ModelConfig(n_experts=2), init_from=str(one))
    # the rule: a field at its ModelConfig default (n_experts=8) is not given, the folder's wins
    assert TitanLM(ModelConfig(n_experts=8), init_from=str(one)).config.n_experts == 4

    name = "model.layers.3.block_sparse_moe.experts.2.w3.weight"
    missing = _copy_folder(one, tmp_path / "missing", tensors_edit=lambda t: {
        k: v for k, v in t.items() if k != name})  # fmt: skip
    with pytest.raises(ValueError, match=rf"lacks 1 tensor.*'{name}'.*'layers.3.moe.experts.w3'"):
        TitanLM(TRAINING, init_from=str(missing))
    # a rank that loads directly (no TitanLM check first) names it too, before copying anything
    model = StageModel(hf_load.config_from_folder(one, TRAINING), pp_rank=1, pp=2, ep_rank=1, ep=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=name):
        hf_load.load_stage(model, missing)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    name = "model.layers.1.self_attn.k_proj.weight"
    misshaped = _copy_folder(one, tmp_path / "misshaped", tensors_edit=lambda t: {
        **t, name: torch.zeros(32, 32)})  # fmt: skip
    with pytest.raises(ValueError, match=rf"'{name}' has shape \[32, 32\] .* needs \[16, 32\]"):
        TitanLM(TRAINING, init_from=str(misshaped))

    # a shard that the index names but that is gone
    gone = tmp_path / "gone"
    shutil.copytree(hf[1], gone)
    shard = json.loads((gone / hf_load.INDEX_FILE).read_text())["weight_map"]["lm_head.weight"]
    (gone / shard).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{shard} is missing; .* names it for 'model\."):
        TitanLM(TRAINING, init_from=str(gone))

    with pytest.raises(FileNotFoundError, match="no config.json"):
        TitanLM(TRAINING, init_from=str(tmp_path))


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/abs/model.safetensors", "link"])
def test_an_index_entry_out_of_the_folder_is_refused(hf, tmp_path, entry):
    """weight_map entries name files inside the folder (links followed), or the load is refused."""
    folder = tmp_path / "sharded"
    shutil.copytree(hf[1], folder)
    index = json.loads((folder / hf_load.INDEX_FILE).read_text())
    name, shard = next(iter(index["weight_map"].items()))
    outside = tmp_path / "outside.safetensors"
    shutil.copy(folder / shard, outside)  # the right tensors, read from the wrong place
    if entry == "/abs/model.safetensors":
        entry = str(outside)
    elif entry == "link":
        (folder / "link.safetensors").symlink_to(outside)
        entry = "link.safetensors"
    index["weight_map"][name] = entry
    (folder / hf_load.INDEX_FILE).write_text(json.dumps(index))
    message = rf"{folder / hf_load.INDEX_FILE}: weight_map\['{name}'\] = '{entry}' leads out of"
    with pytest.raises(ValueError, match=message):
        TitanLM(TRAINING, init_from=str(folder))
    model = StageModel(hf_load.config_from_folder(folder, TRAINING))
    with pytest.raises(ValueError, match=message):
        hf_load.load_stage(model, folder)


def _header(file: Path) -> tuple[dict, bytes]:
    """A safetensors file's JSON header and its tensor bytes."""
    data = file.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _with_header(file: Path, header: dict, body: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + body)


def _damage_folder(folder: Path, how: str) -> Path:
    """Damage one file of ``folder`` as a cut download or a crafted file would; return that file."""
    index = folder / hf_load.INDEX_FILE
    if how == "config.json cut":
        (folder / "config.json").write_text((folder / "config.json").read_text()[:40])
        return folder / "config.json"
    if how == "index cut":
        index.write_text(index.read_text()[:30])
        return index
    if how == "index without weight_map":
        index.write_text(json.dumps({"metadata": {}}))
        return index
    shard = folder / json.loads(index.read_text())["weight_map"]["lm_head.weight"]
    header, body = _header(shard)
    if how == "header length past the file":
        shard.write_bytes(struct.pack("<Q", shard.stat().st_size + 100) + shard.read_bytes()[8:])
    elif how == "offsets past the file":
        entry = next(v for k, v in header.items() if k != "__metadata__")
        entry["data_offsets"] = [0, len(body) * 100]
        _with_header(shard, header, body)
    return shard


@pytest.mark.parametrize(
    "how",
    ["config.json cut", "index cut", "index without weight_map", "header length past the file",
     "offsets past the file"],
)  # fmt: skip
def test_a_damaged_file_of_the_folder_is_named_with_the_fix(hf, tmp_path, how):
    """Not json's or safetensors' bare error (JSONDecodeError, SafetensorError: header too large):
    the file, what is wrong with it, and to download it again; on the launcher and on a rank."""
    folder = tmp_path / "sharded"
    shutil.copytree(hf[1], folder)
    model = StageModel(hf_load.config_from_folder(folder, TRAINING), pp_rank=1, pp=2)
    damaged = _damage_folder(folder, how)
    loads = [lambda: TitanLM(TRAINING, init_from=str(folder))]
    if how != "config.json cut":  # a rank that loads directly, its config already read
        loads.append(lambda: hf_load.load_stage(model, folder))
    for load in loads:
        with pytest.raises(ValueError) as caught:
            load()
        message = str(caught.value)
        assert message.startswith(str(damaged)) and "re-download it" in message, message


def test_a_layout_that_does_not_divide_the_loaded_model_is_named(hf):
    lm = TitanLM(TRAINING, init_from=str(hf[0]))
    with pytest.raises(ValueError, match=r"n_experts=4 is not divisible by ep=3"):
        lm.check_layout(ParallelDims(1, 1, 3, 0))
    assert lm.hparams["model"]["d_model"] == 32 and lm.hparams["init_from"] == str(hf[0])


def test_our_own_export_loads_back(tmp_path):
    """What `titan export` writes (config.json by ``hf_config``, one safetensors file) is a folder
    init_from takes: the same config and every weight."""
    from lightning_titan.hf.export import hf_config

    config = ModelConfig(n_kv_heads=2, seq_len=SEQ_LEN, rope_theta=500.0, norm_eps=1e-6)
    model = StageModel(config)
    model.init_weights(3)
    tensors = {k: v.contiguous() for k, v in hf_mixtral_state_dict(model).items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(config)))
    loaded = TitanLM(ModelConfig(seq_len=SEQ_LEN), init_from=str(tmp_path)).config
    assert loaded == config
    again = StageModel(loaded)
    hf_load.load_stage(again, tmp_path)
    for name, p in model.named_parameters():
        assert torch.equal(dict(again.named_parameters())[name], p), name


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_a_rank_reads_and_holds_about_its_share_while_loading(tmp_path):
    """A ~50 MB model: the rank of pp2 x ep2 reads exactly its own tensors (about a quarter), and the
    peak resident memory of the load rises by about that (the memory-mapped pages it touched, plus one
    tensor in flight), not by the file: a load that read the whole file or built the full model first
    would rise by 1x or more."""
    from lightning_titan.hf.export import write_hf_folder

    config = ModelConfig(d_model=256, n_layers=4, n_heads=4, ffn_dim=512, n_experts=8, seq_len=16)
    model = StageModel(config)
    model.init_weights(0)
    write_hf_folder(model, tmp_path / "hf")
    total = (tmp_path / "hf" / "model.safetensors").stat().st_size
    del model
    script = Path(__file__).resolve().parents[1] / "support" / "scripts" / "load_peak.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, str(script), str(tmp_path / "hf"), str(tmp_path / "peak.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    peak = json.loads((tmp_path / "peak.json").read_text())
    assert peak["read"] == peak["held"]  # no TP: its tensors, whole, and nothing else
    assert 0.2 < peak["read"] / total < 0.35, (peak, total)
    assert peak["rise"] < peak["read"] + 0.15 * total, (peak, total)
