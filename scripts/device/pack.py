"""Ship what head training needs to the lent GPU machine, in pieces that each fit one call.

A call carries at most 64 MiB, the working tree included (22 MB in December 2026), and the
GPU machine reaches no network. Training needs the default model's GGUF (98 MB), the
training split of ShareGPT (49 MB of JSON, 9 MB as xz) and the `gguf` package's wheel.
Replies distilled here ahead of time (`train_eagle3 --distill-only`, into
.devcarry/run/work) go too, xz'd, and come out in the same place there, so the GPU's
minutes go to training. `pack` cuts them into folders under .devcarry/ (ignored by git),
each at most what a call leaves beside the working tree as it is now (or --piece-mb MB).
Each device call carries one folder (`carry: [".devcarry/a"]`, then b, ...), back to back while the
machine is warm, which keeps the folders earlier calls left. `unpack`, run there in the
last call, checks every piece against the manifest and rebuilds the files.

    python scripts/device/pack.py pack            # here
    python scripts/device/pack.py unpack          # on the device machine, after the last piece

The data file holds the first 8,000 usable conversations only (the held-out rule), in
ShareGPT's format, so `--data-path` on it selects the same conversations as the
shipped file does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import string
import subprocess
import sys
from pathlib import Path

MANIFEST = "manifest.json"
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA_NAME = "train_split.json"
GGUF_WHEEL = "gguf==0.19.0"
CACHE_DIR = "run/work"  # under --dir: train_head.sh's --work-dir
PIECE_FOLDERS = tuple(string.ascii_lowercase)
CALL_BYTES = 64 * 2**20  # what one device call carries: the working tree and one folder
MARGIN_BYTES = 2 * 10**6  # room for files written between packing and the call


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def training_split_json() -> bytes:
    from eaglesrv.data import training_split

    records = [{"id": c.id, "conversations": [{"from": t.role, "value": t.text} for t in c.turns]}
               for c in training_split(None)]
    return json.dumps(records).encode()


def working_tree_bytes() -> int:
    """What travels with every call besides the carried folder: tracked files and untracked
    ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.split(b"\0")
    paths = [Path(name.decode()) for name in listed if name]
    return sum(path.stat().st_size for path in paths if path.is_file())  # a deleted, uncommitted file lists too


def gguf_wheel(directory: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "-d", str(directory), GGUF_WHEEL], check=True)
    (wheel,) = directory.glob("gguf-*.whl")
    return wheel


def gather(staging: Path) -> tuple[bytes, bytes, tuple[str, bytes]]:
    """(the model's GGUF, the training split as xz'd JSON, (wheel name, wheel)) from this machine."""
    from eaglesrv.engine.loader import default_model_path

    wheel = gguf_wheel(staging)
    return (default_model_path().read_bytes(), lzma.compress(training_split_json(), preset=6),
            (wheel.name, wheel.read_bytes()))


def distilled_caches(root: Path) -> dict[str, bytes]:
    """The self-distillation caches under root/CACHE_DIR, each xz'd, by file name."""
    return {path.name: lzma.compress(path.read_bytes(), preset=6)
            for path in sorted((root / CACHE_DIR).glob("distill-*.jsonl"))}


def pack(root: Path, piece_bytes: int, model: bytes, data_xz: bytes, wheel: tuple[str, bytes],
         caches_xz: dict[str, bytes] | None = None) -> list[Path]:
    """Cut the files into pieces, fill folders a, b, ... in order; returns the folders."""
    pieces = [(f"{MODEL_NAME}.{k:02d}", model[start:start + piece_bytes])
              for k, start in enumerate(range(0, len(model), piece_bytes))]
    pieces += [(DATA_NAME + ".xz", data_xz), wheel]
    pieces += [(name + ".xz", blob) for name, blob in sorted((caches_xz or {}).items())]
    folders: list[list[tuple[str, bytes]]] = [[]]
    for name, blob in pieces:  # first fit, in order: the model's pieces first
        if len(blob) > piece_bytes:
            raise ValueError(f"{name} ({len(blob)} bytes) is larger than a piece ({piece_bytes} bytes)")
        if sum(len(b) for _, b in folders[-1]) + len(blob) > piece_bytes:
            folders.append([])
        folders[-1].append((name, blob))
    manifest = {"model": {"name": MODEL_NAME, "sha256": sha256(model)}, "data": {"name": DATA_NAME},
                "caches": sorted(caches_xz or {}), "pieces": []}
    paths = []
    for letter, contents in zip(PIECE_FOLDERS, folders):
        folder = root / letter
        folder.mkdir(parents=True)
        for name, blob in contents:
            (folder / name).write_bytes(blob)
            manifest["pieces"].append({"folder": letter, "name": name, "bytes": len(blob), "sha256": sha256(blob)})
        paths.append(folder)
    (paths[-1] / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return paths


def unpack(root: Path) -> dict[str, Path]:
    """Check every piece, rebuild the model and the data; returns their paths (and the wheel)."""
    (manifest_path,) = root.glob(f"*/{MANIFEST}")
    manifest = json.loads(manifest_path.read_text())
    blobs = {}
    for piece in manifest["pieces"]:
        path = root / piece["folder"] / piece["name"]
        if not path.exists():
            raise SystemExit(f"{path} is missing: carry folder {piece['folder']} again (was the machine given back?)")
        blob = path.read_bytes()
        if sha256(blob) != piece["sha256"]:
            raise SystemExit(f"{path} is damaged: carry folder {piece['folder']} again")
        blobs[piece["name"]] = blob
    model_name = manifest["model"]["name"]
    model = b"".join(blobs[name] for name in sorted(n for n in blobs if n.startswith(model_name + ".")))
    if sha256(model) != manifest["model"]["sha256"]:
        raise SystemExit("the reassembled model does not match its checksum")
    out = root / "unpacked"
    out.mkdir(exist_ok=True)
    (out / model_name).write_bytes(model)
    (out / manifest["data"]["name"]).write_bytes(lzma.decompress(blobs[manifest["data"]["name"] + ".xz"]))
    (wheel,) = [n for n in blobs if n.endswith(".whl")]
    (out / wheel).write_bytes(blobs[wheel])
    paths = {"model": out / model_name, "data": out / manifest["data"]["name"], "wheel": out / wheel}
    for name in manifest.get("caches", []):  # a cache there already is newer: resumed runs append to it
        cache = root / CACHE_DIR / name
        if not cache.exists():
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_bytes(lzma.decompress(blobs[name + ".xz"]))
        paths[name] = cache
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("--dir", default=".devcarry", help="the folder the pieces live in")
    parser.add_argument("--piece-mb", type=float, default=None,
                        help="MB per carried folder, at most (default: what a call leaves beside the working tree)")
    args = parser.parse_args()
    root = Path(args.dir)
    if args.action == "pack":
        for old in [root / letter for letter in PIECE_FOLDERS] + [root / "staging"]:
            if old.exists():
                shutil.rmtree(old)  # the pieces only: root/CACHE_DIR is what this packs
        staging = root / "staging"
        staging.mkdir(parents=True)
        files = gather(staging)
        shutil.rmtree(staging)
        tree = working_tree_bytes()
        piece_bytes = int(args.piece_mb * 1e6) if args.piece_mb else CALL_BYTES - tree - MARGIN_BYTES
        print(f"working tree {tree / 1e6:.1f} MB: pieces of at most {piece_bytes / 1e6:.1f} MB")
        for folder in pack(root, piece_bytes, *files, distilled_caches(root)):
            size = sum(f.stat().st_size for f in folder.iterdir())
            print(f"{folder}: {size / 1e6:.1f} MB ({', '.join(sorted(f.name for f in folder.iterdir()))})")
    else:
        for what, path in unpack(root).items():
            print(f"{what}: {path}")


if __name__ == "__main__":
    main()
