"""The training step is written once (``train/step.py``): every caller (TitanLM, the automatic
optimization path, the benchmarks, the test harness) runs ``TrainStep``, so what the equivalence
suite proves is the step users run. A second copy of the sequence would call the step's parts
itself: this finds any such call."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the parts only a step calls, in its order after the finish (Engine defines them)
STEP_PARTS = {"bind_shard_grads", "gather_params", "update_router_bias"}
HOME = ROOT / "lightning_titan" / "train" / "step.py"


def calls_of_step_parts(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.func.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in STEP_PARTS
    ]


def test_only_the_training_step_calls_the_parts_of_a_step():
    sources = [
        p for d in ("lightning_titan", "tests", "examples") for p in (ROOT / d).rglob("*.py")
    ]
    assert HOME in sources
    found = {p: calls_of_step_parts(p) for p in sources}
    assert sorted(c.split(" ")[1] for c in found.pop(HOME)) == sorted(STEP_PARTS)
    elsewhere = [c for calls in found.values() for c in calls]
    assert not elsewhere, f"the step's parts called outside train/step.py: {elsewhere}"
