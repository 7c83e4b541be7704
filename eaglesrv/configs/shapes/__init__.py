"""Model shapes for speed runs with `--load-format dummy`: a directory holding only a
Hugging Face config.json, which loads with random weights and no tokenizer.

    llama-3.1-8b  meta-llama/Llama-3.1-8B-Instruct's config.json, as published
                  (8.03B parameters, 16.06 GB in bf16): the GPU benchmarks' shape
    tiny-llama    the tests' tiny Llama (tests/conftest.py's TINY_LLAMA): CPU smoke runs
"""

from __future__ import annotations

from pathlib import Path

SHAPES_DIR = Path(__file__).resolve().parent


def shape_names() -> list[str]:
    return sorted(p.parent.name for p in SHAPES_DIR.glob("*/config.json"))


def shape_path(name: str) -> Path:
    """The directory of a shipped shape, for --model-path with --load-format dummy."""
    path = SHAPES_DIR / name
    if not (path / "config.json").is_file():
        raise ValueError(f"no model shape {name!r}; shipped: {', '.join(shape_names())}")
    return path
