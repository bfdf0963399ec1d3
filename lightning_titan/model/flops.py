"""Model FLOPs per training step, and the peak they are a share of (MFU).

The count is that of the matmuls (2 FLOPs per multiply-add), as ``torch.utils.flop_counter
.FlopCounterMode`` counts them (tests/unit/test_flops.py checks the formula against it): per token and
layer the q/k/v/o projections, the attention scores and their weighted sum over the keys each query
attends to, as the causal kernels compute them (position ``i`` sees ``i`` keys: ``(S + 1) / 2`` on
average, the causal half published MFU counts use; a sliding-window layer, gpt-oss's even ones,
``min(window, i)``; FlopCounterMode counts the math backend's full ``S x S`` instead, and the test
takes the masked part off its count), the router, K SwiGLU experts and a shared expert; once per token the LM head. DeepSeek-V3's latent attention counts its down- and
up-projections (the keys and values expanded from the latent once per token), and its dense first
layers one SwiGLU in place of the router and experts. Training is 3x the forward (the backward computes the grads of
both operands of every matmul). Norms, softmax, dispatch and the optimizer are left out; so is the
recompute of activation checkpointing (a cost of the method, not of the model), and the experts are
counted dropless (capacity drops save some; MFU then reads low by that share).

The peak is per device: on a GPU its dense bf16 tensor-core peak from ``GPU_BF16_PEAK`` (the vendor's
datasheet numbers, without sparsity), on a CPU (or an unknown GPU) a short matmul probe at the dtype
the model trains in. ``TitanLM(peak_flops=...)`` overrides both.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from lightning_titan.model.options import LATENT

if TYPE_CHECKING:
    from lightning_titan.model.decoder import ModelConfig

# dense bf16 FLOP/s, by a substring of torch.cuda.get_device_name(); the first match wins, so the
# more specific names come first
GPU_BF16_PEAK: dict[str, float] = {
    "GH200": 989e12,
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
}


def attended_keys(seq_len: int, window: int = 0) -> int:
    """Keys the queries of one causal sequence attend to, summed over its positions: position ``i``
    (1-based) sees ``min(window, i)`` keys (``i`` without a window), as the causal and sliding-window
    kernels compute them (FlashAttention skips the masked blocks): ``S (S + 1) / 2`` causal,
    ``w (w + 1) / 2 + (S - w) w`` with a window of ``w < S``."""
    w = min(window, seq_len) if window else seq_len
    return w * (w + 1) // 2 + (seq_len - w) * w


def attention_flops_per_token(config: ModelConfig, window: int = 0) -> float:
    """FLOPs per token of one layer's scores (q.k) and weighted sum (of v), over the keys each query
    attends to on average (``attended_keys / S``); ``window``: a sliding-window layer's."""
    keys = attended_keys(config.seq_len, window) / config.seq_len
    if config.attention.kind == LATENT:
        latent = config.attention.latent
        width = config.n_heads * (latent.nope_dim + latent.rope_dim + latent.v_dim)
    else:
        width = 2 * config.n_heads * config.head_dim  # q.k over head_dim, then v's head_dim
    return 2 * keys * width


def layer_flops_per_token(config: ModelConfig, window: int = 0) -> tuple[float, float]:
    """Matmul FLOPs of one token's forward through (an MoE layer, a dense layer); ``window``: with
    sliding-window attention over that many keys."""
    d, hd = config.d_model, config.head_dim
    experts = config.experts
    q_width, kv_width = config.n_heads * hd, config.kv_heads * hd
    projections = 2 * d * (2 * q_width + 2 * kv_width)  # q and o; k and v
    if config.attention.kind == LATENT:
        projections = _latent_projections(config)
    attention = attention_flops_per_token(config, window)
    router = 2 * d * config.n_experts
    routed = config.top_k * 3 * 2 * d * config.ffn_dim  # gate, up, down per chosen expert
    shared = 3 * 2 * d * experts.shared_dim
    shared += 2 * d if experts.shared_dim and experts.shared_gated else 0
    dense_layer = projections + attention + 3 * 2 * d * experts.dense_ffn_dim
    return projections + attention + router + routed + shared, dense_layer


def mean_layer_flops_per_token(config: ModelConfig) -> float:
    """One MoE layer's forward FLOPs per token, its attention averaged over the model's full and
    sliding-window layers: what the planner prices a stage's layer at."""
    full, _ = layer_flops_per_token(config)
    windows = config.attention.window_layers(config.n_layers)
    if not windows:
        return full
    window, _ = layer_flops_per_token(config, config.attention.sliding_window)
    return (full * (config.n_layers - windows) + window * windows) / config.n_layers


def forward_flops_per_token(config: ModelConfig) -> float:
    """Matmul FLOPs of one token's forward through the whole model (see the module doc)."""
    moe_layer, dense_layer = layer_flops_per_token(config)
    dense, window = config.experts.dense_layers, config.attention.sliding_window
    head = 2 * config.d_model * config.vocab_size
    total = (config.n_layers - dense) * moe_layer + dense * dense_layer + head
    if window:  # the window layers (gpt-oss's even ones) see min(window, i) keys at position i
        saved = attention_flops_per_token(config) - attention_flops_per_token(config, window)
        total -= config.attention.window_layers(config.n_layers) * saved
    return total


def _latent_projections(config: ModelConfig) -> int:
    """Projection FLOPs per token of one multi-head latent attention (model/mla.py)."""
    latent = config.attention.latent
    d, h, rank = config.d_model, config.n_heads, latent.kv_rank
    qk, v = latent.nope_dim + latent.rope_dim, latent.v_dim
    q = 2 * d * h * qk
    if latent.q_rank:
        q = 2 * latent.q_rank * (d + h * qk)
    kv = 2 * d * (rank + latent.rope_dim) + 2 * rank * h * (latent.nope_dim + v)
    return q + kv + 2 * h * v * d


def training_flops_per_token(config: ModelConfig) -> float:
    """Forward and backward: 3x the forward's matmul FLOPs."""
    return 3 * forward_flops_per_token(config)


def step_flops(config: ModelConfig, tokens: int) -> float:
    """Model FLOPs of one training step over ``tokens`` tokens (the global batch's ``b * S``)."""
    return float(training_flops_per_token(config)) * tokens


def catalogue_peak(device: torch.device) -> float | None:
    """The device's dense bf16 peak from ``GPU_BF16_PEAK``, None for a CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_BF16_PEAK.items() if key in name), None)


def matmul_peak(
    device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.3
) -> float:
    """FLOP/s of the best of repeated ``n x n`` matmuls for about ``seconds`` (a probe of what this
    process gets: its threads, its share of a busy box)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up: the kernel choice, the caches
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def device_peak(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from)."""
    peak = catalogue_peak(device)
    if peak is not None:
        return peak, f"{torch.cuda.get_device_name(device)} bf16 dense (catalogue)"
    probe_dtype = torch.bfloat16 if device.type == "cuda" else dtype
    return matmul_peak(device, probe_dtype), f"{device.type} {probe_dtype} matmul probe"
