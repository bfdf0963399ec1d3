"""titan export a tensor at a time (hf/shards.py): safetensors files of at most --max-shard-size with
transformers' index, in --dtype, read from the sharded checkpoint a group at a time; the folder loads
in transformers with our logits, and back into our decoder with every weight."""

from __future__ import annotations

import json
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lightning_titan.checkpoint import ModelEntries, save_sharded
from lightning_titan.hf import export, shards
from lightning_titan.hf import load as hf_load
from lightning_titan.model.decoder import ModelConfig, StageModel

CONFIG = ModelConfig(d_model=32, n_layers=2, n_heads=4, ffn_dim=24, n_experts=4, seq_len=16,
                     vocab_size=64)  # fmt: skip
# one of each kind of mapping: gpt-oss fuses a layer's experts; DeepSeek-V3 keeps the expert bias
FAMILY_OPTIONS = {
    "gpt_oss": dict(attn_sinks=True, qkv_bias=True, attn_out_bias=True, expert_proj_bias=True,
                    router_bias=True, swiglu_limit=7.0),
    "deepseek_v3": dict(kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4,
                        v_head_dim=6, router_score="sigmoid", router_expert_bias=True,
                        shared_expert_dim=48, shared_expert_gated=False, dense_layers=1,
                        dense_ffn_dim=40),
}  # fmt: skip


def _checkpoint(path: Path, config: ModelConfig = CONFIG) -> tuple[Path, StageModel]:
    model = StageModel(config)
    model.init_weights(2)
    for name, bias in model.named_buffers():
        if name.endswith("expert_bias"):
            bias.copy_(torch.randn(bias.shape))
    save_sharded(path, model, [], {}, layout={})
    return path, model.eval()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_sizes_and_dtypes_are_read_as_transformers_reads_them():
    assert shards.size_of("5GB") == 5 * 10**9
    assert shards.size_of("500MB") == 500 * 10**6
    assert shards.size_of("2GiB") == 2 * 2**30
    assert shards.size_of("1.5 kb") == 1500
    assert shards.size_of(1234) == 1234
    for bad in ("5 parsecs", "GB", "-1GB", "0MB"):
        with pytest.raises(ValueError, match="--max-shard-size"):
            shards.size_of(bad)
    assert shards.dtype_of("bf16") is torch.bfloat16 and shards.dtype_of("FP32") is torch.float32
    with pytest.raises(ValueError, match="--dtype 'int8'.*bf16"):
        shards.dtype_of("int8")


def test_a_bad_size_is_named_before_the_checkpoint_is_read(tmp_path, capsys):
    with pytest.raises(SystemExit):
        export.main(["--ckpt", str(tmp_path / "none"), "--out", str(tmp_path / "hf"),
                     "--max-shard-size", "lots"])  # fmt: skip
    assert "--max-shard-size 'lots' is not a size" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_groups_are_cut_into_shards_in_order_and_a_large_one_stands_alone():
    assert shards.cut([4, 4, 4], 10) == [[0, 1], [2]]
    assert shards.cut([4, 6, 1], 10) == [[0, 1], [2]]  # exactly the limit fits
    assert shards.cut([3, 20, 3], 10) == [[0], [1], [2]]
    assert shards.cut([3], 10) == [[0]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_sharded_export_loads_in_transformers_with_our_logits(tmp_path, dtype, capsys):
    import transformers

    ckpt, model = _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "hf"
    export.main(["--ckpt", str(ckpt), "--out", str(out), "--dtype", dtype,
                 "--max-shard-size", "30KB"])  # fmt: skip
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors, want = _tensors(out), {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(files)
    for name in files:
        assert (out / name).stat().st_size <= 30_000 + 4096, name  # the header aside
        with safe_open(str(out / name), framework="pt") as f:
            assert all(index["weight_map"][k] == name for k in f.keys())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    assert all(t.dtype == want for t in tensors.values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(want)[6:]
    progress = capsys.readouterr().err
    assert f"{len(tensors)}/{len(tensors)} tensors" in progress and files[-1] in progress
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert theirs.dtype == want
    tokens = torch.randint(
        0, CONFIG.vocab_size, (2, CONFIG.seq_len), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours, _ = model(tokens)
        got = theirs(input_ids=tokens).logits.float()
    tolerance = {"bf16": 2e-2, "fp32": 1e-5}[dtype]
    torch.testing.assert_close(got, ours, rtol=0, atol=tolerance * ours.abs().max().item())


@pytest.mark.timeout(120)
def test_a_model_that_fits_one_shard_is_one_file_and_the_checkpoint_is_read_a_tensor_at_a_time(
    tmp_path, monkeypatch
):
    ckpt, model = _checkpoint(tmp_path / "ckpt")
    # the largest of our tensors, an expert's row counted alone
    largest = max(t.numel() * t.element_size() for t in export.hf_state_dict(model).values())
    live: dict[int, int] = {}  # the tensors read and not yet freed: id -> bytes
    peak, reads = [0], [0]
    read = ModelEntries.read

    def counted(self, entries):
        tensors = read(self, entries)
        for t in tensors:
            live[id(t)] = t.numel() * t.element_size()
            weakref.finalize(t, live.pop, id(t), None)
        peak[0], reads[0] = max(peak[0], sum(live.values())), reads[0] + 1
        return tensors

    monkeypatch.setattr(ModelEntries, "read", counted)
    monkeypatch.setattr(export, "consolidate", None)  # the whole state is never read
    out = export.export_hf(ckpt, tmp_path / "hf", progress=False)
    assert sorted(p.name for p in out.iterdir() if "safetensors" in p.name) == ["model.safetensors"]
    # bf16: a tensor read is freed once cast, so at most one is held (the file holds the casts)
    assert reads[0] > 10 and peak[0] <= largest
    assert _tensors(out).keys() == export.hf_state_dict(model).keys()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(FAMILY_OPTIONS))
def test_fused_and_biased_families_export_in_shards_and_load_back(tmp_path, family, monkeypatch):
    config = replace(CONFIG, **FAMILY_OPTIONS[family])
    ckpt, model = _checkpoint(tmp_path / "ckpt", config)
    held: list[int] = []
    read = ModelEntries.read

    def counted(self, entries):
        tensors = read(self, entries)
        held.append(sum(t.numel() * t.element_size() for t in tensors))
        return tensors

    monkeypatch.setattr(ModelEntries, "read", counted)
    out = export.export_hf(ckpt, tmp_path / "hf", "fp32", "20KB", progress=False)
    # a read holds what one tensor of the folder is made of (gpt-oss: one fused tensor's rows)
    assert max(held) <= max(t.numel() * t.element_size() for t in _tensors(out).values())
    assert (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    again = StageModel(hf_load.config_from_folder(out, ModelConfig(seq_len=CONFIG.seq_len)))
    hf_load.load_stage(again, out)
    held = again.state_dict()
    for name, tensor in model.state_dict().items():  # the expert biases too
        assert torch.equal(held[name], tensor), name


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split(f"{field}:")[1].split()[0]) * 1024


def test_a_read_holds_a_tensor_once(tmp_path):
    """64 MB read through ModelEntries: the process's peak RSS grows by one copy of it, not the two
    of DCP's reader (a fresh tensor, then a copy into the destination)."""
    import ctypes

    try:  # the high-water mark reset to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    big = torch.nn.Linear(4096, 4096, bias=False)  # 64 MiB
    save_sharded(tmp_path / "ckpt", big, [], {}, layout={})
    entries, nbytes = ModelEntries(tmp_path / "ckpt"), 4096 * 4096 * 4
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _rss("VmRSS")
    (got,) = entries.read([("weight", None)])
    held = _rss("VmHWM") - start
    assert torch.equal(got, big.weight.detach())
    # one copy and a few MB of Python and zip parsing; DCP's reader holds 2x
    assert nbytes <= held < 1.25 * nbytes, held / nbytes


def test_expert_rows_and_every_tensor_read_equal_the_saved_ones(tmp_path, monkeypatch):
    """Each expert's row read alone from its own record, bit for bit, with DCP's reader never used
    for a plain record; a record DCP wrote with other strides still reads right (through DCP)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_titan.checkpoint import records, storage

    ckpt, model = _checkpoint(tmp_path / "ckpt")
    entries = ModelEntries(ckpt)
    wanted, saved = [], []
    for name, tensor in model.state_dict().items():
        if shards.is_stacked_experts(name):
            for e in range(tensor.shape[0]):
                wanted.append((name, e))
                saved.append(tensor[e])
        else:
            wanted.append((name, None))
            saved.append(tensor)
    dcp_load = storage.load
    monkeypatch.setattr(storage, "load", None)  # a plain record is read without DCP
    got = entries.read(wanted)
    assert len(got) > 2 * CONFIG.n_experts
    for key, a, b in zip(wanted, got, saved, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), key
    monkeypatch.setattr(storage, "load", dcp_load)

    import torch.distributed.checkpoint as dcp

    odd = {"t": torch.randn(5, 3).t(), "b": torch.randn(3, 4).bfloat16(), "s": torch.tensor(1.5)}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(odd, checkpoint_id=tmp_path / "odd", no_dist=True)
    metadata = storage.load_metadata(tmp_path / "odd" / ".metadata")
    direct = {}
    for key, value in odd.items():
        assert isinstance(metadata.state_dict_metadata[key], TensorStorageMetadata)
        out = torch.empty(value.shape, dtype=value.dtype)
        direct[key] = records.read_into(tmp_path / "odd", metadata, key, out)
        if direct[key]:
            assert torch.equal(out, value), key
    assert direct == {"t": False, "b": True, "s": True}  # t: saved with its transposed strides
