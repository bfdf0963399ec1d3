"""Tiny random Hugging Face MoE models of each family we load, built offline (config -> model ->
save_pretrained), and a tiny word-level tokenizer for their vocabulary.

Every weight (norms, QK-norms, biases, gates too) is random and large enough that routing depends on
it, so a swapped, transposed or misplaced tensor changes the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 61

# family -> (transformers config class name, its arguments); 4 layers and 4 experts (pp2 x ep2)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, norm_topk_prob=True,
    )),
    "olmoe": ("OlmoeConfig", dict(
        hidden_size=32, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
        norm_topk_prob=False, pad_token_id=None, eos_token_id=VOCAB - 1,
    )),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
        shared_expert_intermediate_size=20, num_attention_heads=4, num_key_value_heads=2,
        norm_topk_prob=False, qkv_bias=True,
    )),
    # head_dim 12 != 32 / 4; even layers see 5 positions back; YaRN whose ramp crosses the dims
    "gpt_oss": ("GptOssConfig", dict(
        hidden_size=32, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, sliding_window=5, swiglu_limit=1.5, num_local_experts=4,
        rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                         "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16},
    )),
    # low-rank query, group-limited routing (2 groups of 2, the best 1 kept), a dense first layer
    "deepseek_v3": ("DeepseekV3Config", dict(
        hidden_size=32, intermediate_size=40, moe_intermediate_size=24, n_routed_experts=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_shared_experts=1, n_group=2,
        topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rms_norm_eps=1e-2,  # apart from the latent norms' fixed 1e-6
    )),
    # one q projection (q_lora_rank null, as DeepSeek-V2-Lite), plain RoPE halves, no groups, YaRN
    "deepseek_v3-qproj": ("DeepseekV3Config", dict(
        hidden_size=32, intermediate_size=40, moe_intermediate_size=24, n_routed_experts=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=12,
        qk_nope_head_dim=6, qk_rope_head_dim=6, v_head_dim=8, n_shared_experts=2, n_group=1,
        topk_group=1, first_k_dense_replace=0, routed_scaling_factor=1.5, norm_topk_prob=False,
        rope_interleave=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "mscale": 1.0,
            "mscale_all_dim": 0.7, "original_max_position_embeddings": 16,
        },  # YaRN: the frequencies, cos/sin and the softmax scale stretched
    )),
}  # fmt: skip


def hf_config(family: str, **overrides):
    import transformers

    class_name, kwargs = FAMILIES[family]
    common = dict(
        vocab_size=VOCAB, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )  # fmt: skip
    return getattr(transformers, class_name)(**{**common, **kwargs, **overrides})


def build(family: str, folder: Path, seed: int = 0, shard: bool = True, **overrides):
    """A random ``family`` model saved to ``folder`` (sharded when ``shard``); returns it (fp32, eval)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides))
    model = model.float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's expert bias
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(folder, **({"max_shard_size": "20KB"} if shard else {}))
    return model


def build_mixtral(folder: Path):
    """A tiny random Mixtral (``FAMILIES`` are the others; Mixtral is our own default shape), weights
    drawn as ``build`` draws them."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False, sliding_window=None,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    model.save_pretrained(folder)
    return model.eval()


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of VOCAB ids (60 words and an end-of-text token) into ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(VOCAB - 1)]
    vocab = {w: i for i, w in enumerate(words)} | {"<eos>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="w0")
    fast.save_pretrained(folder)
