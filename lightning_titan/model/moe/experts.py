"""The SwiGLU experts one rank owns, stacked so that a rank's experts are contiguous rows.

Two ways to run them, equal within float rounding: one grouped GEMM per weight over all local experts
(``torch._grouped_mm`` with the row offsets, as torchtitan and Megatron do), or a Python loop of
per-expert matmuls. ``grouped_mm=None`` picks the grouped one where ``grouped_mm_dtype`` says the
device runs it well and this build runs it: ``probe_grouped_mm`` asks the build once at setup
(``Engine``), never in a forward, so a module nobody probed runs the loop. Under autocast the grouped
GEMMs take part in no autocast casts: they run in the autocast dtype by explicit casts (as torchtitan
does), the weights cast once per call, as the loop's matmuls do through autocast. Under expert
parallelism the rows arrive in the wire dtype (bf16 under bf16 autocast) while the weights stay fp32:
autocast reconciles the two, so that is the grouped path too. ``expert_gemm_paths`` says which path
each expert module took in its last forward.

On CUDA, torch's grouped kernel (sm90/sm100, bf16) wants int32 offsets on the device (a ``cumsum``
of the counts already there: no host-to-device copy) and 16-byte-aligned strides; each expert's
rows are padded to ``ALIGN_ROWS`` (as torchtitan pads its token groups), the padding kept out of the
result and of every gradient. Its other path (fp32, older GPUs) reads the offsets back to the host
on every call, so there the loop runs, on the split sizes the host already has.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from lightning_titan.model import recompute as recompute_
from lightning_titan.model.lora import LoRA
from lightning_titan.model.moe.activation import gated

ALIGN_ROWS = 16  # rows per expert a multiple of this on CUDA: 16 bytes of int8/fp8, tiles of bf16
_GROUPED_CUDA_MAJORS = (9, 10)  # torch's CUTLASS grouped GEMM: sm90 and sm100, bf16 only


def grouped_mm_dtype(
    device_type: str,
    capability: tuple[int, int] | None,
    rows_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    autocast_dtype: torch.dtype | None,
    d_model: int,
    ffn_dim: int,
    lora_rank: int = 0,
) -> torch.dtype | None:
    """The dtype the grouped GEMMs would run in on such a device, or None where the loop is better.

    ``rows_dtype``: the input rows' (under EP: the wire dtype); ``weight_dtype``: the expert
    weights'; ``autocast_dtype``: the device's autocast dtype where autocast is on; ``capability``:
    CUDA's compute capability; ``lora_rank``: the adapters' (its rows are strides too; 0: none).
    Whether this torch build has the kernel at all is
    ``grouped_mm_supported``'s question, not this one's.
    """
    if autocast_dtype is not None:
        compute = autocast_dtype  # rows and weights both cast to it, whatever they arrive in
    elif rows_dtype == weight_dtype:
        compute = rows_dtype
    else:  # nothing reconciles them: the loop's matmul names the mismatch
        return None
    if device_type == "cuda":
        aligned = all(n * compute.itemsize % 16 == 0 for n in (d_model, ffn_dim, lora_rank))
        fast = capability is not None and capability[0] in _GROUPED_CUDA_MAJORS
        return compute if fast and compute == torch.bfloat16 and aligned else None
    if device_type == "cpu":  # torch 2.13 runs fp32 and bf16 there (a loop in C++, no transfers)
        return compute if compute in (torch.float32, torch.bfloat16) else None
    return None


def row_alignment(device_type: str) -> int:
    """Rows per expert a multiple of this (padding) before the grouped GEMMs on this device."""
    return ALIGN_ROWS if device_type == "cuda" else 1


@functools.cache
def grouped_mm_supported(
    device: torch.device, dtype: torch.dtype, d_model: int, ffn_dim: int
) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here and equals per-group matmuls (a
    small probe, once per key; ``probe_grouped_mm`` runs it at setup)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        # cached for the process: setup may run under no_grad (an eval, a logits check), where the
        # probe's backward would fail and turn grouped GEMMs off for good
        with torch.inference_mode(False), torch.enable_grad():
            # two groups of ALIGN_ROWS rows: the offsets the weight-gradient GEMM (grouped over the
            # rows, its K dim) wants on CUDA; one-row groups fail there for a reason training never meets
            rows = 2 * ALIGN_ROWS
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(rows, d_model, generator=g).to(device, dtype).requires_grad_()
            w = torch.randn(2, d_model, ffn_dim, generator=g).to(device, dtype).requires_grad_()
            offsets = torch.tensor([ALIGN_ROWS, rows], device=device, dtype=torch.int32)
            out = torch._grouped_mm(x, w, offs=offsets)
            out.backward(torch.ones_like(out))
            half = ALIGN_ROWS
            want = torch.cat([x[:half] @ w[0], x[half:] @ w[1]])
            tol = 1e-3 if dtype == torch.float32 else 5e-2  # TF32 matmuls; bf16: 8 mantissa bits
            torch.testing.assert_close(out, want, rtol=tol, atol=tol * d_model**0.5)
    except (RuntimeError, NotImplementedError, TypeError, AssertionError):
        return False
    return True


def probe_grouped_mm(module: nn.Module) -> None:
    """Probe, for every ``GroupedExperts`` under ``module``, each dtype its forward could run the
    grouped GEMMs in on its device (fp32, bf16), so that no forward probes: a probe's backward
    inside an overlapped pair (``parallel/overlap.py``) would wait on autograd's device thread."""
    for experts in module.modules():
        if isinstance(experts, GroupedExperts):
            experts.probe()


def expert_gemm_paths(module: nn.Module) -> dict[str, str]:
    """Which expert GEMMs each ``GroupedExperts`` under ``module`` ran in its last forward, by name:
    ``"grouped bf16"``, ``"grouped fp32"``, ``"loop"`` (``"none"``: no forward yet)."""
    return {
        name: experts.last_gemm_path or "none"
        for name, experts in module.named_modules()
        if isinstance(experts, GroupedExperts)
    }


_SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming grad contiguous: ``_grouped_mm``'s backward rejects
    an expanded (stride-0) grad, e.g. that of ``out.sum()``, even with zero rows (which
    ``contiguous()`` leaves as they are)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return (
            grad.contiguous()
            if grad.numel()
            else torch.zeros_like(grad, memory_format=torch.contiguous_format)
        )


class GroupedExperts(nn.Module):
    """Global experts ``[start, end)`` of one MoE layer: ``y = (silu(x @ w1) * (x @ w3)) @ w2``.

    Layout (row ``e`` is global expert ``start + e``; ``y = x @ w``, so each slice is the transpose
    of the matching Hugging Face Mixtral ``nn.Linear.weight``):

    - ``w1`` (gate) [E_local, D, F]  -> ``block_sparse_moe.experts.{start+e}.w1.weight = w1[e].T``
    - ``w3`` (up)   [E_local, D, F]  -> ``... .w3.weight = w3[e].T``
    - ``w2`` (down) [E_local, F, D]  -> ``... .w2.weight = w2[e].T``

    With ``bias`` (gpt-oss) each projection adds its expert's bias ``b1``, ``b3`` [E_local, F] and
    ``b2`` [E_local, D]; ``swiglu_limit`` (gpt-oss) clamps the SwiGLU (``activation.gated``).

    With ``lora`` (``model/lora.py``) each projection ``w`` gets a per-expert adapter,
    ``x @ w + scale * (x @ w_lora_A) @ w_lora_B`` with ``w1_lora_A`` [E_local, D, r] and
    ``w1_lora_B`` [E_local, r, F] (``w2``'s: [E_local, F, r], [E_local, r, D]), run as grouped GEMMs
    over the same row offsets as the base's.

    ``recompute`` (selective recompute, ``model/recompute.py``): the activation's output (and its
    intermediates) is discarded once the down projection has read it, and recomputed from the gate
    and up projections in the backward, on either path.
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        expert_range: tuple[int, int],
        grouped_mm: bool | None = None,
        *,
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
        lora: LoRA | None = None,
        recompute: bool = False,
    ) -> None:
        super().__init__()
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        self.recompute = recompute
        # the grouped path's activation: ``model/compiled.py`` puts its compiled form here (the loop's
        # per-expert slices of 0 or 1 rows would each compile a graph of their own)
        self.gated = gated
        self.grouped_mm = grouped_mm  # None: where supported (see the module doc); False: the loop
        self.align_rows: int | None = (
            None  # rows per expert padded to a multiple (None: the device's)
        )
        start, end = expert_range
        if not 0 <= start < end:
            raise ValueError(f"expert_range={expert_range} must satisfy 0 <= start < end")
        self.expert_range = (start, end)
        # set by probe() at setup: whether this build's grouped GEMMs run here, per dtype (none
        # probed: the loop); and the path the last forward took (expert_gemm_paths)
        self.grouped_mm_runs: dict[torch.dtype, bool] = {}
        self.last_gemm_path: str | None = None
        n_local = end - start
        self.w1 = nn.Parameter(torch.empty(n_local, d_model, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_local, d_model, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(n_local, ffn_dim, d_model))
        self.b1 = nn.Parameter(torch.zeros(n_local, ffn_dim)) if bias else None
        self.b3 = nn.Parameter(torch.zeros(n_local, ffn_dim)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(n_local, d_model)) if bias else None
        self.lora_scale = 0.0 if lora is None else lora.scale
        self.lora_dropout = nn.Dropout(lora.dropout) if lora and lora.dropout else nn.Identity()
        self.lora_rank = 0 if lora is None else lora.rank
        for w in ("w1", "w3", "w2") if self.lora_rank else ():
            fan_in, fan_out = getattr(self, w).shape[1:]
            a = torch.zeros(n_local, fan_in, self.lora_rank)
            b = torch.zeros(n_local, self.lora_rank, fan_out)
            self.register_parameter(f"{w}_lora_A", nn.Parameter(a))
            self.register_parameter(f"{w}_lora_B", nn.Parameter(b))
        self.reset_parameters()

    @property
    def n_local(self) -> int:
        return self.expert_range[1] - self.expert_range[0]

    def adapters(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Each adapted projection's (A, B), read by name (``to_empty`` replaces the parameters)."""
        if not self.lora_rank:
            return {}
        return {
            w: (getattr(self, f"{w}_lora_A"), getattr(self, f"{w}_lora_B"))
            for w in ("w1", "w3", "w2")
        }

    @torch.no_grad()
    def merge_adapters_(self) -> None:
        """Each expert's ``w += scale * a @ b``, then ``b = 0`` (``lora.merge_``)."""
        for w, (a, b) in self.adapters().items():
            getattr(self, w).add_(torch.bmm(a, b).to(a.dtype), alpha=self.lora_scale)
            b.zero_()

    def reset_parameters(self, std: float = 0.02) -> None:
        # Placeholder values from the global RNG; StageModel.init_weights gives the layout-free ones.
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=std)

    def forward(
        self, x: Tensor, tokens_per_expert: list[int], counts: Tensor | None = None
    ) -> Tensor:
        """``x`` [N, D] holds the rows of local expert 0, then 1, ... with the given counts; ``counts``
        [E_local] the same counts on ``x``'s device (the grouped GEMMs' offsets come from it; without
        it they cost a host-to-device copy)."""
        if len(tokens_per_expert) != self.n_local:
            raise ValueError(
                f"got {len(tokens_per_expert)} row counts for {self.n_local} local experts"
            )
        if sum(tokens_per_expert) != x.shape[0]:
            raise ValueError(
                f"the row counts {tokens_per_expert} sum to {sum(tokens_per_expert)}, not to the "
                f"{x.shape[0]} rows of x"
            )
        dtype = self.grouped_dtype(x)
        self.last_gemm_path = (
            "loop" if dtype is None else f"grouped {_SHORT_NAMES.get(dtype, dtype)}"
        )
        if dtype is not None:
            if counts is None:
                counts = torch.tensor(tokens_per_expert, device=x.device)
            return self._grouped(x, tokens_per_expert, counts, dtype)
        return self._loop(x, tokens_per_expert)

    def _loop(self, x: Tensor, tokens_per_expert: list[int]) -> Tensor:
        # unbind, not w[e]: a select's backward writes its expert's grad into a zero-filled full
        # [E_local, D, F] tensor, E_local of them per weight; unbind's stacks the slices once
        w1, w3, w2 = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)
        biases = [b.unbind(0) if b is not None else None for b in (self.b1, self.b3, self.b2)]
        b1, b3, b2 = biases
        adapters = {w: (a.unbind(0), b.unbind(0)) for w, (a, b) in self.adapters().items()}

        def adapted(w: str, rows: Tensor, e: int) -> Tensor:  # the adapter's part, or 0
            if w not in adapters:
                return rows.new_zeros(())
            a, b = adapters[w]
            return (self.lora_dropout(rows) @ a[e]) @ b[e] * self.lora_scale

        # Empty slices still run, so every expert weight gets a (zero) gradient on every rank.
        outputs = []
        for e, rows in enumerate(torch.split(x, tokens_per_expert)):
            gate = rows @ w1[e] + adapted("w1", rows, e)
            up = rows @ w3[e] + adapted("w3", rows, e)
            if b1 is not None and b3 is not None:
                gate, up = gate + b1[e], up + b3[e]
            act = self._activation(gated, gate, up)
            out = act.discard_after(act.output @ w2[e] + adapted("w2", act.output, e))
            outputs.append(out if b2 is None else out + b2[e])
        return torch.cat(outputs)

    def _activation(
        self, fn: Any, gate: Tensor, up: Tensor
    ) -> recompute_.Recomputed | recompute_.Kept:
        """The gated activation ``fn`` (``gated`` or its compiled form) of ``gate`` and ``up``."""
        limit, alpha = self.swiglu_limit, self.swiglu_alpha
        return recompute_.run(
            lambda g, u: fn(g, u, limit, alpha), gate, up, recompute=self.recompute
        )

    def uses_grouped_mm(self, x: Tensor) -> bool:
        """Whether ``forward(x, ...)`` takes the grouped GEMMs."""
        return self.grouped_dtype(x) is not None

    def grouped_dtype(self, x: Tensor) -> torch.dtype | None:
        """The dtype ``forward(x, ...)`` runs the grouped GEMMs in, or None for the loop."""
        device = x.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        if self.grouped_mm is not None:
            return (autocast or x.dtype) if self.grouped_mm else None
        capability = torch.cuda.get_device_capability(x.device) if device == "cuda" else None
        d_model, ffn_dim = self.w1.shape[1:]
        dtype = grouped_mm_dtype(
            device, capability, x.dtype, self.w1.dtype, autocast, d_model, ffn_dim, self.lora_rank
        )
        # read, never probed here: probe() ran at setup (a module not probed runs the loop)
        return dtype if dtype is not None and self.grouped_mm_runs.get(dtype, False) else None

    def probe(self) -> None:
        """Ask this build, on the weights' device, whether the grouped GEMMs run in each dtype the
        decision could pick there (at setup: ``probe_grouped_mm``)."""
        device = self.w1.device
        if device.type == "meta":
            return
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        d_model, ffn_dim = self.w1.shape[1:]
        for dtype in (torch.float32, torch.bfloat16):
            if grouped_mm_dtype(device.type, capability, dtype, dtype, None, d_model, ffn_dim):
                runs = grouped_mm_supported(device, dtype, d_model, ffn_dim)
                self.grouped_mm_runs[dtype] = runs
                if not runs and device.type == "cuda":  # where it should run: say so, once per key
                    warnings.warn(
                        f"torch._grouped_mm failed its probe on {device} (capability {capability}) "
                        f"in {dtype} for experts of d_model={d_model}, ffn_dim={ffn_dim}: the "
                        "experts run the per-expert loop; check the torch build (CUDA 12.x, sm90+)",
                        stacklevel=2,
                    )

    def _grouped(
        self, x: Tensor, tokens_per_expert: list[int], counts: Tensor, dtype: torch.dtype
    ) -> Tensor:
        align = self.align_rows or row_alignment(x.device.type)
        counts, x = counts.to(torch.int32), x.to(dtype)  # the explicit cast: autocast's part
        rows = None  # each row's place among the padded rows (None: no padding)
        if align > 1:
            padded = (counts + (align - 1)) // align * align
            # per expert, how far its first row moves down: its padded start minus its start
            shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)
            rows = torch.arange(x.shape[0], device=x.device) + shift.repeat_interleave(
                counts,
                output_size=x.shape[0],  # a known size: no device sync
            )
            n_padded = sum(-(-n // align) * align for n in tokens_per_expert)
            # zero rows between the experts' blocks; index_copy's grad skips them
            x = x.new_zeros(n_padded, x.shape[1]).index_copy(0, rows, x)
            counts = padded
        # the end row of each local expert's block (an empty expert: the same end as the one before;
        # its weights get a zero gradient, as in the loop)
        offsets = counts.cumsum(0, dtype=torch.int32)
        x = x.contiguous()
        adapters = self.adapters()

        def project(
            rows: Tensor, w: str
        ) -> Tensor:  # rows @ w per expert, its adapter's part added
            out = torch._grouped_mm(rows, getattr(self, w).to(dtype), offs=offsets)
            if w in adapters:
                a, b = (f.to(dtype) for f in adapters[w])
                low = torch._grouped_mm(self.lora_dropout(rows), a, offs=offsets)
                out = out + torch._grouped_mm(low, b, offs=offsets) * self.lora_scale
            return out

        gate = self._add_bias(project(x, "w1"), self.b1, counts)
        up = self._add_bias(project(x, "w3"), self.b3, counts)
        act = self._activation(self.gated, gate, up)
        out = act.discard_after(project(act.output, "w2"))
        out = _ContiguousGrad.apply(self._add_bias(out, self.b2, counts))
        # the padding rows' outputs are zeros, left out here, so they get no gradient either
        return out if rows is None else out.index_select(0, rows)

    @staticmethod
    def _add_bias(y: Tensor, bias: Tensor | None, counts: Tensor) -> Tensor:
        """``y`` [N, C] (expert e's rows in the e-th block of ``counts`` [E_local] rows) plus each row's
        expert's ``bias`` [E_local, C]; padding rows get one too, but are left out of the result."""
        if bias is None:
            return y
        rows = bias.to(y.dtype).repeat_interleave(counts, dim=0, output_size=y.shape[0])
        return y + rows
