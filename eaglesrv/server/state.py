"""ServerState: everything the HTTP handlers share, owned by one object (no module globals).

Phases: loading (engine process starting) -> serving -> draining (SIGTERM received: new
requests get 503, in-flight ones finish) -> stopped. A dead engine also ends serving.
"""

from __future__ import annotations

import time
from typing import Callable

from eaglesrv.configs import EngineConfig, ServerConfig
from eaglesrv.engine.client import EngineClient
from eaglesrv.engine.protocol import EngineInfo
from eaglesrv.server.errors import APIError
from eaglesrv.server.metrics import ServerMetrics

OVERLOAD_RETRY_AFTER_S = 1  # what a 503 for overload tells the client to wait


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

    # ---- phases -----------------------------------------------------------------------
    def set_ready(self, info: EngineInfo, tokenizer) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.metrics = ServerMetrics(info.model_name)

    @property
    def serving(self) -> bool:
        return self.info is not None and not self.draining and self.client.is_alive

    def not_serving_reason(self) -> str:
        if not self.client.is_alive:
            return f"the engine has stopped: {self.client.dead_reason}"
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
