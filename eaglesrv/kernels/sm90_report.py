"""Compile every Triton kernel build for sm_90 (H100) on any machine, and report its resources.

    python -m eaglesrv.kernels.sm90_report [module ...]

Each kernel module lists its configurations in `SM90_BUILDS` (triton_support.KernelBuild).
Every build goes through Triton's real compiler (target GPUTarget("cuda", 90, 32), the
bundled ptxas), which needs no GPU and catches what the interpreter lets through: tl.dot
tiles under 16, non-power-of-two aranges, type mismatches. One line per build: name,
registers per thread, spill bytes (the stack frame ptxas spills into; these kernels
have no other stack use) and local memory, from the bundled cuobjdump. Exit status
1 if any build fails to compile.

TRITON_INTERPRET is forced to 0 before triton is imported: the interpreter's @triton.jit
functions cannot be compiled.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"

import importlib  # noqa: E402
import importlib.util  # noqa: E402
import pkgutil  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

# Kernel modules checked by default; a package name stands for every module in it that
# defines SM90_BUILDS. Modules that do not exist yet are skipped.
DEFAULT_MODULES = (
    "eaglesrv.kernels.attention.triton_kernels",
    "eaglesrv.kernels.eagle3",
)


def kernel_modules(names: tuple[str, ...] | list[str]) -> list[str]:
    """The module names, packages expanded into their modules; missing ones left out."""
    found: list[str] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            print(f"skip {name}: not found")
            continue
        if spec.submodule_search_locations is None:
            found.append(name)
            continue
        found.extend(
            info.name for info in pkgutil.iter_modules(spec.submodule_search_locations, prefix=f"{name}.")
            if not info.ispkg
        )
    return found


def compile_build(build):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # What the launcher would pass for 16-aligned pointers and strides divisible by 16.
    attrs = {(build.kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in build.aligned}
    source = ASTSource(fn=build.kernel, signature=build.signature, constexprs=build.constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": build.num_warps})


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL ... of the cubin's kernel, as cuobjdump reports them:

        Function paged_attention_kernel:
          REG:252 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:656 ...
    """
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([tool, "--dump-resource-usage", file.name], capture_output=True, text=True,
                              check=True).stdout
    kernel_line = text.split("Function", 1)[-1].splitlines()[1:2]
    return {key: int(value) for key, value in re.findall(r"([A-Z]+):(\d+)", "".join(kernel_line))}


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(DEFAULT_MODULES)
    failures = total = 0
    for module_name in kernel_modules(names):
        try:
            builds = getattr(importlib.import_module(module_name), "SM90_BUILDS", None)
        except Exception as error:  # a kernel module that does not import is a failure too
            failures += 1
            print(f"FAIL {module_name}: import: {type(error).__name__}: {error}")
            continue
        if builds is None:
            continue
        for build in builds:
            total += 1
            started = time.perf_counter()
            try:
                compiled = compile_build(build)
                usage = resource_usage(compiled.asm["cubin"])
            except Exception as error:  # a compile error is the report's finding, not a crash
                failures += 1
                last_line = (str(error).strip().splitlines() or [type(error).__name__])[-1]
                print(f"FAIL {module_name}: {build.name}: {type(error).__name__}: {last_line}")
                continue
            seconds = time.perf_counter() - started
            print(
                f"ok   {build.name}: registers {usage.get('REG', '?')}, spills {usage.get('STACK', '?')} bytes "
                f"(stack frame; local {usage.get('LOCAL', '?')}), shared {compiled.metadata.shared} bytes, "
                f"{seconds:.1f}s"
            )
    print(f"sm_90: {total - failures} of {total} builds compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
