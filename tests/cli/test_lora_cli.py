"""LoRA through the CLI: `titan fit --model.init_from=<Qwen3-MoE folder> --model.lora...` under ep2
trains the adapters on the folder's frozen weights and saves adapter-only checkpoints (in the
background); `titan export`
writes them as a PEFT adapter folder that peft loads onto the transformers model with our logits, or
merged into the base as a Qwen3-MoE folder that transformers loads with the same logits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
import transformers
from hf_tiny import build

from lightning_titan.checkpoint import consolidate, is_complete_checkpoint
from lightning_titan.hf.export import load_full_model
from lightning_titan.hf.export import main as export_main
from lightning_titan.model.lora import is_adapter

ROOT = Path(__file__).resolve().parents[2]
# the shape configs/base.yaml gives the model (init_from must agree with it), the byte vocabulary
BASE_SHAPE = dict(
    vocab_size=257, hidden_size=64, moe_intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, max_position_embeddings=64,
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_lora_fine_tune_exports_as_a_peft_adapter_and_merged(tmp_path):
    folder = tmp_path / "qwen3-tiny"
    build("qwen3_moe", folder, **BASE_SHAPE)
    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(tmp_path / "cache")}
    cmd = [
        sys.executable, "-m", "lightning_titan", "fit", "--config", str(ROOT / "configs/ep.yaml"),
        f"--model.init_from={folder}", "--model.lora.rank=4", "--model.lora.alpha=8",
        "--model.lora.targets=[attention, experts]", "--trainer.max_steps=3",
        "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1",
        "--model.warmup_steps=0", "--trainer.strategy.init_args.start_method=fork",
        "--trainer.strategy.init_args.async_save=true",  # the adapters saved in the background
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "LoRA" in proc.stdout + proc.stderr  # the summary's trained-parameter line
    ckpt = next(p for p in sorted(tmp_path.rglob("last*.ckpt")) if is_complete_checkpoint(p))

    # the checkpoint holds the adapters only: no base tensor, a small fraction of the model's bytes
    state = consolidate(ckpt)
    assert state and all(is_adapter(k) for k in state)
    ours = load_full_model(ckpt)  # the base from the folder, the adapters from the checkpoint
    base_bytes = sum(p.numel() * 4 for n, p in ours.named_parameters() if not is_adapter(n))
    adapter_bytes = sum(v.numel() * 4 for v in state.values())
    assert adapter_bytes < 0.1 * base_bytes
    assert any(v.abs().max() > 0 for k, v in state.items() if "lora_B" in k)  # trained

    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = ours(tokens)
    export_main(["--ckpt", str(ckpt), "--out", str(tmp_path / "adapter"), "--peft"])
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():  # fp32 rounding: the random weights (std 0.3) give large logits
        torch.testing.assert_close(tuned(input_ids=tokens).logits, logits, rtol=1e-5, atol=5e-5)
        with tuned.disable_adapter():  # and the adapter is what makes them so
            assert (tuned(input_ids=tokens).logits - logits).abs().max() > 1e-4

    export_main(["--ckpt", str(ckpt), "--out", str(tmp_path / "merged"), "--dtype", "fp32"])
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=tokens).logits, logits, rtol=1e-4, atol=1e-4)
