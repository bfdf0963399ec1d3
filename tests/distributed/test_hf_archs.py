"""init_from for Qwen3-MoE, OLMoE, Qwen2-MoE and gpt-oss folders: our decoder with the family's options equals
transformers' model, under one process and under several layouts, trains the same under each, and
exports back to a folder transformers loads with our logits.

The folders are tiny random models built offline (tests/hf_tiny.py), saved sharded with an index.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_tiny import FAMILIES, VOCAB, build, save_tokenizer
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_titan.hf import load as hf_load
from lightning_titan.hf.arch import architecture_of, hf_names
from lightning_titan.hf.export import hf_state_dict, write_hf_folder
from lightning_titan.lightning.module import TitanLM
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups
from lightning_titan.parallel.tensor_parallel import local_slice, tp_shards
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.train.engine import Engine
from lightning_titan.train.step import TrainStep

SEQ_LEN = 16
GLOBAL_BATCH = 8
STEPS = 3
TRAINING = ModelConfig(seq_len=SEQ_LEN, aux_loss_coef=0.0, z_loss_coef=0.0)
# (family, (dp, pp, ep, tp[, cp]), zero): every family under dp2 x pp2 x ep2 (ZeRO-1, Qwen2-MoE
# ZeRO-2) and tp2 x pp2 x ep2; OLMoE's whole-projection QK-norm also under ep2 x tp2 x cp2
# (DeepSeek-V3 trains under its layouts in test_equivalence.py; here its slices load under TP)
LAYOUTS = [(f, (2, 2, 2, 1), 2 if f == "qwen2_moe" else 1) for f in FAMILIES if "deepseek" not in f]
LAYOUTS += [(f, (1, 2, 2, 2), 0) for f in FAMILIES if f != "deepseek_v3-qproj"]
LAYOUTS += [("olmoe", (1, 1, 2, 2, 2), 0)]
# gpt-oss: ZeRO-2 on its dp2 x pp2 x ep2 above; its window layers and sinks under cp2 x pp2 x ep2
LAYOUTS = [(f, lay, 2 if f == "gpt_oss" and lay[0] == 2 else z) for f, lay, z in LAYOUTS]
LAYOUTS += [("gpt_oss", (1, 2, 2, 1, 2), 0)]


def token_loss_sum(logits_MSV: torch.Tensor, targets_MS: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits_MSV.float().flatten(0, 1), targets_MS.flatten(), reduction="sum"
    )


def global_tokens(step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(5 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("hf_archs")
    out = {}
    for family in FAMILIES:
        model = build(family, root / family)
        assert (root / family / hf_load.INDEX_FILE).is_file()
        save_tokenizer(root / family)
        out[family] = (root / family, model)
    return out


def originals(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def full_model(folder: Path) -> StageModel:
    model = StageModel(hf_load.config_from_folder(folder, TRAINING))
    hf_load.load_stage(model, folder)
    return model


def test_the_family_options_come_from_the_folder(folders):
    options = ("qk_norm", "attn_head_dim", "router_norm_topk", "qkv_bias", "shared_expert_dim")
    want = {
        "qwen3_moe": ("head", 12, True, False, 0),
        "olmoe": ("full", None, False, False, 0),
        "qwen2_moe": ("none", None, False, True, 20),
        "gpt_oss": ("none", 12, True, True, 0),
        "deepseek_v3": ("none", None, True, False, 24),
        "deepseek_v3-qproj": ("none", None, False, False, 48),
    }
    deepseek = ("q_lora_rank", "kv_lora_rank", "router_groups", "router_topk_groups")
    deepseek += ("routed_scaling", "dense_layers", "dense_ffn_dim", "rope_interleave")
    want_deepseek = {
        "deepseek_v3": (16, 12, 2, 1, 2.5, 1, 40, True),
        "deepseek_v3-qproj": (0, 12, 1, 1, 1.5, 0, 0, False),
    }
    for family, (folder, _) in folders.items():
        config = hf_load.config_from_folder(folder, TRAINING)
        assert tuple(getattr(config, o) for o in options) == want[family], family
        assert (config.d_model, config.ffn_dim, config.n_experts, config.top_k) == (32, 24, 4, 2)
        assert architecture_of(config).model_type == family.split("-")[0]
        if family in want_deepseek:
            assert tuple(getattr(config, o) for o in deepseek) == want_deepseek[family], family


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_equals_transformers_and_exports_the_folder_back(folders, family, tmp_path):
    folder, theirs = folders[family]
    model = full_model(folder).eval()
    tokens = global_tokens()
    with torch.no_grad():
        want = theirs(input_ids=tokens[:, :-1]).logits
        got, _ = model(tokens[:, :-1])
        their_loss = theirs(input_ids=tokens, labels=tokens).loss.item()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    engine = Engine(model, ParallelDims(1, 1, 1, 0), ProcessGroups(None, None, None, None))
    step = engine.forward_backward(model, tokens[:, :-1], tokens[:, 1:], 2, token_loss_sum)
    engine.remove()
    assert step.loss.item() == pytest.approx(their_loss, rel=1e-5)
    if family.startswith("deepseek_v3"):
        assert_grads_equal(model, theirs, tokens)
    exported, original = hf_state_dict(model), originals(folder)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    if family.startswith("deepseek_v3"):  # the folder we write: transformers' logits are ours
        import transformers

        out = write_hf_folder(model, tmp_path / family)
        assert hf_load.config_from_folder(out, TRAINING) == model.config
        exported_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            logits = exported_model(input_ids=tokens[:, :-1]).logits
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
        return  # its grads were checked above, the fused experts' included
    # one step's grads: ours (of the same mean loss), laid out as theirs by the export's mapping
    model.zero_grad(set_to_none=True)
    got, _ = model(tokens[:, :-1])
    token_loss_sum(got, tokens[:, 1:]).div(tokens[:, 1:].numel()).backward()
    theirs.zero_grad(set_to_none=True)
    theirs(input_ids=tokens, labels=tokens).loss.backward()
    their_grads = {n: p.grad for n, p in theirs.named_parameters()}
    theirs.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.data = p.grad
    ours = hf_state_dict(model)
    # transformers 5 fuses the other families' experts in memory (not in the file): those aside
    common = set(ours) & set(their_grads)
    unmatched = set(ours) - common if family == "gpt_oss" else set(their_grads) - common
    assert all(".experts." in n for n in unmatched) and (family != "gpt_oss" or not unmatched)
    for name in common:
        torch.testing.assert_close(ours[name], their_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def assert_grads_equal(model: StageModel, theirs: torch.nn.Module, tokens: torch.Tensor) -> None:
    """Every weight's grad of one step equals transformers' (``model`` holds its step's grads): the
    experts against transformers' fused ``gate_up_proj`` / ``down_proj``."""
    theirs.zero_grad()
    theirs(input_ids=tokens, labels=tokens).loss.backward()
    their_grads = {n: p.grad for n, p in theirs.named_parameters()}
    arch = architecture_of(model.config)
    for name, p in model.named_parameters():
        if ".moe.experts." in name:
            block = hf_names(name, (0, 1), arch)[0].rsplit(".experts.", 1)[0] + ".experts."
            gate, up = their_grads[block + "gate_up_proj"].chunk(2, dim=1)
            want = {"w1": gate, "w3": up, "w2": their_grads[block + "down_proj"]}[name[-2:]]
            want = want.transpose(1, 2)
        else:
            want = their_grads[hf_names(name, (0, 1), arch)[0]]
        torch.testing.assert_close(
            p.grad, want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def finetune(model: StageModel, engine: Engine, dims: ParallelDims) -> list[float]:
    """STEPS AdamW steps on this rank's rows of the global batches; the global loss of each."""
    # eps bounds how much AdamW amplifies the last bits of a small grad, which depend on the
    # summation order of the layout (the loaded weights are large: the grads are small and varied)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-3)
    engine.shard_optimizers([optimizer])
    b = GLOBAL_BATCH // dims.data_world
    rows = slice(dims.data_rank * b, (dims.data_rank + 1) * b)
    loss_fn = model.token_loss_sum if dims.tp > 1 else token_loss_sum
    train_step = TrainStep(engine, optimizer, max_norm=1.0)
    losses = []
    for step in range(STEPS):
        tokens = global_tokens(step)
        result = train_step.run(model, tokens[rows, :-1], tokens[rows, 1:], 2, loss_fn, index=step)
        losses.append(result.loss)
    return losses


@torch.no_grad()
def pipeline_logits(model: StageModel, dims: ParallelDims) -> torch.Tensor | None:
    """This rank's rows of the first global batch through the pipeline by plain send/recv: the last
    stage's logits [b, S, V/tp], None elsewhere."""
    import torch.distributed as dist

    b = GLOBAL_BATCH // dims.data_world
    x = global_tokens()[dims.data_rank * b : (dims.data_rank + 1) * b, :-1]
    if not dims.is_first_stage:
        hidden = torch.empty(b, SEQ_LEN // dims.tp, model.config.d_model)
        dist.recv(hidden, src=dims.prev_stage_rank)
        x = hidden
    out, _ = model(x)
    if not dims.is_last_stage:
        dist.send(out.contiguous(), dst=dims.next_stage_rank)
        return None
    return out


def _on_ranks(rank: int, world_size: int, folders: dict[str, str], cases: list) -> list[dict]:
    torch.manual_seed(rank)  # a different global RNG per rank must not matter
    results = []
    for family, layout, zero in cases:
        dims = ParallelDims(*layout[:3], rank, tp=layout[3], cp=layout[4] if len(layout) > 4 else 1)
        groups = build_process_groups(dims)
        config = hf_load.config_from_folder(folders[family], TRAINING)
        model = StageModel(
            config, pp_rank=dims.pp_rank, pp=dims.pp, ep_rank=dims.ep_rank, ep=dims.ep,
            ep_group=groups.ep, tp_group=groups.tp, cp_group=groups.cp,
            sequence_group=groups.sequence,
        )  # fmt: skip
        read = hf_load.load_stage(model, folders[family])
        engine = Engine(model, dims, groups, schedule="1f1b", bucket_cap_mb=0.01, zero=zero)
        engine.broadcast_replicated()
        loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
        logits = pipeline_logits(model, dims) if dims.cp == 1 else None
        losses = finetune(model, engine, dims)
        engine.remove()
        names = {id(p): n for n, p in model.named_parameters()}
        results.append({
            "loaded": loaded, "logits": logits, "losses": losses, "read": read,
            "end": {n: p.detach().clone() for n, p in model.named_parameters()},
            "expert_range": model.expert_range, "tp": (dims.tp, dims.tp_rank),
            "cut": {names[i]: s.dim for i, s in tp_shards(model).items()},
            "rows": dims.data_rank, "data_world": dims.data_world,
            "bias_bytes": sum(b.numel() * 4 for n, b in model.named_buffers() if "expert_bias" in n),
        })  # fmt: skip
    return results


def expected(r: dict, name: str, full: torch.Tensor) -> torch.Tensor:
    start, end = r["expert_range"]
    full = full[start:end] if ".moe.experts." in name else full
    return local_slice(full, r["cut"][name], *r["tp"]) if name in r["cut"] else full


def one_process_finetune(folder: Path) -> tuple[list[float], StageModel]:
    model = full_model(folder)
    engine = Engine(model, ParallelDims(1, 1, 1, 0), ProcessGroups(None, None, None, None))
    losses = finetune(model, engine, ParallelDims(1, 1, 1, 0))
    engine.remove()
    return losses, model.eval()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_eight_ranks_load_their_slice_match_transformers_and_train_as_one_process(
    folders, tmp_path
):
    import transformers

    paths = {f: str(folder) for f, (folder, _) in folders.items()}
    per_rank = run_on_ranks(_on_ranks, 8, paths, LAYOUTS, timeout_s=400, start_method="fork")
    tokens = global_tokens()
    for family, (folder, theirs) in folders.items():
        if family not in {f for f, _, _ in LAYOUTS}:
            continue
        full = {n: p.detach() for n, p in full_model(folder).named_parameters()}
        with torch.no_grad():
            their_logits = theirs(input_ids=tokens[:, :-1]).logits
            their_loss = theirs(input_ids=tokens, labels=tokens).loss.item()
        ref_losses, tuned = one_process_finetune(folder)
        assert ref_losses[0] == pytest.approx(their_loss, rel=1e-5), family
        ref_end = {n: p.detach() for n, p in tuned.named_parameters()}
        total = sum(t.numel() * t.element_size() for t in originals(folder).values())
        for i, (case_family, layout, _) in enumerate(LAYOUTS):
            if case_family != family:
                continue
            held = set()
            for rank in range(8):
                r, where = per_rank[rank][i], (family, layout, rank)
                for name, local in r["loaded"].items():
                    assert torch.equal(local, expected(r, name, full[name])), (*where, name)
                    torch.testing.assert_close(
                        r["end"][name], expected(r, name, ref_end[name]), rtol=0, atol=1e-5,
                        msg=lambda m, w=(*where, name): f"{w}: {m}",
                    )  # fmt: skip
                held |= set(r["loaded"])
                torch.testing.assert_close(r["losses"], ref_losses, rtol=1e-5, atol=0)
                if r["logits"] is not None:
                    b = GLOBAL_BATCH // r["data_world"]
                    want = their_logits[r["rows"] * b : (r["rows"] + 1) * b]
                    want = local_slice(want, 2, *r["tp"])
                    torch.testing.assert_close(r["logits"], want, rtol=0, atol=1e-4)
                # pp2 x ep2: half the layers, half of their experts, one of embedding / LM head
                # (Qwen2-MoE's shared experts are whole on every EP rank: 0.35); no more bytes
                # than the rank holds, exactly those without TP's vocabulary padding
                share = (0.15, 0.4) if layout[1] == 2 else (0.3, 0.6)  # pp1: ep2 x tp2 only
                assert share[0] < r["read"] / total < share[1], (*where, r["read"], total)
                held_bytes = sum(t.numel() * t.element_size() for t in r["loaded"].values())
                held_bytes += r["bias_bytes"]  # DeepSeek-V3's expert biases are read too
                assert r["read"] == held_bytes if layout[3] == 1 else r["read"] <= held_bytes
            assert held == set(full), (family, layout)
        # the fine-tune exports to its family: transformers loads it and gives our logits
        out = write_hf_folder(tuned, tmp_path / family)
        exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(exported) is type(theirs)
        with torch.no_grad():
            ours, _ = tuned(tokens[:, :-1])
            torch.testing.assert_close(
                exported(input_ids=tokens[:, :-1]).logits, ours, rtol=0, atol=1e-4
            )
            assert not torch.allclose(their_logits, ours, atol=1e-3)


# -- bad input: each an error naming the field or tensor, from TitanLM, before any rank starts --------
def _edited(src: Path, dst: Path, config_edit=None, tensors_edit=None) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config_edit(config) if config_edit else config))
    tensors = originals(src)
    save_file(tensors_edit(tensors) if tensors_edit else tensors, str(dst / "model.safetensors"))
    return dst


REFUSED = [
    ("qwen2_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported"),
    ("qwen2_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2 .* layers \[0, 2\] dense"),
    (
        "qwen2_moe",
        {"use_sliding_window": True, "sliding_window": 8},
        r"sliding_window=8 < seq_len=16",
    ),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, r"shared_expert_intermediate_size=0"),
    ("qwen3_moe", {"attention_bias": True}, r"attention_bias=True is not supported"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2 is not supported"),
    ("olmoe", {"clip_qkv": 8.0}, r"clip_qkv=8.0 is not supported"),
    (
        "gpt_oss",
        {"layer_types": ["full_attention", "sliding_attention"] * 2},
        r"layer_types=.*alternate",
    ),
    ("gpt_oss", {"quantization_config": {"quant_method": "fp8"}}, r"quantization_config=.*MXFP4"),
    ("olmoe", {"model_type": "deepseek_v2"}, r"model_type='deepseek_v2' is not supported"),
    (
        "deepseek_v3",
        {"quantization_config": {"quant_method": "fp8"}},
        r"quantization_config=.*bf16",
    ),
    ("deepseek_v3", {"num_key_value_heads": 2}, r"num_key_value_heads=2 is not supported"),
    (
        "deepseek_v3",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
        r"rope_parameters=",
    ),
    ("olmoe", {"architectures": ["Qwen3MoeForCausalLM"]}, r"architectures=.*'OlmoeForCausalLM'"),
]


@pytest.mark.parametrize("family,fields,match", REFUSED)
def test_unsupported_family_configs_are_refused(folders, tmp_path, family, fields, match):
    folder = _edited(folders[family][0], tmp_path / "bad", lambda c: {**c, **fields})
    with pytest.raises(ValueError, match=match):
        TitanLM(TRAINING, init_from=str(folder))


@pytest.mark.parametrize(
    "family,given,match",
    [
        ("olmoe", {"qk_norm": "head"}, r"qk_norm='head' .* disagrees with .*model_type='olmoe'"),
        (
            "qwen2_moe",
            {"shared_expert_dim": 8},
            r"shared_expert_dim=8 .*shared_expert_intermediate_size=20",
        ),
        ("qwen3_moe", {"router_norm_topk": False}, r"router_norm_topk=False .*norm_topk_prob=True"),
        ("qwen3_moe", {"attn_head_dim": 8}, r"attn_head_dim=8 .*head_dim=12"),
        ("qwen2_moe", {"ffn_dim": 40}, r"ffn_dim=40 .*moe_intermediate_size=24"),
        ("deepseek_v3", {"routed_scaling": 3.0}, r"routed_scaling=3.0 .*routed_scaling_factor=2.5"),
        ("deepseek_v3", {"router_groups": 4}, r"router_groups=4 .*n_group=2"),
    ],
)
def test_a_given_field_that_disagrees_with_the_folder_is_named(folders, family, given, match):
    with pytest.raises(ValueError, match=match):
        TitanLM(ModelConfig(seq_len=SEQ_LEN, **given), init_from=str(folders[family][0]))


@pytest.mark.parametrize(
    "family,name,shape,match",
    [
        (
            "qwen3_moe",
            "model.layers.2.self_attn.q_norm.weight",
            None,
            "'layers.2.attn.q_norm.weight'",
        ),
        ("qwen2_moe", "model.layers.1.self_attn.k_proj.bias", None, "'layers.1.attn.wk.bias'"),
        ("qwen2_moe", "model.layers.3.mlp.shared_expert_gate.weight", None, "shared_expert.gate"),
        ("olmoe", "model.layers.1.self_attn.k_norm.weight", (8,), r"\[8\] but our .* needs \[16\]"),
        (
            "qwen2_moe",
            "model.layers.0.mlp.shared_expert.up_proj.weight",
            (24, 32),
            r"w3.* \[20, 32\]",
        ),
    ],
)
def test_missing_and_misshaped_family_tensors_are_named(
    folders, tmp_path, family, name, shape, match
):
    def edit(tensors):
        return {k: v for k, v in tensors.items() if k != name} | (
            {name: torch.zeros(shape)} if shape else {}
        )

    folder = _edited(folders[family][0], tmp_path / "bad", tensors_edit=edit)
    with pytest.raises(ValueError, match=rf"{name}.*{match}"):
        TitanLM(TRAINING, init_from=str(folder))


def test_a_layout_that_does_not_divide_a_family_model_is_named(folders):
    lm = TitanLM(TRAINING, init_from=str(folders["qwen3_moe"][0]))
    with pytest.raises(ValueError, match=r"n_kv_heads=2 is not divisible by tp=4"):
        lm.check_layout(ParallelDims(1, 1, 1, 0, tp=4))
    lm = TitanLM(TRAINING, init_from=str(folders["olmoe"][0]))
    with pytest.raises(ValueError, match=r"n_experts=4 is not divisible by ep=3"):
        lm.check_layout(ParallelDims(1, 1, 3, 0))


def test_a_model_no_family_holds_is_refused_before_anything_is_written(tmp_path):
    for options, match in [
        ({"router_score": "sigmoid"}, "router_score='sigmoid'"),
        ({"qk_norm": "head", "shared_expert_dim": 8}, "qk_norm='head' with shared_expert_dim=8"),
        ({"router_norm_topk": False}, "router_norm_topk=False without"),
        ({"attn_head_dim": 8, "n_heads": 4}, "attn_head_dim=8 without QK-norm"),
        ({"sliding_window": 8}, "sliding_window=8 without attn_sinks"),
        ({"attn_sinks": True}, "attn_sinks=True with expert_proj_bias=False"),
        ({"dense_layers": 1, "dense_ffn_dim": 8}, "dense_layers=1 without multi-head latent"),
        (
            {"kv_lora_rank": 8, "qk_rope_head_dim": 4, "v_head_dim": 4, "router_score": "sigmoid"},
            "router_expert_bias=False with kv_lora_rank=8",
        ),
    ]:
        model = StageModel(ModelConfig(n_layers=2, **options))
        with pytest.raises(ValueError, match=match):
            write_hf_folder(model, tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_our_own_family_exports_load_back(tmp_path):
    """From scratch with each family's options: the export is a folder init_from takes, with the same
    config and every weight."""
    for options in (
        {"qk_norm": "head", "attn_head_dim": 6, "router_norm_topk": False},
        {"qk_norm": "full", "router_norm_topk": False},
        {"shared_expert_dim": 16, "qkv_bias": True},
        {
            "attn_sinks": True,
            "qkv_bias": True,
            "attn_out_bias": True,
            "sliding_window": 4,
            "expert_proj_bias": True,
            "router_bias": True,
            "swiglu_limit": 7.0,
            "rope_yarn": {"factor": 8.0, "original_max_position_embeddings": 8},
        },
        {  # DeepSeek-V3 with a moved expert bias (exported as e_score_correction_bias)
            "kv_lora_rank": 8,
            "q_lora_rank": 12,
            "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 4,
            "v_head_dim": 6,
            "router_score": "sigmoid",
            "router_expert_bias": True,
            "shared_expert_dim": 256,
            "shared_expert_gated": False,
            "router_groups": 2,
            "dense_layers": 1,
            "dense_ffn_dim": 40,
            "routed_scaling": 2.0,
            "n_kv_heads": 4,
        },
    ):
        config = ModelConfig(**{"n_kv_heads": 2, "seq_len": SEQ_LEN, "n_layers": 2, **options})
        model = StageModel(config)
        model.init_weights(3)
        for name, bias in model.named_buffers():
            if name.endswith("expert_bias"):
                bias.copy_(torch.randn(bias.shape))
        out = write_hf_folder(model, tmp_path / str(len(list(tmp_path.iterdir()))))
        loaded = TitanLM(ModelConfig(seq_len=SEQ_LEN), init_from=str(out)).config
        assert loaded == config
        again = full_model(out)
        held = again.state_dict()
        for name, tensor in model.state_dict().items():  # the expert biases too
            assert torch.equal(held[name], tensor), name
        shutil.rmtree(out)
