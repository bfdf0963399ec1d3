"""``titan generate``: text from a training checkpoint, on one process.

    titan generate --ckpt runs/dp_pp_ep --prompt "def main():" --max-new-tokens 40
    titan generate --ckpt runs/chat --chat --prompt "23+45"

The whole model is loaded in this process (``hf.export.load_full_model``: a model that fits one
machine), with the tokenizer the run trained with (the data module's, or the ``init_from`` folder's).
The prompt runs in one forward, then each new token alone, over every layer's cached keys and values
(``model/kv_cache.py``: GQA, gpt-oss's window layers and sinks, DeepSeek-V3's latents). The model
never saw positions past ``seq_len``: once the text is longer, each token is a forward over the last
``seq_len`` tokens, as ``--no-kv-cache`` runs every token (the same tokens, slower).
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
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_titan.checkpoint import read_checkpoint_info, runs
from lightning_titan.data.chat import reply_prompt
from lightning_titan.data.tokenizer import Tokenizer, load_tokenizer, resolve_tokenizer
from lightning_titan.hf.export import load_full_model
from lightning_titan.model.decoder import StageModel
from lightning_titan.model.kv_cache import KVCache


def next_token(
    logits_V: Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> int:
    """The next id from the last position's logits [V]: the argmax at ``temperature`` 0, else a
    sample of softmax(logits / temperature) restricted to the top-p nucleus."""
    if temperature == 0:
        return int(logits_V.argmax())
    probs = torch.softmax(logits_V.double() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # keep each token whose preceding mass is below top_p (the first one always)
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    nucleus = sorted_probs * keep
    choice = torch.multinomial(nucleus / nucleus.sum(), 1, generator=generator)
    return int(order[choice])


@torch.no_grad()
def generate(
    model: StageModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: tuple[int, ...] = (),
    seed: int = 0,
    kv_cache: bool = True,
    pp_group: ProcessGroup | None = None,
) -> list[int]:
    """The ids ``model`` continues ``prompt_ids`` with (not including the prompt).

    With ``kv_cache`` the prompt runs once and each new token alone, over the held keys; once the
    text is longer than ``seq_len``, each token is a forward over the last ``seq_len`` tokens, as
    without the cache (positions past ``seq_len`` are ones the model never saw).

    ``pp_group``: ``model`` is one pipeline stage (one chunk) of the ranks of this group, in stage
    order, each holding its own cache; every rank of the group calls this and gets the same ids
    (the last stage picks each token and broadcasts it). The EP ranks of a stage run the same text
    in their own pipelines, so their dispatches pair up."""
    if pp_group is not None and model.num_chunks > 1:
        raise ValueError(
            f"generation takes one chunk a pipeline rank, not {model.num_chunks}: build the stages "
            "without virtual stages"
        )
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    seq_len = model.config.seq_len
    cache = KVCache(seq_len) if kv_cache else None
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        if cache is not None and len(ids) <= seq_len:  # the tokens the cache does not hold yet
            window = torch.tensor([ids[cache.length :]], device=device)
        else:
            window, cache = torch.tensor([ids[-seq_len:]], device=device), None
        logits_V = _last_logits(model, window, cache, pp_group)
        token = -1
        if logits_V is not None:
            token = next_token(logits_V.float().cpu(), temperature, top_p, generator)
        if pp_group is not None:  # the last stage's pick, on every stage
            token = _from_last_stage(token, pp_group, device)
        if token in stop_ids:
            break
        ids.append(token)
        new.append(token)
    return new


def _last_logits(
    model: StageModel, ids: Tensor, cache: KVCache | None, pp_group: ProcessGroup | None
) -> Tensor | None:
    """The last position's logits [V] of ``ids`` [1, S] on the last stage, None on the others: each
    stage runs its layers on what the previous one sent ([1, S, D]) and sends its output on."""
    stage = 0 if pp_group is None else dist.get_rank(pp_group)
    x = ids
    if not model.is_first_stage:
        assert pp_group is not None  # a model without the embedding is a pipeline stage
        dtype = next(model.parameters()).dtype
        x = ids.new_empty(*ids.shape, model.config.d_model, dtype=dtype)
        dist.recv(x, src=dist.get_global_rank(pp_group, stage - 1), group=pp_group)
    out, _ = model(x, cache=cache)
    if model.is_last_stage:
        return out[0, -1]
    assert pp_group is not None
    dist.send(out.contiguous(), dst=dist.get_global_rank(pp_group, stage + 1), group=pp_group)
    return None


def _from_last_stage(token: int, pp_group: ProcessGroup, device: torch.device) -> int:
    held = torch.tensor([token], device=device)
    last = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)
    dist.broadcast(held, src=last, group=pp_group)
    return int(held)


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
    from lightning_titan.tools import generate_layout as layout  # it builds on generate() above

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
    except RuntimeError as e:  # a rank's error: its traceback's last line says what went wrong
        lines = [line for line in str(e).splitlines() if line.strip()]
        parser.exit(1, f"titan generate --layout={args.layout}: {lines[0]} {lines[-1]}\n")
