"""Run the server: engine process + HTTP, from start-up to a clean exit.

    loading   HTTP is up at once: /health answers 503 while the engine process loads;
              a load failure is logged and ends the server with exit code 1.
    serving   /health 200.
    draining  SIGTERM or SIGINT: stop accepting connections, answer new requests on open
              ones with 503, let in-flight requests finish (at most
              --graceful-shutdown-timeout seconds), then stop the engine; exit code 0.
    stalled   the engine has not answered for --watchdog-timeout seconds (EngineClient.watchdog):
              /health answers 503 and requests fail with 503 until it answers again.
    A second SIGINT forces the exit. If the engine process dies, the server exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Callable

import uvicorn

from eaglesrv.configs import EngineConfig, ServerConfig
from eaglesrv.engine.client import EngineClient, EngineStartupError
from eaglesrv.server.app import build_app
from eaglesrv.server.state import ServerState

logger = logging.getLogger(__name__)


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, telling us when a signal starts the shutdown.

    uvicorn re-raises a captured signal after serving, which would end the process with
    "killed by SIGTERM" instead of exit code 0; this server does not record signals.
    """

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


async def serve(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    """Serve until shut down; the process exit code."""
    client = EngineClient.spawn(engine_config, server_config.log_level)
    state = ServerState(server_config, engine_config, client)
    exit_code = 0

    def begin_drain() -> None:
        if not state.draining:
            logger.info("shutting down: finishing in-flight requests (at most %.0f s)",
                        server_config.shutdown_timeout_s)
        state.draining = True

    server = _GracefulServer(
        uvicorn.Config(
            build_app(state), host=server_config.host, port=server_config.port, log_level=server_config.log_level,
            access_log=server_config.log_level == "debug", lifespan="off",
            timeout_graceful_shutdown=server_config.shutdown_timeout_s,
        ),
        on_signal=begin_drain,
    )

    def fail(reason: str) -> None:
        nonlocal exit_code
        exit_code = 1
        logger.error("%s; shutting down", reason)
        server.should_exit = True

    client.on_death = fail

    async def wait_for_engine() -> None:
        try:
            info, tokenizer = await client.wait_ready()
        except EngineStartupError as exc:
            fail(f"the engine failed to start: {exc}")
            return
        state.set_ready(info, tokenizer)
        watchdog.append(asyncio.create_task(client.watchdog(server_config.watchdog_timeout_s)))
        logger.info(
            "ready: serving %s at http://%s:%d (context %d tokens, KV cache %d tokens, %s on %s)",
            info.model_name, server_config.host, server_config.port, info.max_context_len,
            info.num_pages * info.page_size, info.dtype, info.device,
        )

    watchdog: list[asyncio.Task] = []
    startup = asyncio.create_task(wait_for_engine())
    try:
        await server.serve()
    finally:
        for task in (startup, *watchdog):
            task.cancel()
        state.draining = True
        engine_exit = await asyncio.to_thread(client.shutdown)
        logger.info("engine process stopped (exit code %s)", engine_exit)
    return exit_code
