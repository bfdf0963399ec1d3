"""LoRA (model/lora.py) in one process: against PEFT on the transformers model (the independent
reference), the frozen base, the adapters' init, and the PEFT folder it exports (hf/adapter.py)."""

from __future__ import annotations

import peft
import pytest
import torch
import torch.nn.functional as F
from hf_tiny import VOCAB, build, build_mixtral

from lightning_titan.hf import adapter as hf_adapter
from lightning_titan.hf import load as hf_load
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.lora import LoRA, is_adapter
from lightning_titan.model.moe.experts import expert_gemm_paths, probe_grouped_mm

SEQ = 12


def ours_from(folder, lora: LoRA, seed: int = 3) -> StageModel:
    """Our model loaded from ``folder`` with ``lora``'s adapters at PEFT's init, then every B set to
    random values (at B = 0 no A has a gradient, and the adapters would change no logit)."""
    config = hf_load.config_from_folder(folder, ModelConfig(seq_len=SEQ))
    model = StageModel(config, lora=lora)
    hf_load.load_stage(model, folder)
    model.init_adapters(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_B.weight", "_lora_B")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def adapters_of(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad if grads else p).detach().clone()
        for n, p in model.named_parameters()
        if is_adapter(n)
    }


def peft_model(folder, adapter_folder):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder).float()
    return peft.PeftModel.from_pretrained(base, adapter_folder, is_trainable=True).eval()


ALL = ("attention", "mlp", "shared", "experts")
DEEPSEEK_MLPS = ("attention", "mlp", "shared")


@pytest.mark.parametrize(
    "family, targets, gemm",
    [
        ("qwen3_moe", ("attention",), "loop"),
        ("qwen3_moe", ("attention", "experts"), "loop"),
        ("qwen3_moe", ("attention", "experts"), "grouped fp32"),
        ("mixtral", ("attention", "experts"), "grouped fp32"),  # peft renames w1/w3/w2
        ("qwen2_moe", ALL, "grouped fp32"),  # q/k/v biases, the shared expert
        ("olmoe", ALL, "grouped fp32"),  # the whole-projection QK-norm
        ("deepseek_v3", ("attention", "experts"), "grouped fp32"),  # latent attention
        ("deepseek_v3-qproj", ("attention",), "loop"),  # MLA's single q projection
        ("gpt_oss", ("attention",), "loop"),  # sinks, window layers, o bias; no expert form
    ],
)
def test_one_process_equals_peft_on_transformers(tmp_path, family, targets, gemm):
    """Same logits, loss and adapter grads as PEFT's LoRA on the transformers model, the adapters
    passed over in PEFT's own folder format (our export): attention, dense and shared MLP targets,
    and the routed experts' gate, up and down (PEFT's target_parameters on the fused expert tensors),
    on both expert paths (the per-expert loop, and the grouped GEMMs where the build has them)."""
    folder = tmp_path / family
    build_mixtral(folder) if family == "mixtral" else build(family, folder)
    lora = LoRA(rank=4, alpha=6.0, targets=targets)
    ours = ours_from(folder, lora)
    if gemm != "loop":
        probe_grouped_mm(ours)  # what the Engine does at setup: the grouped GEMMs where they run
    adapter_folder = hf_adapter.write_peft_folder(
        tmp_path / "adapter", adapters_of(ours), ours.config, lora
    )
    theirs = peft_model(folder, adapter_folder)
    # every adapter we wrote is one PEFT made and trains (none ignored, none left at its init)
    trained = {n for n, p in theirs.named_parameters() if p.requires_grad}
    written = {
        k.replace(".weight", ".default.weight") for k in peft.load_peft_weights(adapter_folder)
    }
    assert trained == written

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    targets_ = torch.roll(tokens, -1, dims=1)
    logits, _ = ours(tokens)
    assert set(expert_gemm_paths(ours).values()) == {gemm}
    their_logits = theirs(input_ids=tokens).logits
    torch.testing.assert_close(logits, their_logits, rtol=1e-5, atol=1e-5)
    # and the adapters change the logits: the comparison is not of two base models
    with torch.no_grad(), theirs.disable_adapter():
        base_logits = theirs(input_ids=tokens).logits
    assert (logits - base_logits).abs().max() > 1e-2

    F.cross_entropy(logits.flatten(0, 1), targets_.flatten()).backward()
    F.cross_entropy(their_logits.flatten(0, 1), targets_.flatten()).backward()
    ours_grads = hf_adapter.peft_tensors(adapters_of(ours, grads=True), ours.config, lora)
    their_grads = {
        n.replace(".default.weight", ".weight"): p.grad
        for n, p in theirs.named_parameters()
        if p.requires_grad
    }
    assert set(ours_grads) == set(their_grads)
    for name, grad in ours_grads.items():
        theirs_grad = their_grads[name]
        if name.endswith("base_layer.lora_B.weight"):  # gate_up's B: its blocks we train
            theirs_grad = theirs_grad * (grad != 0)
        torch.testing.assert_close(
            grad, theirs_grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_a_peft_export_peft_would_misplace_is_refused(tmp_path):
    """DeepSeek-V3's dense and shared MLP adapters: peft would put them on the fused experts."""
    folder = tmp_path / "deepseek"
    build("deepseek_v3", folder)
    lora = LoRA(rank=4, targets=DEEPSEEK_MLPS)
    ours = ours_from(folder, lora)
    with pytest.raises(ValueError, match="mlp.gate_proj has no PEFT form: peft maps"):
        hf_adapter.write_peft_folder(tmp_path / "adapter", adapters_of(ours), ours.config, lora)
    assert not (tmp_path / "adapter").exists()


def test_only_the_adapters_train_and_start_at_the_base():
    config = ModelConfig(seq_len=SEQ)
    base, adapted = (
        StageModel(config),
        StageModel(config, lora=LoRA(targets=("attention", "experts"))),
    )
    base.init_weights(5)
    adapted.init_weights(5)
    trained = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter(n) for n in trained)
    assert all(p.requires_grad for n, p in base.named_parameters())
    # the base's weights are the same values with or without adapters (init by global name), and
    # at B = 0 the adapted model is the base
    for n, p in base.named_parameters():
        assert torch.equal(p, adapted.get_parameter(n)), n
    tokens = torch.randint(0, config.vocab_size, (2, SEQ))
    torch.testing.assert_close(adapted(tokens)[0], base(tokens)[0], rtol=0, atol=0)
    # A: PEFT's kaiming-uniform (+-1/sqrt(fan-in)), not zero; B: zero
    a = adapted.get_parameter("layers.0.attn.wq.lora_A.weight")
    assert 0.5 / config.d_model**0.5 < a.abs().max() <= 1 / config.d_model**0.5
    assert not adapted.get_parameter("layers.0.attn.wq.lora_B.weight").any()
    experts_a = adapted.get_parameter("layers.0.moe.experts.w2_lora_A")
    assert 0.5 / config.ffn_dim**0.5 < experts_a.abs().max() <= 1 / config.ffn_dim**0.5
    assert not torch.equal(experts_a[0], experts_a[1])  # each expert its own draw


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(rank=0), "rank=0"),
        (dict(targets=("q", "kv_proj")), "'kv_proj'"),
        (dict(dropout=1.0), "dropout=1.0"),
        (dict(targets=()), "empty"),
    ],
)
def test_bad_options_are_named(kwargs, words):
    with pytest.raises(ValueError, match=words):
        LoRA(**kwargs)


def test_a_bf16_base_computes_as_the_fp32_base_under_bf16_autocast():
    """bf16-mixed casts each matmul's weight to bf16 anyway: a base kept in bf16 gives the same
    logits and adapter grads, bit for bit, on both expert paths, in half the matrices' bytes."""
    config = ModelConfig(seq_len=SEQ)
    targets = ("attention", "experts")
    tokens = torch.randint(
        0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1)
    )
    for grouped in (False, True):
        runs = []
        for base_dtype in ("fp32", "bf16"):
            model = StageModel(config, lora=LoRA(targets=targets, base_dtype=base_dtype))
            model.init_weights(5)
            with torch.no_grad():  # B away from zero, as after some steps
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
            if grouped:
                probe_grouped_mm(model)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits, aux = model(tokens)
            (logits.float().square().mean() + aux.sum()).backward()
            runs.append((model, logits, adapters_of(model, grads=True)))
        (fp32, logits32, grads32), (bf16, logits16, grads16) = runs
        assert torch.equal(logits32, logits16)
        assert grads32.keys() == grads16.keys() and all(
            torch.equal(grads32[k], grads16[k]) for k in grads32
        )
        assert bf16.get_parameter("layers.0.attn.wq.weight").dtype == torch.bfloat16
        assert bf16.get_parameter("layers.0.moe.experts.w1").dtype == torch.bfloat16
        assert bf16.get_parameter("embed.weight").dtype == torch.float32  # a lookup: kept
        assert bf16.get_parameter("layers.0.attn.wq.lora_A.weight").dtype == torch.float32
        frozen = [(n, p) for n, p in fp32.named_parameters() if not p.requires_grad]
        bytes32 = sum(p.numel() * p.element_size() for _, p in frozen)
        bytes16 = sum(
            bf16.get_parameter(n).numel() * bf16.get_parameter(n).element_size() for n, _ in frozen
        )
        assert bytes16 < 0.6 * bytes32


def test_a_bf16_base_needs_bf16_mixed():
    from lightning_titan.lightning.module import check_base_precision

    check_base_precision(LoRA(base_dtype="bf16"), "bf16-mixed")
    with pytest.raises(ValueError, match="precision='32-true'.*bf16-mixed"):
        check_base_precision(LoRA(base_dtype="bf16"), "32-true")
