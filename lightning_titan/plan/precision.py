"""The dtypes a run keeps and sends, by ``precision``: what ``titan plan`` prices each byte at.

Under ``bf16-mixed`` (Lightning's autocast) the parameters, their grads and AdamW's moments stay fp32;
autocast's matmuls return bf16, and the code that moves tensors between ranks sends what the receiver
computes in (``parallel/wire.py``). Measured on the model (a saved-tensor hook and a collective log
under ``torch.autocast("cpu", dtype=torch.bfloat16)``):

| tensor | 32-true | bf16-mixed |
|---|---|---|
| weights, grads (the data-parallel reduction), AdamW moments | fp32 | fp32 |
| matmul outputs saved for backward: q/k/v, RoPE'd q/k, attention, experts' hidden, logits | fp32 | bf16 |
| autocast's bf16 copies of the weights the matmuls read (saved for backward: the non-expert ones once per step, autocast caches them; an expert's ``w[e]`` view once per microbatch) | none | bf16 |
| RMSNorm outputs, the residual stream (a checkpointed block's input), router softmax and weights, the aux and z losses, the cross-entropy | fp32 | fp32 |
| EP all-to-alls, PP send/recv, CP key/value all-gathers (each way) | fp32 | bf16 |
| TP's sequence all-gathers (the norms' outputs) and reduce-scatters (the o-projection's, the embedding's), each way | fp32 | bf16 |

The activations themselves are not restated here: ``plan/activations.py`` meters the model under
the run's autocast, so every saved tensor has the dtype the run gives it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from lightning_titan.train.options import PRECISIONS  # what TitanStrategy accepts

STATE_BYTES = 4  # fp32 weights, grads and AdamW moments, under either precision


@dataclass(frozen=True)
class Precision:
    """The bytes per element of what ``titan plan`` prices, for one Lightning ``precision``."""

    name: str = "32-true"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"--precision={self.name!r} is not one of {PRECISIONS}")

    @property
    def mixed(self) -> bool:
        return self.name == "bf16-mixed"

    @property
    def wire(self) -> int:
        """Bytes per element of the EP, PP, CP and TP payloads (``parallel/wire.py``)."""
        return 2 if self.mixed else 4

    @property
    def weight_copy(self) -> int:
        """Bytes per element of autocast's copy of a weight a matmul reads (0: no copy)."""
        return 2 if self.mixed else 0

    def autocast(self) -> AbstractContextManager:
        """What the run computes under on the CPU: the metered probes enter this."""
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.mixed)

    def label(self) -> str:
        """The dtypes priced, for the table's footnote."""
        if not self.mixed:
            return "32-true: activations, wire and state fp32"
        return (
            "bf16-mixed: activations as autocast saves them (matmul outputs and weight copies "
            "bf16; norms, residual, router scores, losses fp32), EP/PP/CP/TP wire bf16, "
            "weights/grads/AdamW fp32"
        )


FP32 = Precision()  # the default everywhere a precision is not given: what the configs train in


def precision_of(trainer_precision: object) -> Precision:
    """The Precision of a Lightning precision setting (``"bf16-mixed"``, ``"32-true"``, ``32``)."""
    name = str(trainer_precision)
    return Precision({"32": "32-true", "bf16": "bf16-mixed"}.get(name, name))
