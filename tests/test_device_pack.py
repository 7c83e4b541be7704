"""scripts/device/pack.py: what travels to the GPU machine in pieces comes back whole, or
the unpacking says which piece to carry again."""

from __future__ import annotations

import importlib.util
import json
import lzma
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
