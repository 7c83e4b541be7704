"""The served model's tokenizer, for counting prompt and output tokens in `bench_serving`.

Which one: --tokenizer if given; else --model when it names a local path or a hub id;
else what the server's /get_model_info names; else, when the server serves eaglesrv's
default model, that model's GGUF. A tokenizer built from a GGUF file takes transformers
about 12 s on a 2-core CPU, so it is saved once as a tokenizer directory in the eaglesrv
cache (keyed on the file's path, size and mtime) and loaded from there in 0.4 s after that.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger(__name__)
BUILD = 2  # 2: SmolLM's digit split restored (gguf_file.DIGITS_FIRST_PRE_TOKENIZERS)


def load_tokenizer(spec: str | None) -> Any:
    """A tokenizer from a directory, a .gguf file, a hub id, or None for the default model."""
    from transformers import AutoTokenizer

    from eaglesrv.engine.loader import DEFAULT_MODEL_NAME, ModelLoadError, default_model_path
    from eaglesrv.engine.loader.hub import download_tokenizer, looks_like_hub_id

    if spec is None or spec == DEFAULT_MODEL_NAME:
        return _gguf_tokenizer(default_model_path())
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1 and not (path / "tokenizer_config.json").exists():
            return _gguf_tokenizer(ggufs[0])
        return AutoTokenizer.from_pretrained(str(path))
    if looks_like_hub_id(spec):
        return AutoTokenizer.from_pretrained(str(download_tokenizer(spec)))
    raise ModelLoadError(f"tokenizer '{spec}' is not a directory, a .gguf file or a hub id; pass --tokenizer")


def pick_tokenizer_spec(tokenizer: str | None, model: str | None, model_info: dict | None) -> str | None:
    """The first loadable name among --tokenizer, the model's and /get_model_info's; None: the default model.

    model: the served model's name (--model, or the first id of /v1/models).
    """
    if tokenizer:
        return tokenizer
    candidates: Sequence[str | None] = (
        model, (model_info or {}).get("tokenizer_path"), (model_info or {}).get("model_path"),
    )
    for name in candidates:
        if name and _loadable(name):
            return name
    from eaglesrv.engine.loader import DEFAULT_MODEL_NAME

    if DEFAULT_MODEL_NAME in candidates:
        return None  # eaglesrv's default model: its served name is no path, so load its GGUF
    raise ValueError(f"cannot tell which tokenizer the server's model {model!r} uses; pass --tokenizer")


def _loadable(name: str) -> bool:
    from eaglesrv.engine.loader.hub import looks_like_hub_id

    return Path(name).expanduser().exists() or looks_like_hub_id(name)


def _gguf_tokenizer(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    cached = _cache_dir_for(gguf_path)
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    from eaglesrv.engine.loader.gguf_file import gguf_tokenizer_loader

    logger.info("Building the tokenizer of %s (once; cached in %s)", gguf_path, cached)
    tokenizer = gguf_tokenizer_loader(gguf_path)()
    _save_atomically(tokenizer, cached)
    return tokenizer


def _cache_dir_for(gguf_path: Path) -> Path:
    from eaglesrv.utils.package_fetch import default_cache_dir

    st = gguf_path.stat()
    # BUILD: bumped when the loader builds tokenizers differently, so older caches are rebuilt.
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{BUILD}".encode()).hexdigest()[:16]
    return default_cache_dir() / "tokenizers" / f"{gguf_path.stem}-{key}"


def _save_atomically(tokenizer: Any, target: Path) -> None:
    # Written beside the target and renamed, so a concurrent run never reads half a directory.
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, target)
    except OSError as exc:  # a read-only or racing cache only costs the next run 12 s
        logger.info("Tokenizer not cached (%s)", exc)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
