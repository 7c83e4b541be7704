"""EAGLE-3 heads shipped with eaglesrv, in the published format (each directory holds
config.json, model.safetensors and TRAINING.json: the command, data and time that made it).

    smollm2-135m-eagle3/   for the default model, SmolLM2-135M-Instruct
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_HEAD = Path(__file__).parent / "smollm2-135m-eagle3"


def default_model_head() -> Path | None:
    """The head the default model speculates with, or None if this install lacks it."""
    return DEFAULT_MODEL_HEAD if (DEFAULT_MODEL_HEAD / "model.safetensors").exists() else None
