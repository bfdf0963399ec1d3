"""Checkpoints as an attacker and a careless user would meet them: crafted files run no code, a flipped
byte or a changed model config fails the load by name, two jobs cannot share a directory, a full disk
is named, and ``titan export --out`` refuses destinations it would clobber or lose.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from lightning_titan.checkpoint import (
    BackgroundSaves,
    consolidate,
    consolidate_optimizers,
    files,
    integrity,
    is_complete_checkpoint,
    load_sharded,
    read_checkpoint_info,
    save_sharded,
    storage,
)
from lightning_titan.checkpoint.storage import UnsafeCheckpointError
from lightning_titan.hf import export
from lightning_titan.lightning.checkpoint_hooks import ShardedCheckpoints
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.runtime.launch import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
CONFIG = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_dim=48, n_experts=4, seq_len=16)


class Payload:
    """Unpickling this runs ``touch <marker>``: the proof that a load executed code from a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model(**overrides) -> tuple[StageModel, torch.optim.Optimizer]:
    model = StageModel(ModelConfig(**{**CONFIG, **overrides}))
    model.init_weights(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for p in model.parameters():
        opt.state[p]["note"] = 0.5  # a non-tensor value: DCP stores it as pickled bytes
    return model, opt


def _save(path: Path, background: bool = False, **overrides) -> Path:
    """``background``: written by the background writer while the live parameters are scribbled
    over, so that the checkpoint holds what the call saw only if the staging copied it."""
    model, opt = _model(**overrides)
    saves = BackgroundSaves() if background else None
    save_sharded(path, model, [opt], {"epoch": 0}, layout={}, background=saves)
    if saves is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        saves.wait()
    return path


@pytest.fixture(params=[False, True], ids=["sync", "background"])
def background(request) -> bool:
    """Checkpoints written at once, and in the background: every integrity promise holds for both."""
    return request.param


def _reseal(path: Path) -> None:
    """Rewrite the marker's checksums to match the files, as an attacker who edits them would."""
    marker = json.loads((path / files.MARKER).read_text())
    marker["files"] = {name: files.checksum(path / name) for name in marker["files"]}
    (path / files.MARKER).write_text(json.dumps(marker))


def _plant_in_meta(path: Path, marker: Path) -> None:
    info = torch.load(path / files.META_FILE, weights_only=True)
    info["meta"]["hook"] = Payload(marker)
    torch.save(info, path / files.META_FILE)
    _reseal(path)


def _plant_in_metadata(path: Path, marker: Path) -> None:
    metadata = pickle.loads((path / files.DCP_METADATA).read_bytes())
    metadata.planner_data = Payload(marker)
    (path / files.DCP_METADATA).write_bytes(pickle.dumps(metadata))
    _reseal(path)


def _plant_in_shard(path: Path, marker: Path) -> None:
    """Point one non-tensor entry of the index at a pickled payload appended to its shard file."""
    metadata = pickle.loads((path / files.DCP_METADATA).read_bytes())
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn.endswith("/note"))
    shard = path / info.relative_path
    offset = shard.stat().st_size
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    info.offset, info.length = offset, len(payload.getvalue())
    (path / files.DCP_METADATA).write_bytes(pickle.dumps(metadata))
    _reseal(path)


def _export(ckpt: Path, out: Path) -> None:
    export.main(["--ckpt", str(ckpt), "--out", str(out)])


@pytest.mark.parametrize("plant", [_plant_in_meta, _plant_in_metadata, _plant_in_shard])
def test_crafted_files_run_no_code(tmp_path: Path, plant, background) -> None:
    ckpt = _save(tmp_path / "ck" / "last.ckpt", background)
    marker = tmp_path / "pwned"
    plant(ckpt, marker)
    file = {_plant_in_meta: "meta.pt", _plant_in_metadata: ".metadata"}.get(plant)
    model, opt = _model()
    attempts = {
        "load": lambda: load_sharded(ckpt, model, [opt]),
        "load weights_only=True": lambda: load_sharded(ckpt, model, [opt], weights_only=True),
        "consolidate": lambda: consolidate(ckpt),
        "export": lambda: _export(ckpt, tmp_path / "hf"),
    }
    if plant is _plant_in_shard:  # the payload sits in optimizer state: model-only reads skip it
        del attempts["consolidate"], attempts["export"]
        attempts["consolidate_optimizers"] = lambda: consolidate_optimizers(ckpt)
    if plant is _plant_in_metadata:  # the index is never trusted, whatever the caller says
        attempts["load weights_only=False"] = lambda: load_sharded(
            ckpt, model, [opt], weights_only=False
        )
    for what, attempt in attempts.items():
        with pytest.raises(UnsafeCheckpointError, match="refused to load") as caught:
            attempt()
        if plant is _plant_in_shard:
            assert "/note" in str(caught.value) and str(ckpt) in str(caught.value), what
        else:
            assert str(ckpt / file) in str(caught.value), (what, str(caught.value))
        assert not marker.exists(), f"{what} ran code from the checkpoint"


def test_a_normal_checkpoint_loads_with_its_objects(tmp_path: Path, background) -> None:
    ckpt = _save(tmp_path / "last.ckpt", background)
    model, opt = _model()
    for p in model.parameters():
        opt.state[p]["note"] = -1.0
    load_sharded(ckpt, model, [opt], weights_only=True)
    assert all(opt.state[p]["note"] == 0.5 for p in model.parameters())
    assert set(consolidate(ckpt)) == set(model.state_dict())


def test_a_flipped_byte_fails_the_load_naming_the_file(tmp_path: Path, background) -> None:
    ckpt = _save(tmp_path / "last.ckpt", background)
    shard = sorted(ckpt.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside a tensor's bytes: same size, still a valid zip
    shard.write_bytes(bytes(data))
    model, opt = _model()
    for attempt in (lambda: load_sharded(ckpt, model, [opt]), lambda: consolidate(ckpt)):
        with pytest.raises(ValueError, match=f"corrupt checkpoint .*{shard.name} changed after"):
            attempt()


def _as_before_checksums(ckpt: Path) -> None:
    info = torch.load(ckpt / files.META_FILE, weights_only=True)
    del info[integrity.CHECKSUMMED]
    torch.save(info, ckpt / files.META_FILE)
    (ckpt / files.MARKER).write_text('{"format_version": 1, "entries": 1}')


def _replace_shard(ckpt: Path, how: str) -> Path:
    """Replace a shard by bytes no save wrote, then make the checksums pass as the checkpoint's
    owner could not tell: resealed by whoever replaced it, or absent (saved before checksums)."""
    shard = sorted(ckpt.glob("*.distcp"))[0]
    size = shard.stat().st_size
    noise = bytes([0xFB]) + random.Random(0).randbytes(size)  # 0xFB: no pickle opcode
    junk = noise if how.startswith("random") else pickle.dumps({"not": "a shard"})
    shard.write_bytes(junk[:size].ljust(size, b"\0"))
    _as_before_checksums(ckpt) if how.endswith("unverified") else _reseal(ckpt)
    return shard


@pytest.mark.parametrize("how", ["random, resealed", "pickle, resealed", "random, unverified"])
def test_a_shard_this_tool_did_not_write_is_named(tmp_path, monkeypatch, how, background) -> None:
    """Not DCP's ``CheckpointException ranks:dict_keys([0])`` with torch's advice to retry with
    weights_only=False: that advice is never right for bytes that are not a checkpoint's."""
    monkeypatch.setenv(integrity.ALLOW_UNVERIFIED, "1")
    ckpt = _save(tmp_path / "last.ckpt", background)
    shard = _replace_shard(ckpt, how)
    model, opt = _model()
    for attempt in (
        lambda: load_sharded(ckpt, model, [opt]),
        lambda: consolidate(ckpt),
        lambda: consolidate_optimizers(ckpt),
    ):
        with pytest.raises(ValueError) as caught:
            attempt()
        message = str(caught.value)
        assert message.startswith(
            f"checkpoint {ckpt}: {shard.name} is not a checkpoint shard this tool wrote ("
        ), message
        assert "Use another checkpoint" in message and "weights_only" not in message


def _shard_loads_on_rank(rank: int, world_size: int, ckpt: str) -> str:
    model, opt = _model()
    try:
        load_sharded(ckpt, model, [opt])
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


@pytest.mark.timeout(120)
def test_a_replaced_shard_is_named_on_every_rank(tmp_path: Path) -> None:
    """DCP gathers the failed read to every rank: each raises the named error, none hangs."""
    ckpt = _save(tmp_path / "last.ckpt")
    shard = _replace_shard(ckpt, "random, resealed")
    raised = run_on_ranks(_shard_loads_on_rank, 2, str(ckpt), timeout_s=90, start_method="fork")
    want = f"BadShardError: checkpoint {ckpt}: {shard.name} is not a checkpoint shard this tool"
    assert all(r.startswith(want) for r in raised), raised


def test_another_rank_failure_in_dcp_is_unwrapped_to_its_cause(tmp_path: Path) -> None:
    denied = PermissionError(13, "Permission denied", str(tmp_path / "__1_0.distcp"))
    wrapped = CheckpointException("read", {1: (denied, None)})
    cause = storage.unwrap(wrapped, tmp_path)
    assert str(cause) == (
        f"loading checkpoint {tmp_path} failed on rank 1: PermissionError: [Errno 13] "
        f"Permission denied: '{tmp_path / '__1_0.distcp'}'"
    )


@pytest.mark.parametrize("name", [files.META_FILE, files.DCP_METADATA])
def test_a_replaced_meta_or_index_is_named_without_weights_only_advice(
    tmp_path, name, background
) -> None:
    ckpt = _save(tmp_path / "last.ckpt", background)
    (ckpt / name).write_bytes(bytes([0x80, 0x02, 0xFB]) + random.Random(0).randbytes(200))
    _reseal(ckpt)
    model, opt = _model()
    for attempt in (lambda: load_sharded(ckpt, model, [opt]), lambda: consolidate(ckpt)):
        with pytest.raises(ValueError) as caught:
            attempt()
        message = str(caught.value)
        assert message.startswith(f"checkpoint {ckpt}: {name} is not a file this tool wrote ("), (
            message
        )
        assert "weights_only" not in message and not isinstance(caught.value, pickle.PickleError)


def test_a_file_is_not_a_checkpoint_and_what_one_is_is_said(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    model, opt = _model()
    with pytest.raises(ValueError, match="notes.txt is a file, not a sharded checkpoint") as caught:
        load_sharded(text, model, [opt])
    assert files.WHAT_A_CHECKPOINT_IS in str(caught.value)


def _flip_a_byte(ckpt: Path) -> None:
    shard = sorted(ckpt.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["empty", "truncated", "no files"])
def test_a_damaged_marker_does_not_switch_the_checksums_off(
    tmp_path, monkeypatch, damage, background
) -> None:
    """A flipped byte under an emptied, cut or rewritten COMPLETE: refused, naming the marker, even
    where unverified checkpoints from before checksums are allowed."""
    ckpt = _save(tmp_path / "last.ckpt", background)
    _flip_a_byte(ckpt)
    marker = ckpt / files.MARKER
    text = marker.read_text()
    marker.write_text(
        {"empty": "", "truncated": text[:40], "no files": '{"format_version": 1}'}[damage]
    )
    model, opt = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for allowed in ("0", "1"):
        monkeypatch.setenv(integrity.ALLOW_UNVERIFIED, allowed)
        for attempt in (
            lambda: load_sharded(ckpt, model, [opt]),
            lambda: consolidate(ckpt),
            lambda: _export(ckpt, tmp_path / "hf"),
        ):
            with pytest.raises(ValueError, match=f"corrupt checkpoint {ckpt}: its marker {marker}"):
                attempt()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_from_before_checksums_loads_only_when_allowed(
    tmp_path, monkeypatch, background
) -> None:
    ckpt = _save(tmp_path / "last.ckpt", background)
    _as_before_checksums(ckpt)
    model, opt = _model()
    monkeypatch.delenv(integrity.ALLOW_UNVERIFIED, raising=False)
    with pytest.raises(ValueError, match=f"set {integrity.ALLOW_UNVERIFIED}=1") as caught:
        load_sharded(ckpt, model, [opt])
    assert f"{ckpt / files.MARKER} lists no files" in str(caught.value)
    monkeypatch.setenv(integrity.ALLOW_UNVERIFIED, "1")
    with pytest.warns(UserWarning, match="saved before checksums existed"):
        load_sharded(ckpt, model, [opt])
    (ckpt / files.MARKER).unlink()  # a missing marker is an interrupted save, allowed or not
    with pytest.raises(ValueError, match=f"incomplete checkpoint {ckpt}: no COMPLETE marker"):
        load_sharded(ckpt, model, [opt])


@pytest.mark.parametrize(
    "field,value", [("n_heads", 2), ("top_k", 1), ("rope_theta", 500000.0), ("aux_loss_coef", 0.1)]
)
def test_a_changed_model_config_is_named_unless_allowed(tmp_path: Path, field, value) -> None:
    ckpt = _save(tmp_path / "last.ckpt")
    saved = getattr(ModelConfig(**CONFIG), field)
    model, opt = _model(**{field: value})  # same tensor shapes
    with pytest.raises(ValueError, match=f"checkpoint has {field}={saved!r}, model has {value!r}"):
        load_sharded(ckpt, model, [opt])
    load_sharded(ckpt, model, [opt], allow_config_change=[field])
    with pytest.raises(ValueError, match="allow_config_change names \\['nheads'\\]"):
        load_sharded(ckpt, model, [opt], allow_config_change=["nheads"])
    # fields that change nothing a loaded model computes may differ freely
    free, free_opt = _model(activation_checkpointing=True, init_std=0.5)
    load_sharded(ckpt, free, [free_opt])


_HOLD = """
import sys, time, torch
from lightning_titan.checkpoint import save_sharded
save_sharded(sys.argv[1], torch.nn.Linear(2, 2), [], {}, layout={})
print("saved", flush=True)
sys.stdin.read()  # hold the directory until the test closes our stdin
"""


@pytest.mark.timeout(120)
def test_two_jobs_on_one_directory(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    job = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(ckpts / "last.ckpt")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    try:
        assert job.stdout.readline().strip() == "saved"
        # The first job's save in progress, and a leftover of a job long dead on this host.
        host = socket.gethostname()
        live = files.sibling(ckpts / "last.ckpt", "tmp", f"{host}-{job.pid}-{'b' * 12}")
        dead = files.sibling(ckpts / "last.ckpt", "tmp", f"{host}-{2**22 + 1}-{'a' * 12}")
        live.mkdir()
        dead.mkdir()
        in_use = f"{ckpts} is in use by another job \\(pid {job.pid}"
        for saves in (None, BackgroundSaves()):  # refused before anything is staged or started
            with pytest.raises(RuntimeError, match=in_use):
                save_sharded(
                    ckpts / "other.ckpt", nn.Linear(2, 2), [], {}, layout={}, background=saves
                )
            assert saves is None or not saves.in_flight
        # the strategy claims its directories when training starts, before a step
        trainer = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(dirpath=str(ckpts))])
        with pytest.raises(RuntimeError, match=in_use):
            ShardedCheckpoints.claim(trainer, global_rank=0)
        files.recover(ckpts / "last.ckpt")  # even unlocked, recovery spares the live job's save
        assert live.exists() and not dead.exists()
        assert is_complete_checkpoint(ckpts / "last.ckpt")
    finally:
        job.send_signal(signal.SIGKILL)
        job.communicate(timeout=30)
    # The kernel freed the lock with the dead job; its leftover is now provably dead too.
    save_sharded(ckpts / "last.ckpt", nn.Linear(2, 2), [], {"second": True}, layout={})
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt"]
    assert read_checkpoint_info(ckpts / "last.ckpt")["meta"] == {"second": True}


_FILL = """
import resource, signal, sys, torch
from lightning_titan.checkpoint import BackgroundSaves, save_sharded
saves = BackgroundSaves() if sys.argv[3] == "True" else None
save_sharded(sys.argv[1], torch.nn.Linear(10, 10), [], {"i": 0}, layout={})
if sys.argv[2] == "ulimit":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))
try:
    save_sharded(sys.argv[1], torch.nn.Linear(300, 300), [], {"i": 1}, layout={}, background=saves)
    if saves is not None:
        saves.wait()  # a background write's error comes back here (or at the next save)
except OSError as e:
    print(f"OSError {e.errno}: {e}")
"""


def _mount_tmpfs(where: Path) -> bool:
    where.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(where)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["tmpfs", "ulimit"])
def test_a_full_disk_is_named_and_keeps_the_previous_checkpoint(tmp_path, how, background):
    disk = tmp_path / "disk"
    if how == "tmpfs" and not _mount_tmpfs(disk):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    disk.mkdir(exist_ok=True)
    try:
        ckpt = disk / "last.ckpt"
        run = subprocess.run([sys.executable, "-c", _FILL, str(ckpt), how, str(background)], env=ENV,
                             capture_output=True, text=True, timeout=100)  # fmt: skip
        out = run.stdout.strip()
        code, name = {"tmpfs": (28, "ENOSPC"), "ulimit": (27, "EFBIG")}[how]
        assert out.startswith(f"OSError {code}: "), run.stdout + run.stderr[-2000:]
        assert f"saving checkpoint {ckpt} failed while writing __0_0.distcp" in out
        assert name in out and f"{ckpt} still holds the previous checkpoint" in out
        assert read_checkpoint_info(ckpt)["meta"] == {"i": 0}
        assert consolidate(ckpt)["weight"].shape == (10, 10)
        assert sorted(p.name for p in disk.iterdir()) == ["last.ckpt"]
    finally:
        if how == "tmpfs":
            subprocess.run(["umount", str(disk)], check=False)


def test_other_checkpoints_are_named_not_called_interrupted(tmp_path: Path) -> None:
    """What Lightning's ModelParallelStrategy/FSDP write: DCP shards and a meta.pt, no marker."""
    foreign = tmp_path / "fsdp.ckpt"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=foreign, no_dist=True)
    torch.save({"epoch": 0, "global_step": 3}, foreign / "meta.pt")
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, plain)
    ckpt = _save(tmp_path / "dirpath" / "last.ckpt")
    model, opt = _model()
    with pytest.raises(ValueError, match="fsdp.ckpt is not a TitanStrategy checkpoint"):
        load_sharded(foreign, model, [opt])
    with pytest.raises(ValueError, match="plain.ckpt is a file, .*plain Lightning checkpoint"):
        load_sharded(plain, model, [opt])
    with pytest.raises(ValueError, match=f"is a directory of checkpoints.*e.g. {ckpt}"):
        load_sharded(ckpt.parent, model, [opt])
    (tmp_path / "empty.ckpt").mkdir()
    with pytest.raises(ValueError, match="empty.ckpt is not a TitanStrategy .*it is empty"):
        consolidate(tmp_path / "empty.ckpt")


def test_export_refuses_bad_destinations_before_loading(tmp_path: Path, monkeypatch) -> None:
    ckpt = _save(tmp_path / "ck" / "last.ckpt")
    loaded = []
    monkeypatch.setattr(export, "ModelEntries", lambda c: loaded.append(c))
    existing = tmp_path / "model.bin"
    existing.write_text("keep me")
    dangling = tmp_path / "gone"
    dangling.symlink_to(tmp_path / "nowhere")
    cases = {
        existing: f"--out {existing} is an existing file",
        dangling: f"--out {dangling} is a dangling symlink",
        ckpt / "hf": f"--out {ckpt / 'hf'} is inside the checkpoint directory {ckpt}",
    }
    for out, message in cases.items():
        with pytest.raises((FileExistsError, ValueError), match=message.replace("(", "\\(")):
            _export(ckpt, out)
    assert loaded == [] and existing.read_text() == "keep me" and not (ckpt / "hf").exists()


def _init_from_folder(folder: Path) -> Path:
    """A stand-in init_from folder: its tokenizer files and the config.json the export reads ids from."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "tokenizer.json").chmod(0o600)  # the export's copy gets the export's mode, not this
    return folder


def _save_from(path: Path, init_from: Path) -> Path:
    model, opt = _model()
    meta = {"hyper_parameters": {"init_from": str(init_from)}}
    save_sharded(path, model, [opt], meta, layout={})
    return path


def test_export_copies_no_link_out_of_init_from_and_gives_every_file_one_mode(tmp_path) -> None:
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    folder = _init_from_folder(tmp_path / "pretrained")
    (folder / "tokenizer_config.json").symlink_to(secret)
    ckpt = _save_from(tmp_path / "ck" / "last.ckpt", folder)
    out = tmp_path / "hf"
    link = folder / "tokenizer_config.json"
    with pytest.raises(ValueError, match=f"{link} is a symlink to {secret}, outside its folder"):
        _export(ckpt, out)
    assert not out.exists()

    link.unlink()  # a link that stays inside the folder is its own file: copied as a regular file
    (folder / "vocab.json").write_text("{}")
    (folder / "special_tokens_map.json").symlink_to("vocab.json")
    _export(ckpt, out)
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: oct(p.lstat().st_mode) for p in out.iterdir()}
    assert set(modes) == {
        "config.json", "model.safetensors", "tokenizer.json", "vocab.json", "special_tokens_map.json"
    }  # fmt: skip
    assert set(modes.values()) == {oct(0o100000 | 0o666 & ~umask)}, modes
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
