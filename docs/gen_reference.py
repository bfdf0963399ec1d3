"""Write docs/reference.md from the code: every argument of the strategy, model, data module and
callbacks (name, type, default, CLI flag, docstring), and the configs in configs/ with what they cost.

python docs/gen_reference.py            # rewrite docs/reference.md
python docs/gen_reference.py --check    # exit 1 if docs/reference.md is stale (the test suite runs this)

Nothing here is written by hand twice: a new argument, a changed default or a new config shows up
after a rerun, and the test fails until it is rerun.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path

import docstring_parser
import torch

from lightning_titan import LoRA, ModelConfig, StageModel, TitanDataModule, TitanLM, TitanStrategy
from lightning_titan.lightning.callbacks import ExpertLoad, PipelineTimeline
from lightning_titan.lightning.config_files import compose_config
from lightning_titan.model.grad_kinds import split_expert_parameters
from lightning_titan.parallel.tensor_parallel import padded_vocab, tp_shards

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "docs" / "reference.md"

# arguments the CLI sets from another one (LightningCLI link_arguments in lightning_titan/cli.py)
LINKED = {
    "--data.seq_len": "--model.model.seq_len",
    "--model.seed": "--seed_everything",
    "--data.seed": "--seed_everything",
}

# ModelConfig documents some fields with trailing comments only; these cover the others.
MODEL_FIELD_DOCS = {
    "d_model": "hidden size D of the residual stream.",
    "n_layers": "transformer blocks L; `pp` must divide it.",
    "n_heads": "attention heads; must divide `d_model`, with an even head size.",
    "n_experts": "experts E in every MoE layer; `ep` must divide it.",
    "top_k": "experts each token is sent to (K).",
    "seq_len": "tokens per sequence S; the CLI sets the data module's `seq_len` to it.",
    "rope_theta": "RoPE base frequency.",
    "norm_eps": "RMSNorm epsilon.",
    "init_std": "standard deviation of the initial weights (output projections scaled by 1/sqrt(2L)).",
    "activation_checkpointing": "what the backward recomputes instead of keeping: `false` / "
    "`none`; `true` / `full`: each block (its input kept); `selective`: the norms and the "
    "experts' gated activations ([Saving memory](saving_memory.md#recompute)).",
}


def _docs(cls: type) -> dict[str, str]:
    doc = inspect.cleandoc(cls.__doc__ or "")
    if doc.startswith("Args:"):  # opens with its Args section, arguments not indented under it
        doc = "Arguments.\n\nArgs:\n" + textwrap.indent(
            doc.removeprefix("Args:").strip("\n"), "    "
        )
    return {
        p.arg_name: " ".join((p.description or "").split())
        for p in docstring_parser.parse(doc).params
    }


def _summary(cls: type) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    return "" if doc.startswith("Args:") else " ".join(doc.split("\n\n")[0].split())


def _field_comments(cls: type) -> dict[str, str]:
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"\s+(\w+):[^#]*#\s*(.+)$", line)
        if match:
            comments[match[1]] = match[2].strip()
    return comments


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flag(flag: str) -> str:
    return f"set by `{LINKED[flag]}`" if flag in LINKED else f"`{flag}`"


def _table(rows: list[tuple[str, str, str, str, str]]) -> list[str]:
    lines = ["| argument | type | default | CLI flag | description |", "|---|---|---|---|---|"]
    for name, kind, default, flag, doc in rows:
        lines.append(
            f"| `{name}` | `{_cell(kind)}` | `{_cell(default)}` | {_flag(flag)} | {_cell(doc) or '—'} |"
        )
    return lines


def _signature_rows(cls: type, flag_prefix: str, skip: tuple[str, ...] = ()) -> list[tuple]:
    docs = _docs(cls)
    rows = []
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if (
            name == "self"
            or name in skip
            or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL)
        ):
            continue
        kind = (
            param.annotation
            if isinstance(param.annotation, str)
            else inspect.formatannotation(param.annotation)
        )
        # a named alias (e.g. ``Schedule``): the values it allows, as the CLI's help shows them
        alias = getattr(sys.modules[cls.__module__], kind, None)
        if typing.get_origin(alias) is typing.Literal:
            kind = f"Literal{list(typing.get_args(alias))}"
        default = "required" if param.default is param.empty else repr(param.default)
        rows.append((name, kind, default, f"{flag_prefix}{name}", docs.get(name, "")))
    return rows


def _lightning_strategy_args() -> list[str]:
    from lightning.pytorch.strategies import ParallelStrategy

    params = inspect.signature(ParallelStrategy.__init__).parameters
    return [name for name in params if name != "self"]


def _model_rows() -> list[tuple]:
    comments = _field_comments(ModelConfig)
    rows = []
    for field in dataclasses.fields(ModelConfig):
        doc = comments.get(field.name) or MODEL_FIELD_DOCS.get(field.name, "")
        rows.append(
            (field.name, str(field.type), repr(field.default), f"--model.model.{field.name}", doc)
        )
    return rows


def _numel_on_rank(p: torch.Tensor, cut: dict, tp: int) -> int:
    """A TP-cut weight's padded 1/tp, any other parameter whole."""
    if id(p) not in cut:
        return p.numel()
    rows = p.shape[cut[id(p)].dim]
    return p.numel() // rows * (padded_vocab(rows, tp) // tp)


def _params_per_rank(model: ModelConfig, pp: int, ep: int, tp: int) -> tuple[int, int]:
    """(expert, non-expert) parameters of the largest rank."""
    counts = []
    for pp_rank in range(pp):
        stage = StageModel(model, pp_rank=pp_rank, pp=pp, ep_rank=0, ep=ep)
        cut = tp_shards(stage)
        expert, other = (
            sum(_numel_on_rank(p, cut, tp) for _, p in part)
            for part in split_expert_parameters(stage)
        )
        counts.append((expert + other, expert, other))
    _, expert, other = max(counts)
    return expert, other


def _configs_table() -> list[str]:
    lines = [
        "| config | ranks | dp, pp, ep, tp, cp | schedule | M | sequences per microbatch | bubble (P-1)/(M+P-1) "
        "| params on the largest rank (expert + other) | params + grads + AdamW, fp32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if path.stem == "base":  # what the layouts share, not a layout
            continue
        config = compose_config(path)
        strategy = config["trainer"]["strategy"]["init_args"]
        if strategy.get("layout") == "auto":  # the degrees are the plan's, chosen at launch
            lines.append(
                f"| `{path.name}` | {config['trainer']['devices']} | `layout: auto`: the first row of "
                "`titan plan` for this machine | the plan's | the plan's | - | - | - | - |"
            )
            continue
        dp, pp, ep, tp, cp = (strategy[axis] for axis in ("dp", "pp", "ep", "tp", "cp"))
        m = strategy.get("num_microbatches") or pp
        batch = config["data"]["global_batch_size"]
        model = ModelConfig(**config["model"]["model"])
        expert, other = _params_per_rank(model, pp, ep, tp)
        bubble = (pp - 1) / (m + pp - 1)
        lines.append(
            f"| `{path.name}` | {dp * pp * ep * tp * cp} | {dp}, {pp}, {ep}, {tp}, {cp} | {strategy.get('schedule', '1f1b')} | {m} "
            f"| {batch // (dp * ep) // m} | {bubble:.2f} | {expert:,} + {other:,} "
            f"| {16 * (expert + other) / 2**20:.1f} MiB |"
        )
    return lines


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "<!-- generated by docs/gen_reference.py from the signatures and docstrings; do not edit -->",
        "",
        "Every argument below is a keyword of the Python class and a flag of the CLI "
        "(`titan fit --config configs/X.yaml --FLAG=VALUE`), and a key of the YAML configs at the same "
        "path. `titan fit --help` lists Lightning's own `--trainer.*` flags too. How to pick values: "
        "[choosing_a_layout.md](choosing_a_layout.md).",
        "",
        "## Strategy: `lightning_titan.TitanStrategy` (`strategy='titan'`)",
        "",
        _summary(TitanStrategy),
        "",
        *_table(_signature_rows(TitanStrategy, "--trainer.strategy.init_args.")),
        "",
        "Other keywords go to Lightning's `ParallelStrategy`: "
        + ", ".join(f"`{name}`" for name in _lightning_strategy_args())
        + ". The CLI also takes the short form `--trainer.strategy.NAME` and the registry name "
        "`--trainer.strategy=titan`.",
        "",
        "## Module: `lightning_titan.TitanLM`",
        "",
        _summary(TitanLM),
        "",
        *_table(_signature_rows(TitanLM, "--model.")),
        "",
        "## Model shape: `lightning_titan.ModelConfig` (`TitanLM(model=...)`)",
        "",
        "A dataclass; every layout builds its slice of the model these fields describe.",
        "",
        *_table(_model_rows()),
        "",
        "## LoRA adapters: `lightning_titan.LoRA` (`TitanLM(lora=...)`)",
        "",
        _summary(LoRA) + " See [LoRA fine-tuning](lora.md).",
        "",
        *_table(_signature_rows(LoRA, "--model.lora.")),
        "",
        "## Data: `lightning_titan.TitanDataModule`",
        "",
        *_table(_signature_rows(TitanDataModule, "--data.")),
        "",
        "## Measuring callbacks: `lightning_titan.lightning.callbacks`",
        "",
        "Add them with `callbacks=[...]`, or on the CLI with "
        "`--trainer.callbacks+=lightning_titan.lightning.callbacks.PipelineTimeline` and the init args below as "
        "`--trainer.callbacks.init_args.NAME`.",
        "",
        f"**`PipelineTimeline`**: {_summary(PipelineTimeline)}",
        "",
        *_table(_signature_rows(PipelineTimeline, "--trainer.callbacks.init_args.")),
        "",
        f"**`ExpertLoad`**: {_summary(ExpertLoad)}",
        "",
        *_table(_signature_rows(ExpertLoad, "--trainer.callbacks.init_args.")),
        "",
        "## The configs in `configs/`",
        "",
        "One per composition: `configs/base.yaml` (model, data, trainer, logger, callbacks) with the "
        "layout's degrees and name in place of its own, so all train the same model on the same global "
        "batches and their loss curves coincide. Parameters and state bytes are per rank, for the largest rank (the embedding sits on "
        "the first stage, the LM head on the last); activations come on top (see "
        "[choosing_a_layout.md](choosing_a_layout.md)).",
        "",
        *_configs_table(),
        "",
    ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not TARGET.exists() or TARGET.read_text() != text:
            print("docs/reference.md is stale: run python docs/gen_reference.py")
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
