"""A live eaglesrv server for the server tests: a `python -m eaglesrv.launch` subprocess on a
free port, on the default model (SmolLM2-135M-Instruct), waited on until /health is 200.

One shared server per pytest run (kept in the session's stash), so the whole suite pays
for one model load; tests that must stop a server start their own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from eaglesrv.utils.processes import stop_process

API_KEY = "test-key"
CONTEXT_LENGTH = 1024
# Small pool and context keep memory low; the byte limit is small so the 413 test is cheap.
SHARED_ARGS = (
    "--api-key", API_KEY, "--enable-metrics", "--context-length", str(CONTEXT_LENGTH),
    "--max-total-tokens", "8192", "--max-request-bytes", str(1 << 20),
)
_SHARED = pytest.StashKey["LiveServer"]()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    def __init__(self, *args: str, api_key: str | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="eaglesrv-server-", suffix=".log")[1])
        self._log = self.log_path.open("w")
        self.health_codes: list[int] = []  # every /health answer seen while starting
        # One torch thread: the test process computes references at the same time, and two
        # processes each splitting every op over both cores stall on each other.
        threads = () if "--num-threads" in args else ("--num-threads", "1")
        # float32, the oracle the tests compare with: --dtype auto picks bfloat16 on CPUs with bf16 units.
        dtype = () if "--dtype" in args else ("--dtype", "float32")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "eaglesrv.launch", "--port", str(self.port), *threads, *dtype, *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=120, **kwargs)

    def wait_healthy(self, timeout_s: float = 240.0) -> "LiveServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                code = httpx.get(f"{self.base_url}/health", timeout=5).status_code
                self.health_codes.append(code)
                if code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()[-6000:]

    def server_info(self) -> dict:
        with self.client() as client:
            response = client.get("/get_server_info")
        response.raise_for_status()
        return response.json()

    def kv_state(self) -> tuple[int, int, int]:
        """(KV pages a request could get: free, or cached for nobody; running requests, waiting requests)."""
        state = self.server_info()["internal_states"][0]
        available = state["kv_pages_free"] + state.get("prefix_cache_evictable_pages", 0)
        return available, state["num_running_reqs"], state["num_waiting_reqs"]

    def wait_idle(self, free_pages: int, timeout_s: float = 60.0) -> tuple[int, int, int]:
        """Poll until nothing runs and `free_pages` pages are free; the last state seen."""
        deadline = time.monotonic() + timeout_s
        state = self.kv_state()
        while state != (free_pages, 0, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
            state = self.kv_state()
        return state

    def stop(self, timeout_s: float = 60.0) -> int:
        code = stop_process(self.process, timeout_s)
        self._log.close()
        return code


def byte_level_tokenizer():
    """A small byte-level BPE tokenizer, trained in milliseconds: multi-byte characters come
    out split over several tokens, as in SmolLM2's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["The capital of France is Paris.", "hello world, hello there", "naïve café", "日本語のテキスト",
              "emoji 🦅🌱 ok"]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(corpus * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")


@pytest.fixture(scope="module")
def live_server(request) -> LiveServer:
    """The run's shared server (started on first use, stopped at the end of the run)."""
    stash = request.session.stash
    if _SHARED not in stash:
        server = LiveServer(*SHARED_ARGS, api_key=API_KEY)
        request.config.add_cleanup(server.stop)
        stash[_SHARED] = server.wait_healthy()
    return stash[_SHARED]


@pytest.fixture(scope="module")
def http(live_server: LiveServer):
    with live_server.client() as client:
        yield client
