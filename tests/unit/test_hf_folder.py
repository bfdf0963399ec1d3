"""A Hugging Face folder's files stay inside it: links are followed, only the hub cache's snapshot ->
blobs links lead out."""

from pathlib import Path

from lightning_titan.hf.folder import outside


def test_paths_out_of_the_folder_are_named_and_the_hub_cache_links_pass(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "a.safetensors").write_bytes(b"")
    (folder / "same.safetensors").symlink_to("a.safetensors")
    (tmp_path / "secret").write_text("key")
    (folder / "key.json").symlink_to(tmp_path / "secret")
    assert outside(folder, "a.safetensors") is None
    assert outside(folder, "same.safetensors") is None
    assert outside(folder, "sub/../a.safetensors") is None
    assert outside(folder, "../secret") == tmp_path / "secret"
    assert outside(folder, tmp_path / "secret") == tmp_path / "secret"
    assert outside(folder, "key.json") == tmp_path / "secret"

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "f00d").write_text("{}")
    (snapshot / "tokenizer.json").symlink_to("../../blobs/f00d")
    (snapshot / "vocab.json").symlink_to(tmp_path / "secret")
    assert outside(snapshot, "tokenizer.json") is None
    assert outside(snapshot, "vocab.json") == tmp_path / "secret"
