"""Tokenizers: a built-in byte-level one (no download) and any Hugging Face tokenizer when installed."""

from __future__ import annotations

import json
import os
from typing import Any, Protocol, runtime_checkable

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
        self._tok = _from_pretrained(AutoTokenizer, name_or_path)
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

    @property
    def chat_template(self) -> str | None:
        """The folder's own chat template (``tokenizer_config.json`` or ``chat_template.jinja``)."""
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else None

    def apply_chat_template(self, messages: list[dict], generation_prompt: bool) -> np.ndarray:
        """The ids of ``messages`` in the folder's chat template (a prompt for the next assistant turn
        after them with ``generation_prompt``)."""
        ids = self._tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
        )
        return np.asarray(ids, dtype=np.int64)

    def __getstate__(self) -> dict:
        # `datasets` fingerprints and pickles the map function; the name is enough to rebuild it.
        return {"name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["name"])  # type: ignore[misc]  # rebuilt from its name, as at first


def _from_pretrained(auto: Any, name: str) -> Any:
    """A local folder or a cached download at once; else one quick probe of the hub first, so that an
    offline machine fails in a second instead of after transformers' minute of retries per file."""
    if name.startswith(("/", ".", "~")) and not os.path.exists(name):
        raise ValueError(
            f"tokenizer {name!r} could not be loaded: no such file or folder; give a tokenizer folder "
            "that exists, a Hugging Face hub name, or tokenizer='byte'"
        )
    try:
        return auto.from_pretrained(name, local_files_only=True)
    except Exception as err:  # a damaged file raises anything, from json to the tokenizers library
        if os.path.exists(name):
            raise ValueError(
                f"tokenizer folder {name!r} could not be read ({_bad_json(name) or _cause(err)}): "
                f"its tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...) are damaged or "
                "missing; replace them (re-download), or use tokenizer='byte'"
            ) from err
        if not isinstance(err, (OSError, ValueError)):
            raise
        if _offline():
            raise _unloadable(name, err, "HF_HUB_OFFLINE is set and it is not cached") from err
    _probe_hub(name)
    try:
        return auto.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise _unloadable(name, err) from err


def _offline() -> bool:
    flags = (os.environ.get(k, "").upper() for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(flag in ("1", "ON", "YES", "TRUE") for flag in flags)


def _probe_hub(name: str) -> None:
    """One request without retries: unreachable hub or unknown repository fail here, with our message."""
    from huggingface_hub import model_info
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    try:
        model_info(name, timeout=10)
    except RepositoryNotFoundError as err:
        raise _unloadable(name, err, "no such repository on the Hugging Face hub") from err
    except HFValidationError as err:
        raise _unloadable(name, err, "not a hub name 'owner/name' nor a local folder") from err
    except HfHubHTTPError:
        return  # gated, private, rate-limited: let from_pretrained try (it has the token logic)
    except Exception as err:  # httpx / requests connection errors: no network
        raise _unloadable(name, err) from err


def _bad_json(folder: str) -> str | None:
    """The first tokenizer JSON file of ``folder`` that is not JSON, and why: transformers' error
    (a bare JSONDecodeError) names no file."""
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if name.endswith(".json") and os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                return f"{path} is not valid JSON: {str(e)[:200]}"
    return None


def _cause(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def _unloadable(name: str, err: BaseException, why: str = "") -> ValueError:
    """A hub name that could not be fetched: no network, no such repository, or not cached offline."""
    return ValueError(
        f"tokenizer {name!r} could not be loaded ({why or _cause(err)}); use tokenizer='byte' or a "
        "local path to a tokenizer folder (or download it once with network: it is cached then)"
    )


# what save_pretrained writes for a tokenizer (and generation defaults), copied on export
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def tokenizer_files_of(folder: str | os.PathLike | None) -> list:
    """The tokenizer files of a Hugging Face model folder, [] when it has no tokenizer (a folder
    with only ``generation_config.json`` has none)."""
    from pathlib import Path

    if folder is None or not Path(folder).is_dir():
        return []
    found = [Path(folder) / name for name in TOKENIZER_FILES if (Path(folder) / name).is_file()]
    return found if any(p.name != "generation_config.json" for p in found) else []


def resolve_tokenizer(spec: str, model_folder: str | None) -> str:
    """``"auto"``: the tokenizer of the Hugging Face folder the model starts from (``init_from``) when
    that folder has one, else ``"byte"``; any other spec as it is."""
    if spec != "auto":
        return spec
    return str(model_folder) if tokenizer_files_of(model_folder) else "byte"


def load_tokenizer(spec: str) -> Tokenizer:
    """'byte' for the built-in tokenizer, else a Hugging Face tokenizer name or local path."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id: halves the cache for vocabularies up to 65536."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)
