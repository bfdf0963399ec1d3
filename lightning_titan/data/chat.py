"""Instruction records -> token ids and loss labels: the built-in chat template and the loss masks.

Two record formats besides plain text:

- ``chat``: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``
- ``prompt_completion``: ``{"prompt": str, "completion": str}``

A chat is rendered in the tokenizer's own chat template where it has one, else in the built-in one
(no template file needed): each turn is the header ``<|role|>`` and a newline, the content, then the
end-of-document id. A prompt/completion pair is the prompt's ids then the completion's and the
end-of-document id. With ``train_on="responses"`` only the assistant turns (their end included) or
the completion and its end id are targets; every other label is ``IGNORE_INDEX``, which the
objective leaves out of the loss and the token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_titan.data.tokenizer import HFTokenizer, Tokenizer
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
    """The ids and labels of one record; BadRecord (without its place) if it is malformed. A chat in
    the tokenizer's own template where it has one (HFTokenizer), else in the built-in one."""
    parts = pieces(record, data_format)
    if data_format == "chat" and isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template:
        assert isinstance(record, dict)  # pieces() checked it
        return _in_template(record["messages"], tokenizer, train_on)
    ids, labels = [], []
    for text, trained, end in parts:
        part = np.asarray(tokenizer.encode_array(text), dtype=np.int64)
        if end:
            part = np.append(part, tokenizer.eod_id)
        ids.append(part)
        counted = trained or train_on == "all"
        labels.append(part if counted else np.full(len(part), IGNORE_INDEX, dtype=np.int64))
    return Rendered(np.concatenate(ids), np.concatenate(labels))


def reply_prompt(text: str, tokenizer: Tokenizer) -> list[int]:
    """The ids that ask for the assistant's reply to ``text`` as one user turn, rendered as ``render``
    renders a chat: in the tokenizer's own template with its generation prompt where it has one,
    else in the built-in one (the user turn, then the assistant's header). BadRecord if the
    template refuses it."""
    turns = [{"role": "user", "content": text}]
    if isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template:
        return [int(i) for i in _apply(tokenizer, turns, generation_prompt=True)]
    user = [*tokenizer.encode(_header("user")), *tokenizer.encode(text), tokenizer.eod_id]
    return user + tokenizer.encode(_header("assistant"))


def _header(role: str) -> str:
    """The built-in template's header of a turn."""
    return f"<|{role}|>\n"


def _in_template(messages: list[dict], tokenizer: HFTokenizer, train_on: str) -> Rendered:
    """The targets of assistant turn i are the ids between the prompt for it (turns before i and the
    generation prompt) and the end of turn i, whatever the template puts around them (its end-of-turn
    tokens are targets: the model learns to stop). Templates whose earlier turns render differently
    once later turns follow cannot be masked this way, and are refused."""
    turns = [{"role": t["role"], "content": t["content"]} for t in messages]
    full = _apply(tokenizer, turns, generation_prompt=False)
    labels = full.copy() if train_on == "all" else np.full(len(full), IGNORE_INDEX, np.int64)
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant" or train_on == "all":
            continue
        before = _apply(tokenizer, turns[:i], generation_prompt=True)
        through = _apply(tokenizer, turns[: i + 1], generation_prompt=False)
        if not (_starts(through, before) and _starts(full, through)):
            raise ValueError(
                f"the chat template of tokenizer {tokenizer.name!r} renders a turn differently once "
                "later turns follow, so the assistant turns cannot be told apart; use "
                "train_on='all', or tokenizer='byte' (the built-in template)"
            )
        labels[len(before) : len(through)] = full[len(before) : len(through)]
    return Rendered(full, labels)


def _apply(tokenizer: HFTokenizer, turns: list[dict], generation_prompt: bool) -> np.ndarray:
    try:
        return tokenizer.apply_chat_template(turns, generation_prompt)
    except Exception as err:  # jinja2's errors, and what a template raises ("roles must alternate")
        raise BadRecord(
            f"cannot be rendered in the chat template of tokenizer {tokenizer.name!r} "
            f"({type(err).__name__}: {str(err)[:200]})"
        ) from None


def _starts(ids: np.ndarray, prefix: np.ndarray) -> bool:
    return len(prefix) <= len(ids) and bool((ids[: len(prefix)] == prefix).all())


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
        pieces.append((_header(role), False, False))
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
