"""scripts/gpu_check.sh parses, picks its GPU tests by marker, and scripts/gpu_wheels.py's
pruning and size check work (without downloading anything)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts/gpu_check.sh"

spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts/gpu_wheels.py")
gpu_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_wheels)


def test_gpu_check_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_gpu_check_finds_the_gpu_test_files_by_marker():
    """The files the script's grep selects are exactly those that mark tests gpu."""
    (pattern,) = re.findall(r"grep -l '([^']+)' tests/test_\*\.py", SCRIPT.read_text())
    selected = {p.name for p in (ROOT / "tests").glob("test_*.py") if re.search(pattern, p.read_text())}
    assert {"test_gpu.py", "test_graph_capture.py"} <= selected
    assert "test_bench_gpu.py" not in selected


def test_wheel_names_are_normalized():
    assert gpu_wheels.project_name("pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.whl") == "pydantic-core"
    assert gpu_wheels.project_name("typing_extensions-4.16.0-py3-none-any.whl") == "typing-extensions"
    assert gpu_wheels.project_name(Path("x/Flashinfer_Python-0.6.18.post1-py3-none-any.whl")) == "flashinfer-python"


def test_prune_drops_what_the_gpu_machine_has(tmp_path):
    names = ["numpy-2.5.5-cp312-cp312-manylinux_2_28_x86_64.whl", "fastapi-0.165.0-py3-none-any.whl",
             "typing_extensions-4.16.0-py3-none-any.whl", "PyYAML-6.0.4-cp312-cp312-manylinux2014_x86_64.whl",
             "flashinfer_python-0.6.18.post1-py3-none-any.whl"]
    for name in names:
        (tmp_path / name).write_bytes(b"w")
    assert gpu_wheels.prune(tmp_path) == ["pyyaml", "numpy"]  # in file-name order: upper case sorts first
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["fastapi", "flashinfer_python",
                                                                       "typing_extensions"]
    (tmp_path / "fastapi-0.164.0-py3-none-any.whl").write_bytes(b"w")
    assert gpu_wheels.duplicates(tmp_path) == ["fastapi"]


def test_the_flashinfer_trio_is_pinned_as_measured():
    assert "flashinfer-python==0.6.18.post1" in gpu_wheels.NO_DEPS
    assert "apache-tvm-ffi==0.1.15.post2" in gpu_wheels.NO_DEPS
    assert any(pin.startswith("cuda-python") for pin in gpu_wheels.NO_DEPS)
    needed = {pin.split("==")[0] for pin in gpu_wheels.WITH_DEPS}
    assert {"fastapi", "uvicorn", "pydantic"} <= needed and not needed & gpu_wheels.PRESENT


def test_size_report(tmp_path):
    (tmp_path / "a.whl").write_bytes(b"x" * 3000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.whl").write_bytes(b"x" * 1000)
    assert gpu_wheels.folder_bytes(tmp_path) == 4000
    ok, line = gpu_wheels.size_report(22_000_000, 28_000_000, 64 * 2**20)
    assert ok and line.startswith("working tree 22.0 MB + wheels 28.0 MB = 50.0 MB of the 67.1 MB (64 MiB)")
    ok, line = gpu_wheels.size_report(40_000_000, 28_000_000, 64 * 2**20)
    assert not ok and line.endswith("0.9 MB too much")
