"""``titan generate``: text from a training checkpoint, in one process or on a layout's ranks.

    titan generate --ckpt runs/dp_pp_ep --prompt "def main():" --max-new-tokens 40
    titan generate --ckpt runs/chat --chat --prompt "23+45"

The whole model is loaded in this process (``hf.export.load_full_model``: a model that fits one
machine), with the tokenizer the run trained with (the data module's, or the ``init_from`` folder's).
The loop (``tools/decoding.py``) runs the prompt in one forward, then each new token alone, over
every layer's cached keys and values (``model/kv_cache.py``: GQA, gpt-oss's window layers and sinks,
DeepSeek-V3's latents). The model never saw positions past ``seq_len``: once the text is longer,
each token is a forward over the last ``seq_len`` tokens, as ``--no-kv-cache`` runs every token (the
same tokens, slower).
``--temperature 0`` (the default) is greedy decoding, as ``transformers``' ``generate(do_sample=False)``;
above 0 the logits are divided by it and sampled, from the smallest set of tokens whose probability
reaches ``--top-p``. Generation stops at the tokenizer's end-of-document token or after
``--max-new-tokens``. ``--chat`` asks for the reply to the prompt as one user turn, rendered as
``titan fit`` renders chat records (``data/chat.py``: the tokenizer's own chat template, else the
built-in one), and prints the reply alone.

``--layout pp2xep2`` runs the same loop on the ranks of a pipeline and expert layout, each rank
holding its stage's layers and experts and reading only those from the checkpoint
(``tools/generate_layout.py``): for a model too large for one process.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from lightning_titan.checkpoint import read_checkpoint_info, runs
from lightning_titan.data.chat import reply_prompt
from lightning_titan.data.tokenizer import Tokenizer, load_tokenizer, resolve_tokenizer
from lightning_titan.hf.export import load_full_model
from lightning_titan.tools.decoding import generate, next_token

__all__ = ["generate", "main", "next_token", "tokenizer_of"]


def tokenizer_of(ckpt: str | Path) -> Tokenizer:
    """The tokenizer the checkpoint's run trained with."""
    meta = read_checkpoint_info(ckpt).get("meta", {})
    init_from = (meta.get("hyper_parameters") or {}).get("init_from")
    spec = (meta.get("datamodule_hyper_parameters") or {}).get("tokenizer", "auto")
    return load_tokenizer(resolve_tokenizer(spec, init_from))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titan generate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ckpt",
        required=True,
        help="a checkpoint directory written by titan fit, or a run folder (runs/<name>/version_N)"
        " or a config's runs (runs/<name>): their newest complete checkpoint",
    )
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (the default); > 0: sample"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="sample from the tokens of this much probability"
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="ask for the reply to the prompt as one user turn, in the tokenizer's chat template"
        " (the built-in one where it has none, as titan fit renders chats); prints the reply",
    )
    parser.add_argument(
        "--no-kv-cache",
        dest="kv_cache",
        action="store_false",
        help="run each token as a forward over the last seq_len tokens (slower; the same tokens)",
    )
    parser.add_argument(
        "--layout",
        help="generate on the ranks of this layout, each holding its stage and experts, e.g. pp2xep2"
        " (pp and ep, as titan plan prints layouts; gloo on CPUs, a GPU a rank on GPUs)",
    )
    return parser


def main(argv: list[str]) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens={args.max_new_tokens} must be at least 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature={args.temperature} must be 0 (greedy) or a positive number")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p={args.top_p} must be in (0, 1]")
    if not Path(args.ckpt).exists():
        parser.error(f"--ckpt={args.ckpt}: no such checkpoint; give a folder titan fit saved")
    try:
        ckpt = runs.resolve(args.ckpt, say=lambda line: print(line, file=sys.stderr))
    except ValueError as e:
        parser.error(str(e))
    tokenizer = tokenizer_of(ckpt)
    try:
        prompt = (
            reply_prompt(args.prompt, tokenizer) if args.chat else tokenizer.encode(args.prompt)
        )
    except ValueError as e:  # a chat template that refuses the turn
        parser.error(f"--chat: the prompt {e}")
    if not prompt:
        parser.error("--prompt is empty: give the text to continue")
    if args.layout is None:
        ids = generate(
            load_full_model(ckpt),
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            stop_ids=(tokenizer.eod_id,),
            seed=args.seed,
            kv_cache=args.kv_cache,
        )
    else:
        ids = _on_layout(parser, args, ckpt, prompt, tokenizer.eod_id)
    reply = tokenizer.decode(ids)
    sys.stdout.write((reply if args.chat else args.prompt + reply) + "\n")


def _on_layout(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    ckpt: Path,
    prompt: list[int],
    eod_id: int,
) -> list[int]:
    from lightning_titan.tools import generate_layout as layout  # the launcher: for --layout only

    info = read_checkpoint_info(ckpt)
    try:  # before any rank starts
        dims = layout.check_layout(args.layout, info, torch.cuda.device_count())
    except ValueError as e:
        parser.error(str(e))
    sampling = layout.Sampling(
        args.max_new_tokens, args.temperature, args.top_p, (eod_id,), args.seed, args.kv_cache
    )
    try:
        return layout.generate_on_layout(ckpt, dims, info["model_config"], prompt, sampling)
    except RuntimeError as e:  # "rank 2 failed:" and its traceback, whose last line says why
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or ["failed"]
        why = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
        parser.exit(1, f"titan generate --layout={args.layout}: {why}\n")
