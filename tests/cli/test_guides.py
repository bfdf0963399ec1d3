"""docs/lora.md and the chat fine-tune of docs/finetuning.md run as written (tests/support/guides.py:
their python blocks saved under their names, their bash blocks run with this checkout's ``titan``),
with a few training steps instead of the guides' own."""

from __future__ import annotations

from pathlib import Path

import pytest
from guides import run_guide

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_lora_guide_runs(tmp_path):
    text = (ROOT / "docs" / "lora.md").read_text()
    proc = run_guide(text, tmp_path, {"--trainer.max_steps=20": "--trainer.max_steps=3"}, 500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "LoRA" in proc.stdout + proc.stderr  # the end summary's trained-parameter line
    # generate.py: the PEFT adapter on the base and the merged fp32 model give the same logits
    assert proc.stdout.strip().splitlines()[-1].startswith("True "), proc.stdout[-500:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_chat_fine_tune_guide_runs(tmp_path):
    page = (ROOT / "docs" / "finetuning.md").read_text()
    start = page.index("### End to end: a chat fine-tune")
    text = page[start : page.index("### Formats, templates, masks")]
    proc = run_guide(text, tmp_path, {"--trainer.max_steps=30": "--trainer.max_steps=3"}, 500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "packing efficiency" in proc.stderr  # the chats were packed
    answer = proc.stdout.strip().splitlines()[-1]
    assert answer.startswith("'") and answer.endswith("'"), answer  # chat.py's decoded answer
