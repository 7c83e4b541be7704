"""One EAGLE-3 head from a weighted mean of several (a training pilot's tool).

    python scripts/average_heads.py --output-dir OUT STAGE13 STAGE14            # the mean
    python scripts/average_heads.py --output-dir OUT STAGE14:1.5 STAGE13:-0.5   # past stage 14

Heads trained one from another, each stage ending its own learning-rate decay, sit near
each other in weight space; their mean often predicts better than any one of them (the
idea behind stochastic weight averaging), and a step past the last along the last stage's
direction sometimes does too. Weights may be negative; they must sum to a positive number
and are divided by that sum. Every head must have the same config and draft vocabulary
(d2t): a row of lm_head stands for a token, and rows of different tokens must not mix.
Floating tensors are combined in float32 and written in the first head's dtype; the
vocabulary maps are copied. OUT gets config.json, model.safetensors and AVERAGE.json (the
inputs, their weights and file digests). `docs/training_heads.md` has what it gave.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

# config.json keys that describe the file, not the model
_FILE_KEYS = ("torch_dtype",)


class HeadAverageError(ValueError):
    pass


def parse_weighted(text: str) -> tuple[Path, float]:
    """DIR or DIR:WEIGHT (weight 1 when left out)."""
    path, sep, weight = text.rpartition(":")
    try:
        value = float(weight) if sep else None
    except ValueError:
        value = None  # a colon in the directory's own name
    if value is None:
        return Path(text), 1.0
    if not math.isfinite(value) or value == 0:
        raise HeadAverageError(f"{text}: the weight must be a nonzero number")
    return Path(path), value


def _read_head(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise HeadAverageError(f"{directory} is not a head directory: {path.name} is missing")
    return json.loads(config_path.read_text()), load_file(str(weights_path))


def _model_config(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in _FILE_KEYS}


def normalized(heads: Sequence[tuple[Path, float]]) -> list[tuple[Path, float]]:
    """The heads with their weights divided by the weights' sum (which must be positive)."""
    if len(heads) < 2:
        raise HeadAverageError("give at least two heads to average")
    total = sum(weight for _, weight in heads)
    if total <= 0:
        raise HeadAverageError(f"the weights sum to {total:g}; they must sum to a positive number")
    return [(directory, weight / total) for directory, weight in heads]


def average_heads(heads: Sequence[tuple[Path, float]]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config of the first head, the sum of every head's tensors times its weight);
    `heads` as `normalized` returns them."""
    first_dir = heads[0][0]
    config, first = _read_head(first_dir)
    sums = {name: t.float() * heads[0][1] if t.is_floating_point() else t for name, t in first.items()}
    for directory, weight in heads[1:]:
        other_config, tensors = _read_head(directory)
        if _model_config(other_config) != _model_config(config):
            raise HeadAverageError(f"{directory} and {first_dir} have different configs")
        if tensors.keys() != first.keys():
            raise HeadAverageError(f"{directory} and {first_dir} hold different tensors")
        for name, tensor in tensors.items():
            if tensor.shape != first[name].shape:
                raise HeadAverageError(f"{name}: shape {tuple(tensor.shape)} in {directory}, "
                                       f"{tuple(first[name].shape)} in {first_dir}")
            if tensor.is_floating_point():
                sums[name] += tensor.float() * weight
            elif not torch.equal(tensor, first[name]):
                raise HeadAverageError(f"{directory} and {first_dir} map different draft vocabularies ({name}); "
                                       "their lm_head rows stand for different tokens")
    return config, {name: t.to(first[name].dtype) for name, t in sums.items()}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python scripts/average_heads.py", description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", required=True, type=Path)
    p.add_argument("heads", nargs="+", metavar="DIR[:WEIGHT]", help="head directories, each with an optional weight")
    args = p.parse_args(argv)
    try:
        heads = normalized([parse_weighted(text) for text in args.heads])
        config, tensors = average_heads(heads)
    except HeadAverageError as exc:
        p.error(str(exc))
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    sources = [{"path": str(d), "weight": w, "sha256": _digest(d / "model.safetensors")} for d, w in heads]
    command = "python scripts/average_heads.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "AVERAGE.json").write_text(json.dumps({"command": command, "heads": sources}, indent=2))
    return out


if __name__ == "__main__":
    main()
