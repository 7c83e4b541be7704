"""ServerState: everything the HTTP handlers share, owned by one object (no module globals).

Phases: loading (engine process starting) -> serving -> draining (SIGTERM received: new
requests get 503, in-flight ones finish) -> stopped. A dead engine also ends serving.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from eaglesrv.configs import EngineConfig, ServerConfig
from eaglesrv.engine.client import EngineClient
from eaglesrv.engine.protocol import EngineInfo
from eaglesrv.server.errors import APIError
from eaglesrv.server.metrics import ServerMetrics

OVERLOAD_RETRY_AFTER_S = 1  # what a 503 for overload tells the client to wait
# No token covers more characters than the vocabulary's longest entry; the margin is for
# normalizers that drop characters before tokenizing.
PROMPT_CHARS_MARGIN = 2
T = TypeVar("T")


class ServerState:
    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig, client: EngineClient) -> None:
        self.server_config = server_config
        self.engine_config = engine_config
        self.client = client
        self.metrics = ServerMetrics()
        self.started_at = time.time()
        self.info: EngineInfo | None = None  # set when the engine is ready
        self.tokenizer = None
        self.draining = False
        self.startup_error: str | None = None
        self._admitted = 0  # engine requests admitted and not yet finished
        self.max_prompt_chars: int | None = None  # text longer than this cannot fit the context (set when ready)
        # Tokenizing and templating run here, one at a time, off the event loop: a huge
        # prompt must not stall /health and every stream. One worker, because a fast
        # tokenizer is not meant to be called from several threads at once.
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eaglesrv-prep")

    # ---- phases -----------------------------------------------------------------------
    def set_ready(self, info: EngineInfo, tokenizer) -> None:
        self.info = info
        self.tokenizer = tokenizer
        if tokenizer is not None:
            self.max_prompt_chars = info.max_context_len * _longest_token_chars(tokenizer) * PROMPT_CHARS_MARGIN
        self.metrics = ServerMetrics(info.model_name)

    @property
    def serving(self) -> bool:
        return self.info is not None and not self.draining and self.client.is_alive and not self.client.stall_reason

    def not_serving_reason(self) -> str:
        if not self.client.is_alive:
            return f"the engine has stopped: {self.client.dead_reason}"
        if self.client.stall_reason:
            return self.client.stall_reason
        if self.info is None:
            return "the model is still loading"
        return "the server is shutting down"

    def require_serving(self) -> EngineInfo:
        """The engine's facts; raises 503 while loading, draining, or after the engine died."""
        if not self.serving:
            raise APIError(503, self.not_serving_reason(), code="service_unavailable")
        assert self.info is not None
        return self.info

    # ---- names ------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.info.model_name if self.info else (self.engine_config.model.served_model_name or "")

    def check_model(self, requested: str | None) -> None:
        """404 unless `requested` names the served model (omitted means the served one)."""
        if requested is None or requested == "":
            return
        info = self.require_serving()
        if requested not in {info.model_name, info.model_path}:
            raise APIError(404, f"the model '{requested}' does not exist; this server serves '{info.model_name}'",
                           param="model", code="model_not_found")

    def require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer, and this server runs with --skip-tokenizer-init; "
                                "send token ids instead")
        return self.tokenizer

    async def prepare(self, build: Callable[..., T], *args) -> T:
        """build(*args) on the preparation worker (tokenizing, templating, checks)."""
        return await asyncio.get_running_loop().run_in_executor(self._prep, build, *args)

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """400 for text too long to fit the context however it tokenizes, before tokenizing it."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError(400, f"the prompt has {num_chars} characters, more than any prompt within this model's "
                                f"context of {self.info.max_context_len} tokens can have",
                           param=param, code="context_length_exceeded")

    # ---- admission --------------------------------------------------------------------
    def admit(self, num_requests: int) -> Callable[[], None]:
        """Take `num_requests` admission slots (503 when overloaded); returns their release.

        A release function rather than a context manager, because a streamed response
        outlives the handler that admitted it.
        """
        info = self.require_serving()
        queued_cap = self.server_config.max_queued_requests
        if queued_cap is not None:
            capacity = info.max_running_requests + queued_cap
            if num_requests > capacity:
                raise APIError(400, f"the request asks for {num_requests} generations (prompts x n), more than this "
                                    f"server ever holds at once ({capacity}: --max-running-requests "
                                    "+ --max-queued-requests)", param="n")
            if self._admitted + num_requests > capacity:
                raise APIError(503, f"the server is overloaded ({self._admitted} requests in flight); retry later",
                               code="overloaded", headers={"Retry-After": str(OVERLOAD_RETRY_AFTER_S)})
        self._admitted += num_requests
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._admitted -= num_requests

        return release


def _longest_token_chars(tokenizer) -> int:
    """Characters in the vocabulary's longest entry (added tokens included): a bound on how
    much text one token can stand for (byte-level entries spell one character per byte)."""
    return max(map(len, tokenizer.get_vocab()), default=1)
