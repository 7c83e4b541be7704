"""Models in the Hugging Face directory layout: config.json plus safetensors (or .bin) shards."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import ModelLoadError
from .source import ModelSource, SliceChooser, WeightStream, choose_slice

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def has_tokenizer_files(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def hf_tokenizer_loader(directory: Path) -> Callable[[], Any]:
    """A deferred AutoTokenizer.from_pretrained: tokenizers are slow to build and often unused."""

    def load() -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory))

    return load


def _files_from_index(directory: Path, index_name: str) -> list[Path]:
    weight_map = read_json(directory / index_name).get("weight_map", {})
    files = [directory / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(
            f"{directory / index_name} lists weight files that are missing: {', '.join(missing[:3])}"
        )
    return files


def find_weight_files(directory: Path, load_format: str) -> tuple[str, list[Path]]:
    """Pick the weight files and their format ("safetensors" or "pt") for `load_format`.

    The index, when present, is authoritative: some repos also ship a consolidated copy of
    the same weights under another name, and loading both would double every tensor.
    """
    if load_format in ("auto", "safetensors"):
        if (directory / SAFETENSORS_INDEX).is_file():
            return "safetensors", _files_from_index(directory, SAFETENSORS_INDEX)
        files = sorted(directory.glob("*.safetensors"))
        if files:
            return "safetensors", files
        if load_format == "safetensors":
            raise ModelLoadError(f"no *.safetensors files in {directory} (load_format=safetensors)")
    if (directory / BIN_INDEX).is_file():
        return "pt", _files_from_index(directory, BIN_INDEX)
    files = sorted(directory.glob("pytorch_model*.bin"))
    if files:
        return "pt", files
    raise ModelLoadError(
        f"no weights in {directory}: expected *.safetensors or pytorch_model*.bin files "
        "(use --load-format dummy for random weights)"
    )


def iter_safetensors(files: list[Path], choose: SliceChooser | None = None) -> WeightStream:
    from safetensors import safe_open

    for path in files:
        # safe_open memory-maps the file, so each tensor (or slice of one) is read only when asked for.
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                part = f.get_slice(name)
                chosen = choose_slice(choose, name, tuple(part.get_shape()))
                if chosen is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, length = chosen
                index = (slice(None),) * dim + (slice(start, start + length),)
                yield name, part[index].contiguous()


def iter_torch_bin(files: list[Path], choose: SliceChooser | None = None) -> WeightStream:
    for path in files:
        # weights_only: a .bin is a pickle, and unpickling arbitrary objects runs code.
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # files from torch < 1.6 (legacy format) cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
        for name, tensor in state.items():
            chosen = choose_slice(choose, name, tuple(tensor.shape))
            if chosen is not None:
                # A copy, even of a contiguous slice: a view would keep the whole mapping alive.
                tensor = tensor.narrow(*chosen).clone(memory_format=torch.contiguous_format)
            yield name, tensor
        del state


def load_hf_dir(directory: Path, load_format: str, description: str = "") -> ModelSource:
    """Resolve a directory holding config.json (a local model or a hub snapshot)."""
    config = read_json(directory / "config.json")
    generation_config: dict[str, Any] = {}
    if (directory / "generation_config.json").is_file():
        generation_config = read_json(directory / "generation_config.json")

    iter_weights: Callable[..., WeightStream] | None = None
    if load_format != "dummy":
        fmt, files = find_weight_files(directory, load_format)
        reader = iter_safetensors if fmt == "safetensors" else iter_torch_bin
        iter_weights = lambda choose=None: reader(files, choose)  # noqa: E731 - a fresh stream per call
        logger.info("Weights: %d %s file(s) in %s", len(files), fmt, directory)

    tokenizer = hf_tokenizer_loader(directory) if has_tokenizer_files(directory) else None
    return ModelSource(
        hf_config=config,
        iter_weights=iter_weights,
        load_tokenizer=tokenizer,
        generation_config=generation_config,
        description=description or f"Hugging Face directory {directory}",
    )
