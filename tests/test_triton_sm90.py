"""Every Triton kernel build compiles for sm_90 (H100), without a GPU.

The interpreter the other tests use accepts kernels a GPU compile rejects (tl.dot tiles under
16, non-power-of-two aranges); this runs the real compiler. The report prints each build's
registers and spills: `pytest -s tests/test_triton_sm90.py` shows them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_build_compiles_for_sm90():
    # A subprocess: the report needs TRITON_INTERPRET=0 from before triton is imported.
    result = subprocess.run(
        [sys.executable, "-m", "eaglesrv.kernels.sm90_report"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    print(result.stdout, result.stderr[-4000:], sep="\n")
    assert result.returncode == 0, f"sm_90 compile failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    assert " builds compiled" in result.stdout
