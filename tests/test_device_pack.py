"""scripts/device/pack.py: what travels to the GPU machine in pieces comes back whole, or
the unpacking says which piece to carry again."""

from __future__ import annotations

import importlib.util
import json
import lzma
import subprocess
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("device_pack", Path(__file__).parents[1] / "scripts/device/pack.py")
device_pack = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_pack)


def _pack(root: Path) -> tuple[bytes, bytes, list[Path]]:
    model, data = bytes(range(256)) * 5, json.dumps([{"id": "x"}]).encode()
    folders = device_pack.pack(root, 600, model, lzma.compress(data), ("gguf-0-py3-none-any.whl", b"wheel"))
    return model, data, folders


def test_pieces_fit_and_reassemble(tmp_path):
    model, data, folders = _pack(tmp_path)
    assert [f.name for f in folders] == ["a", "b", "c"]  # 1,280 model bytes in pieces of 600, then the rest
    assert all(sum(p.stat().st_size for p in f.iterdir() if p.name != "manifest.json") <= 600 for f in folders)
    paths = device_pack.unpack(tmp_path)
    assert paths["model"].read_bytes() == model and paths["data"].read_bytes() == data
    assert paths["wheel"].name == "gguf-0-py3-none-any.whl"


def test_distilled_replies_travel_into_the_work_dir(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    cache = here / device_pack.CACHE_DIR / "distill-abc.jsonl"
    cache.parent.mkdir(parents=True)
    cache.write_text('{"fingerprint": "abc"}\n{"index": 0, "messages": []}\n')
    model, data = b"m" * 700, lzma.compress(b"[]")
    device_pack.pack(here / "pieces", 600, model, data, ("w.whl", b"w"), device_pack.distilled_caches(here))
    (here / "pieces").rename(there)  # only the piece folders travel
    paths = device_pack.unpack(there)
    assert paths["distill-abc.jsonl"] == there / device_pack.CACHE_DIR / "distill-abc.jsonl"
    assert paths["distill-abc.jsonl"].read_text() == cache.read_text()
    paths["distill-abc.jsonl"].write_text("grown there")  # a resumed run appended: unpacking again keeps it
    device_pack.unpack(there)
    assert paths["distill-abc.jsonl"].read_text() == "grown there"


def test_a_missing_or_damaged_piece_names_the_folder_to_carry_again(tmp_path):
    _, _, folders = _pack(tmp_path)
    (piece,) = folders[1].iterdir()
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    with pytest.raises(SystemExit, match="damaged: carry folder b again"):
        device_pack.unpack(tmp_path)
    piece.unlink()
    with pytest.raises(SystemExit, match="missing: carry folder b again"):
        device_pack.unpack(tmp_path)
    with pytest.raises(ValueError, match="larger than a piece"):
        device_pack.pack(tmp_path / "big", 10, b"m", b"0123456789abc", ("w.whl", b"w"))


def test_the_working_tree_counts_what_travels_with_every_call(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q"], check=True)
    Path(".gitignore").write_text("ignored/\n")  # 9 bytes
    Path("tracked.txt").write_bytes(b"a" * 100)
    subprocess.run(["git", "add", "tracked.txt"], check=True)
    Path("untracked.txt").write_bytes(b"b" * 30)  # not ignored: it travels too
    Path("ignored").mkdir()
    Path("ignored/big.bin").write_bytes(b"c" * 1000)  # .devcarry's case: only when carried
    assert device_pack.working_tree_bytes() == 100 + 30 + 9
