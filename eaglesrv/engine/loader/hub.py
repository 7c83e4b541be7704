"""Hugging Face hub ids ("org/name"): fetch a snapshot with huggingface_hub, or find it cached.

Environment (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE) is read at call time, not at import,
because huggingface_hub freezes its own copy of these when it is first imported.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
from pathlib import Path

from .errors import ModelLoadError

logger = logging.getLogger(__name__)

# org/name as the hub spells them; a path that exists on disk is never treated as an id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

METADATA_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.index.json",
]


def looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and ".." not in text and "--" not in text


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_offline() -> bool:
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """The hub cache to use: download_dir, else $HF_HUB_CACHE, else $HF_HOME/hub."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _snapshot(repo_id: str, patterns: list[str], cache_dir: Path, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    offline = hub_offline()
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache_dir),
            allow_patterns=patterns,
            local_files_only=offline,
        )
    except (OSError, ValueError) as exc:  # every hub/network failure is an OSError subclass
        raise ModelLoadError(_explain(repo_id, exc, cache_dir, offline)) from exc
    return Path(path)


def _explain(repo_id: str, exc: Exception, cache_dir: Path, offline: bool) -> str:
    kind = type(exc).__name__
    if kind == "GatedRepoError":
        why = "is gated: accept its license on huggingface.co and log in with `hf auth login`"
    elif kind == "RepositoryNotFoundError":
        why = "was not found on the Hugging Face hub (check the spelling, or log in for a private repo)"
    elif kind == "RevisionNotFoundError":
        why = "has no such revision"
    elif offline:
        why = f"is not in the hub cache {cache_dir} and HF_HUB_OFFLINE is set"
    else:
        detail = (str(exc).strip().splitlines() or [kind])[0][:160]
        why = f"is not in the hub cache {cache_dir} and could not be downloaded ({detail})"
    return (
        f"model '{repo_id}' {why}; fix: run `hf download {repo_id}` on a machine with network "
        f"and copy its hub cache into {cache_dir}, or pass a local directory with --model-path"
    )


def _weight_patterns(snapshot: Path, fmt: str) -> list[str]:
    """Which weight files to fetch: the shards the index names, else every file of that format."""
    index, fallback = {
        "safetensors": ("model.safetensors.index.json", "*.safetensors"),
        "pt": ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    }[fmt]
    if (snapshot / index).is_file():
        with open(snapshot / index, encoding="utf-8") as f:
            return sorted(set(json.load(f).get("weight_map", {}).values()))
    return [fallback]


def download_model(
    repo_id: str, load_format: str, download_dir: str | None = None, revision: str | None = None
) -> Path:
    """Return a local snapshot directory for `repo_id` holding what `load_format` needs."""
    cache_dir = hub_cache_dir(download_dir)
    snapshot = _snapshot(repo_id, METADATA_PATTERNS, cache_dir, revision)
    if not (snapshot / "config.json").is_file():
        raise ModelLoadError(
            f"model '{repo_id}' has no config.json in {snapshot}; a GGUF-only repo must be "
            "downloaded and passed as a .gguf file path"
        )
    if load_format == "dummy":
        return snapshot
    fmt = "pt" if load_format == "pt" else "safetensors"
    snapshot = _snapshot(repo_id, _weight_patterns(snapshot, fmt), cache_dir, revision)
    if load_format == "auto" and not any(snapshot.glob("*.safetensors")):
        # Older repos only have pickled .bin weights.
        snapshot = _snapshot(repo_id, _weight_patterns(snapshot, "pt"), cache_dir, revision)
    logger.info("Hub model %s: snapshot %s", repo_id, snapshot)
    return snapshot


def download_tokenizer(repo_id: str, download_dir: str | None = None, revision: str | None = None) -> Path:
    """Return a local snapshot directory holding only the tokenizer files of `repo_id`."""
    patterns = [p for p in METADATA_PATTERNS if not fnmatch.fnmatch(p, "*.index.json")]
    return _snapshot(repo_id, patterns, hub_cache_dir(download_dir), revision)
