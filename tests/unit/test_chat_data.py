"""Chat and prompt/completion records: the built-in template's token ids, which targets are
IGNORE_INDEX, the batches the pipeline serves, and each malformed record named by file and line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_titan.cli import UsageError, main
from lightning_titan.data import ByteTokenizer, DataPipeline
from lightning_titan.data.chat import render, reply_prompt
from lightning_titan.data.corpus import Source
from lightning_titan.data.records import check_records
from lightning_titan.parallel.batching import PackedBatch
from lightning_titan.parallel.tensor_parallel import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[2]
EOD = ByteTokenizer.eod_id
X = IGNORE_INDEX
CHAT = {
    "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
}


def ids_of(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_chat_renders_in_the_built_in_template_and_only_the_answer_is_a_target():
    got = render(CHAT, "chat", ByteTokenizer(), "responses")
    system, user = ids_of("<|system|>\ns") + [EOD], ids_of("<|user|>\nhi") + [EOD]
    header, answer = ids_of("<|assistant|>\n"), ids_of("yo") + [EOD]
    assert got.ids.tolist() == system + user + header + answer
    assert got.labels.tolist() == [X] * len(system + user + header) + answer
    every = render(CHAT, "chat", ByteTokenizer(), "all")
    assert every.labels.tolist() == every.ids.tolist() == got.ids.tolist()


def test_every_assistant_turn_of_a_conversation_is_a_target():
    turns = [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")]
    record = {"messages": [{"role": r, "content": c} for r, c in turns]}
    got = render(record, "chat", ByteTokenizer(), "responses")
    counted = [i for i in got.labels.tolist() if i != X]
    assert counted == ids_of("b") + [EOD] + ids_of("d") + [EOD]


def test_a_prompt_completion_pair_trains_on_the_completion_only():
    got = render(
        {"prompt": "2+2=", "completion": "4"}, "prompt_completion", ByteTokenizer(), "responses"
    )
    assert got.ids.tolist() == ids_of("2+2=4") + [EOD]
    assert got.labels.tolist() == [X] * 4 + ids_of("4") + [EOD]


def _pipeline(source: Path, cache: Path, **kwargs) -> DataPipeline:
    args = dict(
        seq_len=32, global_batch_size=4, val_fraction=0, tokenizer="byte", cache_dir=str(cache)
    )
    pipe = DataPipeline(source=str(source), **{**args, **kwargs})
    pipe.prepare_data()
    pipe.setup()
    return pipe


def test_the_pipeline_serves_one_record_a_window_with_shifted_labels(tmp_path):
    rows = [{"prompt": f"q{i}:", "completion": f"a{i}"} for i in range(8)]
    source = write_jsonl(tmp_path / "pc.jsonl", rows)
    pipe = _pipeline(source, tmp_path / "cache", pack=False)
    assert pipe.corpus is not None and pipe.corpus.meta["format"] == "prompt_completion"
    seen = set()
    for inputs, targets in pipe.train_dataloader():
        assert inputs.shape == targets.shape == (4, 32) and targets.dtype == torch.int64
        for row_in, row_t in zip(inputs.tolist(), targets.tolist(), strict=True):
            prompt = bytes(row_in[: row_in.index(ord(":")) + 1]).decode()
            i = int(prompt[1:-1])
            want = ids_of(f"q{i}:a{i}") + [EOD]
            assert row_in[: len(want)] == want and set(row_in[len(want) :]) == {EOD}  # padded
            # the target of position p is token p+1: the completion and its end id only
            assert row_t == [X] * (len(prompt) - 1) + ids_of(f"a{i}") + [EOD] + [X] * (
                33 - len(want)
            )
            seen.add(i)
    assert seen == set(range(8))
    # train_on="all" in the same cache: a prepared corpus of its own, every token a target
    every = _pipeline(source, tmp_path / "cache", train_on="all", pack=False)
    inputs, targets = next(iter(every.train_dataloader()))
    counted = (targets != X).sum(dim=1)
    lengths = (inputs != EOD).sum(dim=1)  # the record's ids; its end id is the last target
    assert torch.equal(counted, lengths)


def test_auto_reads_the_format_from_the_columns_and_text_stays_text(tmp_path):
    (tmp_path / "mix").mkdir()
    write_jsonl(tmp_path / "mix" / "a.jsonl", [CHAT] * 4)
    write_jsonl(tmp_path / "mix" / "b.jsonl", [{"prompt": "p", "completion": "c"}] * 4)
    pipe = _pipeline(tmp_path / "mix", tmp_path / "cache", seq_len=48)
    assert pipe.corpus is not None and pipe.corpus.meta["train"]["documents"] == 8  # both kinds
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "x" * 100}] * 4)
    plain = _pipeline(text, tmp_path / "cache", seq_len=16, global_batch_size=2)
    _, targets = next(iter(plain.train_dataloader()))
    assert (targets != X).all()  # plain text: every token a target, as before
    with pytest.raises(ValueError, match="format='chatml' is not one of"):
        DataPipeline(format="chatml")
    with pytest.raises(ValueError, match="train_on='assistant' is not one of"):
        DataPipeline(train_on="assistant")


def _turn(role: object = "user", content: object = "c") -> dict:
    return {"role": role, "content": content}


BAD = {
    "missing role": (
        {"messages": [{"content": "c"}, _turn("assistant")]},
        "turn 0 has role missing",
    ),
    "unknown role": ({"messages": [_turn("bot"), _turn("assistant")]}, "turn 0 has role str 'bot'"),
    "empty conversation": (
        {"messages": []},
        "'messages' must be a non-empty list of turns, got list",
    ),
    "non-string content": (
        {"messages": [_turn(content=[1]), _turn("assistant")]},
        "content list [1]",
    ),
    "no assistant turn": ({"messages": [_turn()]}, "has no assistant turn"),
    "a turn not an object": ({"messages": ["hi", _turn("assistant")]}, "turn 0 is str 'hi'"),
    "null completion": ({"prompt": "p", "completion": None}, "completion missing"),
    "empty completion": ({"prompt": "p", "completion": ""}, "has an empty completion"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_record_is_named_by_file_and_line(tmp_path, case):
    record, says = BAD[case]
    good = CHAT if "messages" in record else {"prompt": "p", "completion": "c"}
    source = write_jsonl(tmp_path / "data.jsonl", [good, record, good])
    with pytest.raises(ValueError) as info:
        check_records(Source(str(source)), str(tmp_path / "cache"))
    message = str(info.value)
    assert message.startswith(f"{source}:2: this ") and says in message, message
    assert message.endswith("; fix or remove it")


def test_a_line_that_is_not_json_and_a_record_not_an_object_are_named(tmp_path):
    source = tmp_path / "data.jsonl"
    source.write_text(json.dumps(CHAT) + "\n\n[1, 2]\n")
    with pytest.raises(
        ValueError, match=rf"^{source}:3: this chat record is a list, not an object"
    ):
        check_records(Source(str(source)), str(tmp_path / "cache"))
    source.write_text(json.dumps(CHAT) + "\n{cut\n")
    with pytest.raises(ValueError, match=rf"^{source}:2 is not JSON"):
        check_records(Source(str(source)), str(tmp_path / "cache"))


def test_preparing_a_malformed_record_names_it_too(tmp_path):
    source = write_jsonl(tmp_path / "data.jsonl", [CHAT, {"messages": [_turn(content=3)]}])
    with pytest.raises(
        ValueError, match=rf"^{source}:2: this chat record turn 0 \(user\) has content int 3"
    ):
        _pipeline(source, tmp_path / "cache")


def test_titan_fit_refuses_a_malformed_record_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["titan"])  # LightningCLI warns about pytest's own arguments
    source = write_jsonl(tmp_path / "data.jsonl", [CHAT, {"messages": [_turn(None)]}])
    args = ["fit", "--config", str(ROOT / "configs" / "single.yaml"), f"--data.source={source}"]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=rf"^{source}:2: this chat record turn 0 has role missing"):
        main([*args, f"--data.cache_dir={tmp_path / 'cache'}"])
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache" / "packed").exists()


def test_a_record_longer_than_a_window_is_skipped_counted_and_reported(tmp_path, capfd):
    long = {"prompt": "p" * 40, "completion": "c"}
    rows = [{"prompt": "p", "completion": "c"}] * 4 + [long, long]
    pipe = _pipeline(write_jsonl(tmp_path / "data.jsonl", rows), tmp_path / "cache", pack=False)
    assert pipe.corpus is not None and len(pipe.corpus.train) == 4
    assert pipe.corpus.meta["train"]["skipped_too_long"] == 2
    err = capfd.readouterr().err
    assert "skipped 2 of 6 prompt_completion records longer than seq_len + 1 = 33 tokens" in err
    assert f"{tmp_path / 'data.jsonl'}:5 (42 tokens)" in err
    with pytest.raises(
        ValueError, match="has no prompt_completion record that fits seq_len \\+ 1 = 33"
    ):
        _pipeline(write_jsonl(tmp_path / "long.jsonl", [long]), tmp_path / "cache")


def test_packed_records_fill_windows_in_order_each_its_own_document(tmp_path, capfd):
    """The default for records: laid in order while they fit, then padded (a document of its own);
    each record's targets are those it has alone, the next record's first token never one; the
    batch carries the document ids; the efficiency is in meta.json and on stderr."""
    rows = [{"prompt": f"q{i}:", "completion": "a" * (i + 1)} for i in range(8)]
    source = write_jsonl(tmp_path / "pc.jsonl", rows)
    pipe = _pipeline(source, tmp_path / "cache", global_batch_size=1)
    alone = _pipeline(source, tmp_path / "cache", global_batch_size=1, pack=False)
    assert pipe.corpus is not None and alone.corpus is not None
    assert pipe.corpus.meta["packed"] and not alone.corpus.meta["packed"]
    records = [ids_of(f"q{i}:" + "a" * (i + 1)) + [EOD] for i in range(8)]
    # in order, greedy: 5+6+7+8 = 26 fit 33 (+9 does not); 9+10+11 = 30; 12
    want_windows = [[0, 1, 2, 3], [4, 5, 6], [7]]
    meta = pipe.corpus.meta["train"]
    assert (meta["documents"], meta["sequences"]) == (8, 3)
    tokens = sum(map(len, records))
    assert meta["packing_efficiency"] == round(tokens / (3 * 33), 4)
    assert alone.corpus.meta["train"]["packing_efficiency"] == round(tokens / (8 * 33), 4)
    assert (
        f"packed 8 prompt_completion records into 3 sequences of seq_len + 1 = 33 tokens: packing efficiency {tokens / 99:.1%}"
        in capfd.readouterr().err
    )
    seen = []
    for batch in pipe.train_dataloader():
        assert isinstance(batch, PackedBatch)
        inputs, targets, documents = (t[0].tolist() for t in batch)
        first = int(bytes(inputs[1 : inputs.index(ord(":"))]).decode())
        group = next(g for g in want_windows if g[0] == first)
        seen.append(first)
        start = 0
        for d, i in enumerate(group):
            n = len(records[i])
            assert inputs[start : start + n] == records[i][: 32 - start]
            assert documents[start : start + n] == [d] * len(documents[start : start + n])
            prompt = len(f"q{i}:")
            # targets of the record's tokens: its completion and end id, then not the next record
            want = [X] * (prompt - 1) + ids_of("a" * (i + 1)) + [EOD]
            assert targets[start : start + n - 1] == want[: 32 - start]
            if start + n - 1 < 32:
                assert targets[start + n - 1] == X  # the next record's (or padding's) first id
            start += n
        assert set(documents[start:]) <= {len(group)} and set(targets[start:]) <= {X}
    assert sorted(seen) == [0, 4, 7]
    # train_on="all": every target inside a document, none across a boundary
    every = _pipeline(source, tmp_path / "cache", global_batch_size=1, train_on="all")
    counted = 0
    for inputs, targets, documents in every.train_dataloader():
        same = documents[:, 1:] == documents[:, :-1]
        inside, next_ids = targets[:, :-1][same], inputs[:, 1:][same]
        assert ((inside == next_ids) | (inside == X)).all()  # X: the padding's
        assert (targets[:, :-1][~same] == X).all() and (~same).any()
        counted += int((targets != X).sum())
    assert counted == sum(len(r) - 1 for r in records)  # each record's tokens but its first


def test_records_prepared_before_packing_are_prepared_again(tmp_path, capfd):
    """A cache of records prepared one a sequence by an older version (no ``packed`` in its
    meta.json, under the same key as today's default) is rebuilt, not served unpacked."""
    source = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "q:", "completion": "a"}] * 8)
    pipe = _pipeline(source, tmp_path / "cache", global_batch_size=1)
    assert pipe.corpus is not None
    meta_file = pipe.corpus.path / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["packed"]
    meta_file.write_text(json.dumps(meta))
    capfd.readouterr()
    again = _pipeline(source, tmp_path / "cache", global_batch_size=1)
    assert again.corpus is not None and again.corpus.meta["packed"]
    assert "prepared one a sequence, before packing): rebuilding it" in capfd.readouterr().err


def test_packed_text_is_cut_into_documents_at_its_end_ids():
    from lightning_titan.data.packing import collate_windows

    windows = np.array([[5, 6, EOD, 7, EOD, 8, 9]])
    batch = collate_windows(windows, text_eod_id=EOD)
    assert isinstance(batch, PackedBatch)
    assert batch.documents.tolist() == [[0, 0, 0, 1, 1, 2]]
    assert batch.targets.tolist() == [[6, EOD, X, EOD, X, 9]]  # not the next document's first
    inputs, targets = collate_windows(windows)  # unpacked: as before
    assert targets.tolist() == [[6, EOD, 7, EOD, 8, 9]]


def test_padding_is_never_a_target():
    windows = np.stack(
        [
            np.array([[1, 2, EOD, EOD], [X, 2, EOD, X]]),
            np.array([[3, EOD, EOD, EOD], [X, EOD, X, X]]),
        ]
    )
    from lightning_titan.data.packing import collate_windows

    inputs, targets = collate_windows(windows)
    assert inputs.tolist() == [[1, 2, EOD], [3, EOD, EOD]]
    assert targets.tolist() == [[2, EOD, X], [EOD, X, X]]


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _template_tokenizer(folder: Path, template: str):
    """Our byte tokenizer as a Hugging Face folder (ids = bytes) with a chat template of its own."""
    from lightning_titan.data.tokenizer import HFTokenizer
    from lightning_titan.hf.export import byte_tokenizer_files

    folder.mkdir()
    for name, content in byte_tokenizer_files().items():
        (folder / name).write_text(json.dumps(content))
    (folder / "chat_template.jinja").write_text(template)
    return HFTokenizer(str(folder))


def test_a_tokenizer_with_its_own_chat_template_renders_in_it_and_masks_by_turn(tmp_path):
    tok = _template_tokenizer(tmp_path / "tok", CHATML)
    turns = [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")]
    record = {"messages": [{"role": r, "content": c} for r, c in turns]}
    got = render(record, "chat", tok, "responses")
    text = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns)
    assert got.ids.tolist() == ids_of(text)
    counted = [i for i in got.labels.tolist() if i != X]
    assert counted == ids_of("b<|im_end|>\n") + ids_of("d<|im_end|>\n")  # the turns and their ends
    assert render(record, "chat", tok, "all").labels.tolist() == ids_of(text)
    # prompt/completion records keep the plain concatenation
    pair = render({"prompt": "p", "completion": "c"}, "prompt_completion", tok, "responses")
    assert pair.ids.tolist() == ids_of("pc") + [EOD]


def test_a_chat_template_that_refuses_a_record_or_rewrites_past_turns_is_named(tmp_path):
    strict = "{% if messages[0].role != 'user' %}{{ raise_exception('start with a user turn') }}{% endif %}"
    tok = _template_tokenizer(tmp_path / "strict", strict + CHATML)
    record = {"messages": [{"role": "assistant", "content": "b"}]}
    with pytest.raises(
        ValueError, match="cannot be rendered in the chat template .*start with a user"
    ):
        render(record, "chat", tok, "responses")
    # the last turn rendered apart from the others: earlier renders are no prefix of the whole
    moving = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m.content }}|{% endfor %}"
    tok = _template_tokenizer(tmp_path / "moving", moving)
    with pytest.raises(ValueError, match="renders a turn differently once later turns follow"):
        render({"messages": [_turn(), _turn("assistant"), _turn()]}, "chat", tok, "responses")


def test_a_reply_prompt_is_the_user_turn_then_the_assistant_header_of_the_template(tmp_path):
    """``titan generate --chat``'s prompt: in the built-in template, in the exported byte tokenizer's
    copy of it (the same ids), in a tokenizer's own template, and refused as a record is."""
    from lightning_titan.data.tokenizer import HFTokenizer
    from lightning_titan.hf.export import byte_tokenizer_files

    want = ids_of("<|user|>\nhi é") + [EOD] + ids_of("<|assistant|>\n")
    assert reply_prompt("hi é", ByteTokenizer()) == want
    folder = tmp_path / "exported"
    folder.mkdir()
    for name, content in byte_tokenizer_files().items():
        (folder / name).write_text(json.dumps(content))
    assert reply_prompt("hi é", HFTokenizer(str(folder))) == want
    chatml = _template_tokenizer(tmp_path / "chatml", CHATML)
    assert reply_prompt("hi", chatml) == ids_of(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    strict = "{% if messages[0].role != 'system' %}{{ raise_exception('start with a system turn') }}{% endif %}"
    with pytest.raises(ValueError, match="cannot be rendered in the chat template .*system turn"):
        reply_prompt("hi", _template_tokenizer(tmp_path / "strict", strict + CHATML))


def test_the_exported_byte_tokenizer_renders_chats_as_the_built_in_template(tmp_path):
    """What `titan export` writes for the byte tokenizer carries the built-in template as a chat
    template: transformers' apply_chat_template gives the ids we trained on, and with
    add_generation_prompt the assistant's header to generate after."""
    from transformers import AutoTokenizer

    from lightning_titan.data.tokenizer import ByteTokenizer
    from lightning_titan.hf.export import byte_tokenizer_files

    folder = tmp_path / "tok"
    folder.mkdir()
    for name, content in byte_tokenizer_files().items():
        (folder / name).write_text(json.dumps(content))
    theirs = AutoTokenizer.from_pretrained(folder)
    turns = [("system", "be brief"), ("user", "hi é"), ("assistant", "ok"), ("user", "more")]
    messages = [{"role": r, "content": c} for r, c in turns]
    ours = render({"messages": [*messages, {"role": "assistant", "content": "x"}]}, "chat",
                  ByteTokenizer(), "all")  # fmt: skip
    prompt = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt if isinstance(prompt, list) else list(prompt["input_ids"])  # a BatchEncoding
    assert prompt == ours.ids.tolist()[: len(prompt)]
    assert ours.ids.tolist()[len(prompt) :] == ids_of("x") + [EOD]
