"""Fetch, on a machine with network, the wheels the lent GPU machine lacks, for
scripts/gpu_check.sh to install there (that machine reaches no network).

    python scripts/gpu_wheels.py                 # into .devcarry/wheels (ignored by git)
    # then, with the device tool: run `bash scripts/gpu_check.sh` with carry [".devcarry/wheels"]

The GPU machine (Python 3.12, Linux x86_64) has torch, triton, transformers, pytest,
httpx, numpy and more (PRESENT, from the device README's package list) but not flashinfer,
fastapi, uvicorn or pydantic. Two sets are fetched:
- flashinfer-python with apache-tvm-ffi and cuda-python (metadata only there: the machine
  has cuda-bindings), without their dependencies: this trio, installed with --no-deps,
  is what ran on the H200 (../shared/DESIGN.md);
- the server extras, the tests' OpenAI client and gguf, with their dependencies resolved
  for Python 3.12 on manylinux x86_64, less what the machine already has (typing-extensions
  is kept: pydantic-core wants a recent one).
A call carries at most 64 MiB, the working tree included: the total is printed, and the
exit status is 1 if it does not fit.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEEL_DIR = ".devcarry/wheels"

# Installed there with --no-deps (flashinfer's own requirements include packages the run
# never imports, such as nvidia-cutlass-dsl and cuda-tile).
NO_DEPS = ("flashinfer-python==0.6.18.post1", "apache-tvm-ffi==0.1.15.post2", "cuda-python==13.0.3")
# The versions the CPU test suite runs with.
WITH_DEPS = ("fastapi==0.165.0", "uvicorn==0.55.0", "pydantic==2.13.4", "openai==3.63.0", "gguf==0.19.0")
KEEP = frozenset({"typing-extensions"})  # carried even though the machine has one

TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    arg for tag in ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
                    "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                    "manylinux2014_x86_64", "manylinux1_x86_64")
    for arg in ("--platform", tag)
]

# The lent GPU machines' Python packages (device README, read 2026-11-17), names normalized.
PRESENT = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())


def project_name(wheel: str | Path) -> str:
    """A wheel file's project name, normalized as in PEP 503 (pydantic_core-2.46.4-... -> pydantic-core)."""
    return re.sub(r"[-_.]+", "-", Path(wheel).name.split("-")[0]).lower()


def prune(directory: Path) -> list[str]:
    """Delete the wheels of projects the GPU machine has (KEEP aside); returns their names."""
    removed = []
    for wheel in sorted(directory.glob("*.whl")):
        name = project_name(wheel)
        if name in PRESENT and name not in KEEP:
            wheel.unlink()
            removed.append(name)
    return removed


def duplicates(directory: Path) -> list[str]:
    """Projects with more than one wheel: pip refuses to install two versions of one."""
    names = [project_name(w) for w in directory.glob("*.whl")]
    return sorted({n for n in names if names.count(n) > 1})


def folder_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def size_report(tree_bytes: int, wheel_bytes: int, limit: int) -> tuple[bool, str]:
    """Whether the working tree and the wheels fit in one call, and a line saying so."""
    total = tree_bytes + wheel_bytes
    ok = total <= limit
    return ok, (f"working tree {tree_bytes / 1e6:.1f} MB + wheels {wheel_bytes / 1e6:.1f} MB = "
                f"{total / 1e6:.1f} MB of the {limit / 1e6:.1f} MB ({limit / 2**20:.0f} MiB) a call carries: "
                + ("fits" if ok else f"{(total - limit) / 1e6:.1f} MB too much"))


def _device_pack():
    """scripts/device/pack.py, for its measure of what travels and the call's limit."""
    spec = importlib.util.spec_from_file_location("device_pack", ROOT / "scripts/device/pack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def download(directory: Path) -> None:
    pip = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(directory)]
    subprocess.run(pip + TARGET + ["--no-deps", *NO_DEPS], check=True)
    subprocess.run(pip + TARGET + list(WITH_DEPS), check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=WHEEL_DIR, help=f"where the wheels go (default {WHEEL_DIR}, ignored by git)")
    parser.add_argument("--check-only", action="store_true", help="measure what is there; download nothing")
    args = parser.parse_args(argv)
    directory = ROOT / args.dir
    if not args.check_only:
        staging = directory.with_name(directory.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        download(staging)
        removed = prune(staging)
        print(f"left out, the GPU machine has them: {', '.join(sorted(set(removed))) or 'none'}")
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)
    if not directory.is_dir():
        print(f"{directory} does not exist: run without --check-only first", file=sys.stderr)
        return 1
    for wheel in sorted(directory.glob("*.whl")):
        print(f"  {wheel.stat().st_size / 1e6:6.2f} MB  {wheel.name}")
    if dups := duplicates(directory):
        print(f"several versions of {', '.join(dups)}: pip would refuse them", file=sys.stderr)
        return 1
    pack = _device_pack()
    ok, line = size_report(_in_root(pack.working_tree_bytes), folder_bytes(directory), pack.CALL_BYTES)
    print(line)
    return 0 if ok else 1


def _in_root(measure):
    """working_tree_bytes lists files with git from the current directory: run it from the root."""
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        return measure()
    finally:
        os.chdir(here)


if __name__ == "__main__":
    sys.exit(main())
