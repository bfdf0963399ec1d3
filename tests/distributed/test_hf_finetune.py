"""A Qwen3-MoE fine-tune under Trainer + TitanStrategy: it starts from the folder (pp2 x ep2), resumes
from its checkpoint under another layout (ep2 x tp2), and `titan export` writes it back as Qwen3-MoE
with the folder's tokenizer; the data module takes the folder's tokenizer (tokenizer="auto")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_tiny import VOCAB, build, save_tokenizer

from lightning_titan import TitanDataModule
from lightning_titan.data.tokenizer import ByteTokenizer, HFTokenizer
from lightning_titan.hf.export import export_hf, load_full_model
from lightning_titan.lightning.module import TitanLM
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.tensor_parallel import local_slice

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "scripts"))
import hf_resume  # noqa: E402


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[Path, torch.nn.Module, Path]:
    """(folder with a tokenizer, its transformers model, the same folder without a tokenizer)."""
    root = tmp_path_factory.mktemp("qwen3")
    model = build("qwen3_moe", root / "with_tokenizer")
    save_tokenizer(root / "with_tokenizer")
    build("qwen3_moe", root / "bare", shard=False)
    return root / "with_tokenizer", model, root / "bare"


def _fit(hf_dir: Path, out: Path, run: str, layout: str = "") -> list[dict]:
    script = Path(__file__).resolve().parents[1] / "support" / "scripts" / "hf_resume.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, str(script), str(hf_dir), str(out), run, layout]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=out, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"{run}_rank{r}.pt") for r in range(4)]


def _whole(per_rank: list[dict], key: str) -> dict[str, torch.Tensor]:
    """The full tensors from the ranks of a run without TP (experts concatenated in order)."""
    out: dict[str, list] = {}
    for r in sorted(per_rank, key=lambda r: r["expert_range"]):
        for name, t in r[key].items():
            out.setdefault(name, []).append(t)
    return {
        n: torch.cat(ts) if ".moe.experts." in n else ts[0] for n, ts in out.items()
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_fine_tune_resumes_under_another_layout_and_exports_as_qwen3(qwen3, tmp_path):
    import transformers

    folder, theirs, _ = qwen3
    tokens = hf_resume.global_tokens(VOCAB)
    with torch.no_grad():
        their_loss = theirs(input_ids=tokens, labels=tokens).loss.item()
    first = _fit(folder, tmp_path, "first")  # pp2 x ep2, one step, checkpointed
    resumed = _fit(folder, tmp_path, "resumed", "1,1,2,2")  # ep2 x tp2 from that checkpoint
    assert all(r["loss"] == pytest.approx(their_loss, rel=1e-5) for r in first)
    tuned = _whole(first, "end")
    for rank, r in enumerate(resumed):
        start, end = r["expert_range"]
        for name, got in r["start"].items():
            want = tuned[name][start:end] if ".moe.experts." in name else tuned[name]
            if name in r["cut"]:
                want = local_slice(want, r["cut"][name], *r["tp"])
            assert torch.equal(got, want), (rank, name)

    out = export_hf(tmp_path / "ckpt" / "last.ckpt", tmp_path / "export", dtype="fp32")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    ours = load_full_model(tmp_path / "ckpt" / "last.ckpt")
    with torch.no_grad():
        logits, _ = ours(tokens[:, :-1])
        torch.testing.assert_close(
            exported(input_ids=tokens[:, :-1]).logits, logits, rtol=0, atol=1e-4
        )
    # the folder's tokenizer came along, and its special tokens in config.json
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.encode("w3 w5", add_special_tokens=False) == [3, 5]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] is None  # as the folder's


def test_the_data_module_takes_the_folder_tokenizer(qwen3):
    folder, _, bare = qwen3
    dims = ParallelDims(1, 1, 1, 0)
    lm = TitanLM(ModelConfig(seq_len=16), init_from=str(folder))
    data = TitanDataModule(seq_len=16)  # tokenizer="auto"
    lm.check_layout(dims, data)
    assert isinstance(data.tokenizer, HFTokenizer) and data.tokenizer.name == str(folder)
    assert data.vocab_size == VOCAB and data.tokenizer.encode("w7 w1") == [7, 1]
    assert data.tokenizer.eod_id == VOCAB - 1
    # an explicit choice stays; a folder without a tokenizer leaves "auto" at the byte tokenizer,
    # whose 257 ids this 61-token model cannot embed: named before any rank starts
    explicit = TitanDataModule(seq_len=16, tokenizer="byte")
    with pytest.raises(
        ValueError, match="tokenizer 'byte' has 257 ids but the model's vocab_size is 61"
    ):
        lm.check_layout(dims, explicit)
    bare_lm = TitanLM(ModelConfig(seq_len=16), init_from=str(bare))
    data = TitanDataModule(seq_len=16)
    with pytest.raises(ValueError, match="tokenizer 'byte' has 257 ids"):
        bare_lm.check_layout(dims, data)
    assert isinstance(data.tokenizer, ByteTokenizer)
    # no model folder (from scratch): the byte tokenizer, as before
    scratch = TitanDataModule(seq_len=16)
    TitanLM(ModelConfig(seq_len=16)).check_layout(dims, scratch)
    assert isinstance(scratch.tokenizer, ByteTokenizer)
