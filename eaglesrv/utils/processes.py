"""Stopping a server subprocess the way its SIGTERM handler expects."""

from __future__ import annotations

import signal
import subprocess


def stop_process(process: subprocess.Popen, timeout_s: float = 60.0) -> int | None:
    """SIGTERM (the server drains and exits 0), then SIGKILL if it has not exited in
    timeout_s; returns the exit code. A process that already exited is left as it is."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
