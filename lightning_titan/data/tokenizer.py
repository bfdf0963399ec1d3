"""Tokenizers: a built-in byte-level one (no download) and any Hugging Face tokenizer when installed."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline calls: ``prepare`` keys its cache by ``name``, packs ``encode_array``."""

    name: str  # identifies the vocabulary in the cache key of a prepared corpus
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray:
        """The ids of ``text`` as a 1-D integer array (the packing path: no Python int per token)."""
        ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; 256 marks the end of a document. Matches the model's default vocab of 257."""

    vocab_size = 257
    eod_id = 256
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Fast path for packing: no Python int per byte."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i != self.eod_id).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer by hub name or local path; its end-of-sequence token separates documents."""

    def __init__(self, name_or_path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ValueError(
                f"tokenizer={name_or_path!r} needs the `transformers` package, which is not installed; "
                "`pip install transformers`, or use tokenizer='byte'"
            ) from err
        self.name = name_or_path
        self._tok = AutoTokenizer.from_pretrained(name_or_path)
        eod = self._tok.eos_token_id
        if eod is None:
            raise ValueError(
                f"tokenizer {name_or_path!r} has no end-of-sequence token to separate documents; "
                "choose a tokenizer with an eos_token, or tokenizer='byte'"
            )
        self.eod_id = int(eod)
        # len() counts added special tokens, which `vocab_size` leaves out: the model must embed them all.
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))

    def __getstate__(self) -> dict:
        # `datasets` fingerprints and pickles the map function; the name is enough to rebuild it.
        return {"name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["name"])  # type: ignore[misc]  # rebuilt from its name, as at first


def load_tokenizer(spec: str) -> Tokenizer:
    """'byte' for the built-in tokenizer, else a Hugging Face tokenizer name or local path."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id: halves the cache for vocabularies up to 65536."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)
