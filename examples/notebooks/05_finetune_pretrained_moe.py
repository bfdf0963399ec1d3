"""Source of 05_finetune_pretrained_moe.ipynb (python examples/notebooks/build.py turns it into the notebook)."""

# %% [markdown]
# # 5. Fine-tune a pretrained MoE under 2 x 2 x 2, export it back, generate with transformers
#
# `TitanLM(init_from=FOLDER)` starts from a Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE
# folder instead of a random init. The model's shape and options (here Qwen3-MoE's QK-norm, its
# explicit head_dim and `norm_topk_prob`) come from `config.json`, and each rank memory-maps the
# safetensors files and reads only its own layers and experts. This notebook
#
# 1. builds a tiny Qwen3-MoE offline with transformers (config -> model -> `save_pretrained`) and gives
#    the folder a byte-level tokenizer, standing in for a downloaded checkpoint;
# 2. fine-tunes it on 8 CPU ranks with (dp, pp, ep) = (2, 2, 2): the data module takes the folder's
#    tokenizer (`tokenizer="auto"`), and the first step's loss is transformers' loss on that batch;
# 3. exports the fine-tune with `titan export` (it is written as Qwen3-MoE, the tokenizer copied) and
#    generates a few tokens with `transformers.AutoModelForCausalLM`.
#
# **Time:** under a minute on a 2-core laptop CPU (44 s measured on 2 vCPUs).

# %%
import json
import logging
import os
import warnings
from pathlib import Path

import lightning as L
import matplotlib.pyplot as plt
import pandas as pd
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_titan import ModelConfig, TitanDataModule, TitanLM, TitanStrategy
from lightning_titan.hf.export import byte_tokenizer_files, export_hf

QUICK = os.environ.get("TITAN_NOTEBOOK_QUICK") == "1"  # the test suite sets it: a few steps only
STEPS = 3 if QUICK else 60
RUNS = Path("runs/05_finetune")
PRETRAINED = RUNS / "tiny-qwen3-moe"

for logger in ("lightning.pytorch", "lightning.fabric", "transformers"):
    logging.getLogger(logger).setLevel(logging.ERROR)
for message in ("dirpath has changed", "dataloader is not resumable", "does not have many workers",
                "LeafSpec", "generation flags"):  # fmt: skip
    warnings.filterwarnings("ignore", f".*{message}.*")

# %% [markdown]
# ## 1. A "pretrained" Qwen3-MoE folder
#
# 4 layers of 4 experts (top-2), 4 query heads of 16 channels over a 32-wide residual (Qwen3-MoE's
# head_dim need not be hidden / heads), a vocabulary of 257: the bytes and an end-of-text token, so
# that the byte-level tokenizer we save beside it covers the text this notebook trains on.

# %%
torch.manual_seed(0)
config = transformers.Qwen3MoeConfig(
    vocab_size=257, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
    tie_word_embeddings=False, eos_token_id=256,
)  # fmt: skip
pretrained = transformers.AutoModelForCausalLM.from_config(config).eval()
pretrained.save_pretrained(PRETRAINED)
for name, content in byte_tokenizer_files().items():
    (PRETRAINED / name).write_text(json.dumps(content))
print(sorted(p.name for p in PRETRAINED.iterdir()))

# %% [markdown]
# ## 2. Fine-tune under (dp, pp, ep) = (2, 2, 2)
#
# Only `init_from` differs from training from scratch. The `model` fields left at their defaults take
# the folder's values; the training fields (`seq_len`, the aux losses) are ours.

# %%
MODEL = ModelConfig(seq_len=32, aux_loss_coef=0.0, z_loss_coef=0.0)
module = TitanLM(MODEL, init_from=str(PRETRAINED), learning_rate=3e-3, warmup_steps=0)
print({k: getattr(module.config, k) for k in ("qk_norm", "attn_head_dim", "router_norm_topk")})

data = TitanDataModule(seq_len=MODEL.seq_len, global_batch_size=8, max_bytes=200_000, seed=0)
trainer = L.Trainer(
    accelerator="cpu", devices=8, strategy=TitanStrategy(dp=2, pp=2, ep=2, start_method="fork"),
    max_steps=STEPS, logger=CSVLogger(RUNS, name="finetune", version=0), log_every_n_steps=1,
    limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
    callbacks=[ModelCheckpoint(RUNS / "checkpoints", save_last=True)],
)  # fmt: skip
trainer.fit(module, datamodule=data)

# %%
metrics = pd.read_csv(RUNS / "finetune" / "version_0" / "metrics.csv")
losses = metrics.dropna(subset=["train_loss"]).set_index("step")["train_loss"]
plt.plot(losses.index, losses, "o-")
plt.xlabel("step")
plt.ylabel("train loss")
plt.show()

# %% [markdown]
# The first step trains the loaded model on the first global batch: its loss is transformers' loss
# of the pretrained model on those sequences (the data module used the folder's tokenizer).

# %%
first = TitanDataModule(seq_len=MODEL.seq_len, global_batch_size=8, max_bytes=200_000, seed=0)
first.use_model_folder(str(PRETRAINED))
first.bind(0, 1).setup("fit")
inputs, targets = next(iter(first.train_dataloader()))
with torch.no_grad():
    logits = pretrained(input_ids=inputs).logits
    theirs = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
print(f"step 0: ours {losses.iloc[0]:.6f}, transformers {theirs:.6f}; last {losses.iloc[-1]:.4f}")
assert abs(losses.iloc[0] - theirs) <= 1e-4 * theirs
assert type(first.tokenizer).__name__ == "HFTokenizer"

# %% [markdown]
# ## 3. Export and generate with transformers
#
# `titan export` (`export_hf`) writes `config.json` as the family the model came from, the weights,
# and the folder's tokenizer files.

# %%
exported = export_hf(RUNS / "checkpoints" / "last.ckpt", RUNS / "export")
print(sorted(p.name for p in exported.iterdir()))
tuned = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
assert type(tuned).__name__ == "Qwen3MoeForCausalLM"
prompt = tokenizer("def ", return_tensors="pt").input_ids
with torch.no_grad():
    out = tuned.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=256)
print(repr(tokenizer.decode(out[0])))
