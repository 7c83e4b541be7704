"""The soak script, short: mixed requests at 16 in flight against the shared server. Each
finishes with the output it gets alone or a 4xx/503, none hangs, and the server ends idle
with every KV page free (scripts/soak.py checks all of it and exits non-zero otherwise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from server_fixtures import API_KEY, LiveServer, live_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow
SOAK = Path(__file__).resolve().parent.parent / "scripts" / "soak.py"


def test_a_short_soak_holds(live_server: LiveServer):
    run = subprocess.run(
        [sys.executable, str(SOAK), "--base-url", live_server.base_url, "--api-key", API_KEY, "--num-requests", "80",
         "--concurrency", "16", "--max-tokens", "8", "--request-timeout", "120"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert '"requests": 80' in run.stdout
