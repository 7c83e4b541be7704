"""Builds (once per machine) and loads the C++ paged-attention kernel for the CPU.

torch.utils.cpp_extension compiles csrc/paged_attention_cpu.cpp with the machine's g++ and
caches the result under $TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions); later
loads take well under a second. The build uses -march=native, so the extension's name
carries a hash of the CPU's feature flags: a cache copied to a different CPU (a Docker
image, a shared home directory) builds afresh instead of loading code that may not run.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import platform
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# -ffast-math lets the softmax exp vectorize; the kernel uses no infinities or NaNs.
# -fopenmp: at::parallel_for is an inline OpenMP loop, serial without it. The extension
# then needs libgomp.so.1, and the dynamic loader reuses the one torch has already loaded,
# so both share one thread pool.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
LDFLAGS = ["-fopenmp"]


def _cpu_signature() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


@functools.cache
def load_cpu_attention() -> ModuleType:
    """The compiled module; raises RuntimeError (with the compiler's reason) if it cannot build."""
    from torch.utils import cpp_extension

    name = f"eaglesrv_paged_attention_cpu_{_cpu_signature()}"
    started = time.monotonic()
    if not _is_built(cpp_extension, name):
        logger.info("compiling the CPU paged-attention kernel (once per machine, about 30 s)")
    try:
        with _build_lock(name, cpp_extension):
            module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                                          extra_ldflags=LDFLAGS, verbose=False)
    except Exception as error:  # compiler missing, headers missing, ninja missing...
        raise RuntimeError(f"could not build the CPU attention kernel: {error}") from error
    logger.info("CPU paged-attention kernel ready in %.1f s", time.monotonic() - started)
    return module


@contextlib.contextmanager
def _build_lock(name: str, cpp_extension):
    """One build or load at a time per machine: two servers starting together on a fresh
    machine otherwise race on the build directory, and one fails to link."""
    root = Path(cpp_extension.get_default_build_root())
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _is_built(cpp_extension, name: str) -> bool:
    try:
        return (Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:  # a private helper of torch's: if it moves, only the log line suffers
        return False


def cpu_attention_available() -> bool:
    try:
        load_cpu_attention()
    except RuntimeError as error:
        logger.warning("%s; falling back to the torch attention backend", error)
        return False
    return True


if __name__ == "__main__":  # `python -m eaglesrv.kernels.attention.cpu_build`: build ahead of time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load_cpu_attention()
