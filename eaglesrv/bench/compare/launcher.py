"""Start `python -m eaglesrv.launch` on a free local port for a benchmark, and stop it after.

Used by `bench_compare`, which runs one server per configuration so that every
configuration starts from the same state (no KV pages, counters or warm caches left over),
from the installed eaglesrv or from another source tree (`--config-source`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import httpx

from eaglesrv.utils.processes import stop_process

RESERVED_FLAGS = ("--host", "--port")  # the launcher picks them


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ManagedServer:
    """A server subprocess; `with ManagedServer(args, log) as server:` waits for /health, then stops it."""

    def __init__(self, server_args: Sequence[str], log_path: Path, startup_timeout_s: float = 900.0,
                 source_dir: Path | None = None) -> None:
        """source_dir: an eaglesrv source tree (holding eaglesrv/) to run instead of the installed package."""
        clash = [flag for flag in server_args if flag.split("=")[0] in RESERVED_FLAGS]
        if clash:
            raise ValueError(f"{', '.join(clash)}: the benchmark picks the server's host and port itself")
        self.server_args = list(server_args)
        self.source_dir = Path(source_dir).resolve() if source_dir is not None else None
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "eaglesrv.launch", "--host", "127.0.0.1", "--port", str(self.port),
                *self.server_args]

    @property
    def env(self) -> dict[str, str]:
        """The subprocess's environment: ours, unbuffered, and with a source tree first on the path."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.source_dir is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.source_dir), os.environ.get("PYTHONPATH")]))
            # `python -m` puts the working directory ahead of PYTHONPATH; run from a checkout,
            # its eaglesrv/ would win. PYTHONSAFEPATH (3.11+) leaves it off.
            env["PYTHONSAFEPATH"] = "1"
        return env

    def start(self) -> "ManagedServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:  # the child keeps its own handle
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env)
        try:
            self._wait_healthy()
        except BaseException:  # Ctrl-C while it loads must not leave it running
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.5)
        raise ServerStartError(f"the server was not healthy after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (the server drains and exits 0), then SIGKILL if it does not."""
        if self.process is not None:
            stop_process(self.process, timeout_s)

    def __enter__(self) -> "ManagedServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
