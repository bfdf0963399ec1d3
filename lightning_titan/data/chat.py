"""Instruction records -> token ids and loss labels: the built-in chat template and the loss masks.

Two record formats besides plain text:

- ``chat``: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``
- ``prompt_completion``: ``{"prompt": str, "completion": str}``

The built-in template (every tokenizer; it needs no template file): each turn is the header
``<|role|>`` and a newline, the content, then the end-of-document id; a prompt/completion pair is the
prompt's ids then the completion's and the end-of-document id. With ``train_on="responses"`` only the
assistant turns' content and end id (chat) or the completion and end id are targets; every other
label is ``IGNORE_INDEX``, which the objective leaves out of the loss and the token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_titan.data.tokenizer import Tokenizer
from lightning_titan.parallel.tensor_parallel import IGNORE_INDEX

FORMATS = ("auto", "text", "chat", "prompt_completion")
TRAIN_ON = ("responses", "all")
ROLES = ("system", "user", "assistant")


class BadRecord(ValueError):
    """One record that cannot be rendered: the reader adds where it is (file and line)."""


@dataclass(frozen=True)
class Rendered:
    """One record: ``ids`` [n] and ``labels`` [n] (``ids`` where the token is a target, else IGNORE_INDEX)."""

    ids: np.ndarray
    labels: np.ndarray


def check_options(data_format: str, train_on: str) -> None:
    if data_format not in FORMATS:
        raise ValueError(
            f"format={data_format!r} is not one of {list(FORMATS)}; auto reads the columns"
        )
    if train_on not in TRAIN_ON:
        raise ValueError(
            f"train_on={train_on!r} is not one of {list(TRAIN_ON)}: 'responses' trains on the assistant "
            "turns / the completion only, 'all' on every token"
        )


def detect_format(columns: list[str], text_column: str) -> str:
    """auto: the text column if the records have it, else ``messages`` (chat), else ``prompt`` and
    ``completion``; anything else is read as text, whose check names the columns there are."""
    if text_column in columns:
        return "text"
    if "messages" in columns:
        return "chat"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    return "text"


def render(record: object, data_format: str, tokenizer: Tokenizer, train_on: str) -> Rendered:
    """The ids and labels of one record; BadRecord (without its place) if it is malformed."""
    ids, labels = [], []
    for text, trained, end in pieces(record, data_format):
        part = np.asarray(tokenizer.encode_array(text), dtype=np.int64)
        if end:
            part = np.append(part, tokenizer.eod_id)
        ids.append(part)
        counted = trained or train_on == "all"
        labels.append(part if counted else np.full(len(part), IGNORE_INDEX, dtype=np.int64))
    return Rendered(np.concatenate(ids), np.concatenate(labels))


def pieces(record: object, data_format: str) -> list[tuple[str, bool, bool]]:
    """(text, is a response, ends with the end id) pieces of one record in the built-in template;
    BadRecord if it is malformed (this is the whole check: it needs no tokenizer)."""
    if not isinstance(record, dict):
        raise BadRecord(f"is a {type(record).__name__}, not an object with named fields")
    return _chat(record) if data_format == "chat" else _prompt_completion(record)


def _chat(record: dict) -> list[tuple[str, bool, bool]]:
    """(text, is a target, ends with the end id) pieces of one conversation."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRecord(f"'messages' must be a non-empty list of turns, got {_show(messages)}")
    pieces = []
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict):
            raise BadRecord(f"turn {i} is {_show(turn)}, not an object with 'role' and 'content'")
        role, content = turn.get("role"), turn.get("content")
        if role not in ROLES:
            raise BadRecord(f"turn {i} has role {_show(role)}; a role is one of {list(ROLES)}")
        if not isinstance(content, str):
            raise BadRecord(f"turn {i} ({role}) has content {_show(content)}; content is a string")
        pieces.append((f"<|{role}|>\n", False, False))
        pieces.append((content, role == "assistant", True))
    if not any(turn["role"] == "assistant" for turn in messages):
        raise BadRecord("has no assistant turn: nothing to learn from it")
    return pieces


def _prompt_completion(record: dict) -> list[tuple[str, bool, bool]]:
    prompt, completion = record.get("prompt"), record.get("completion")
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise BadRecord(f"has {name} {_show(value)}; '{name}' is a string")
    if not completion:
        raise BadRecord("has an empty completion: nothing to learn from it")
    return [(str(prompt), False, False), (str(completion), True, True)]


def _show(value: object) -> str:
    return "missing" if value is None else f"{type(value).__name__} {value!r:.40}"
