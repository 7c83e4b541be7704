"""Streaming on top of Engine: the step loop runs in its own thread and hands each
request's outputs to the asyncio task that asked for them.

    async for out in async_engine.stream(prompt, params):
        ...  # out.new_token_ids, out.finished

Leaving the loop early (a client that went away, a cancelled task) aborts the request,
so its KV pages are freed at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from typing import AsyncIterator

from eaglesrv.engine.llm_engine import Engine, Prompt
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.scheduler import RequestOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop failed; every open stream receives this."""


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="eaglesrv-engine-loop", daemon=True)
        self._thread.start()

    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes. Raises ValueError for a bad request."""
        if self.error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}")
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        with self._streams_lock:
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            self.engine.add_request(prompt, params, request_id)
            self._wakeup.set()
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine loop has stopped: {item!r}") from item
                finished = item.finished
                yield item
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)
                self._wakeup.set()

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> list[int]:
        """Convenience: the whole output's token ids."""
        tokens: list[int] = []
        async for out in self.stream(prompt, params):
            tokens.extend(out.new_token_ids)
        return tokens

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)

    # ---- the loop thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                if not self.engine.has_unfinished:
                    self._wakeup.wait(self._idle_wait_s)
                    self._wakeup.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # noqa: BLE001 - every stream must hear about it
            logger.exception("engine loop failed")
            self.error = exc
            with self._streams_lock:
                request_ids = list(self._streams)
            for request_id in request_ids:
                self._deliver(request_id, exc)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._streams_lock:
            target = self._streams.get(request_id)
        if target is None:
            return  # offline request, or a stream that already left
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:
            pass  # the consumer's event loop is closed
