"""Bad input fails early, on every rank, with a message that names the value and the fix."""

from __future__ import annotations

from lightning_titan.data.prepare import PackedCorpus


def check_args(
    seq_len: int,
    global_batch_size: int,
    val_fraction: float,
    streaming: bool,
    num_workers: int,
    shuffle_buffer: int,
) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1")
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size} must be at least 1")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must lie in [0, 1); 0 turns validation off")
    if shuffle_buffer < 1:
        raise ValueError(
            f"shuffle_buffer={shuffle_buffer} must be at least 1 (1: no document shuffle)"
        )
    if streaming and num_workers:
        raise ValueError(
            f"num_workers={num_workers} with streaming=True: the stream is read in the training process "
            "so that its position can be checkpointed exactly; set num_workers=0 (or use map-style mode)"
        )


def check_counts(max_bytes: int | None, steps_per_epoch: int | None, val_batches: int) -> None:
    """Caps and counts that must be positive: 0 or less would read nothing or divide by zero later."""
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(
            f"max_bytes={max_bytes} must be at least 1 (a cap on the source's bytes of text), or None "
            "for no cap (the default corpus then uses 4 MB)"
        )
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ValueError(
            f"steps_per_epoch={steps_per_epoch} must be at least 1 (batches per streaming epoch), or "
            "None for an endless stream bounded by the Trainer's max_steps"
        )
    if val_batches < 1:
        raise ValueError(
            f"val_batches={val_batches} must be at least 1; to turn validation off set val_fraction=0"
        )


class TooLittleData(ValueError):
    """A split that cannot fill one global batch. Every rank finds it alike (each packs the same
    corpus) in the data's setup, before the data's first collective: ``titan`` prints the message
    alone, exit status 2, as it does for a bad value on the command line."""


def check_split_sizes(corpus: PackedCorpus, global_batch_size: int, val_fraction: float) -> None:
    """Each split used must fill at least one global batch of ``seq_len + 1``-token windows."""
    window = corpus.meta["seq_len"] + 1
    for split, rows in (("train", corpus.train), ("validation", corpus.validation)):
        if split == "validation" and val_fraction == 0:
            continue
        if len(rows) < global_batch_size:
            stats = corpus.meta[split]
            fix = (
                "raise val_fraction (or set it to 0: no validation), "
                if split == "validation"
                else ""
            )
            raise TooLittleData(
                f"the {'training' if split == 'train' else split} split packs into {len(rows)} "
                f"sequences of {window} tokens ({stats['tokens']} tokens from {stats['documents']} "
                f"documents) but one global batch needs global_batch_size={global_batch_size} of "
                f"them ({global_batch_size * window} tokens); give more text (source / max_bytes), "
                f"{fix}or lower global_batch_size or seq_len"
            )


def check_model_fits(
    tokenizer: str, data_vocab: int, data_seq_len: int, vocab_size: int, seq_len: int
) -> None:
    if data_vocab > vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer!r} has {data_vocab} ids but the model's vocab_size is {vocab_size}; "
            f"set the model's vocab_size to at least {data_vocab}, or change the tokenizer"
        )
    if data_seq_len > seq_len:
        raise ValueError(
            f"data seq_len={data_seq_len} exceeds the model's seq_len={seq_len}; set the data seq_len <= "
            f"{seq_len} or raise the model's"
        )


def check_resume(state: dict, mode: str, global_batch_size: int, seed: int) -> None:
    if state["global_batch_size"] != global_batch_size:
        raise ValueError(
            f"the data state was saved with global_batch_size={state['global_batch_size']} but this run "
            f"uses global_batch_size={global_batch_size}; resume with the same global batch size"
        )
    if state["mode"] != mode or state["seed"] != seed:
        raise ValueError(
            f"the data state was saved in {state['mode']} mode with seed={state['seed']}; this run is {mode} "
            f"with seed={seed}: resume with the same streaming and seed settings"
        )
