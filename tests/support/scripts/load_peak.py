"""Peak resident memory while one rank loads its stage: python tests/support/scripts/load_peak.py HF_DIR OUT.json

Builds the stage of (pp_rank, ep_rank) = (1, 1) of pp2 x ep2, resets the kernel's high-water mark of
resident memory (/proc/self/clear_refs), loads the stage from HF_DIR and writes, to OUT.json, how far
the peak rose above the resident size before the load, the bytes read and the stage's own bytes."""

import json
import sys
from pathlib import Path

import torch

from lightning_titan.hf import load as hf_load
from lightning_titan.model.decoder import ModelConfig, StageModel


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main(folder: str, out: str) -> None:
    torch.set_num_threads(1)
    config = hf_load.config_from_folder(folder, ModelConfig(seq_len=16))
    model = StageModel(config, pp_rank=1, pp=2, ep_rank=1, ep=2)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the resident size now
    before = status_kb("VmRSS")
    read = hf_load.load_stage(model, folder)
    peak = status_kb("VmHWM")
    Path(out).write_text(json.dumps({"rise": (peak - before) * 1024, "read": read, "held": held}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
