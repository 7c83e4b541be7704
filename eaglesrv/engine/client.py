"""The API process's handle on the engine process.

    client = EngineClient.spawn(engine_config, "info")   # inside a running event loop
    info, tokenizer = await client.wait_ready()
    async with aclosing(client.stream(token_ids, params)) as outputs:
        async for out in outputs: ...                     # EngineOutput per step

The client names its requests itself (a counter), so ids never clash on this side; the
engine's own check (Engine.add_request) is the one place that refuses a duplicate id.

Two threads touch the pipes, so the event loop never blocks on them: a reader blocks on
the engine's pipe and hands each message to the event loop, and a writer sends what the
loop queued (a long prompt can exceed the pipe's buffer, and the engine reads only
between steps). The stream table and futures live on the event loop thread alone.
Leaving a stream early (client gone, stop string matched, task cancelled) sends
AbortRequest, so the engine frees the request's pages at its next step. The watchdog
(`watchdog()`, a task the server runs) notices an engine that has stopped answering.

With tensor parallelism spawn() starts this node's other ranks too (they talk to rank 0
only, through torch.distributed); a third thread waits on them, so a rank that exits ends
the engine for the server at once, and shutdown() leaves none behind.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import queue
import threading
import time
from typing import AsyncIterator, Callable

from eaglesrv.configs import EngineConfig
from eaglesrv.engine import protocol as msg
from eaglesrv.engine.follower_process import start_followers, stop_followers
from eaglesrv.engine.parallel.ranks import node_placements
from eaglesrv.engine.process import engine_process_main
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.scheduler import RequestRejected

logger = logging.getLogger(__name__)


class EngineStartupError(RuntimeError):
    """The engine process could not load the model; the message says why."""


class EngineDeadError(RuntimeError):
    """The engine process has stopped; no more requests can be served."""


class EngineStalledError(EngineDeadError):
    """The engine process has made no progress for the watchdog's time. Open requests fail
    with it and new ones are refused (503, as for a dead engine) until the engine is heard
    from again; it may recover (a stopped process that is continued)."""


PING_QUERY_ID = -1  # a stats query nobody waits for: its reply only shows the engine is alive


class EngineClient:
    def __init__(self, process, to_engine, from_engine, loop: asyncio.AbstractEventLoop,
                 followers: list | None = None) -> None:
        self._process = process
        self._followers = followers or []  # the other tensor-parallel ranks on this node
        self._to_engine = to_engine
        self._from_engine = from_engine
        self._loop = loop
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()  # messages for the writer thread; None ends it
        self._streams: dict[str, asyncio.Queue] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._request_ids = itertools.count()
        self._ready: asyncio.Future = loop.create_future()
        self.dead_reason: str | None = None  # set once the engine process is gone
        self.stall_reason: str | None = None  # set by the watchdog while the engine is silent
        self._last_heard = time.monotonic()  # the engine's last message, of any kind
        self._pinged = False  # a ping is out since the engine was last heard
        self.on_death: Callable[[str], None] | None = None  # called once, on the loop thread
        self._closing = False
        self._loaded = False  # EngineReady arrived: the process reads its inbox
        self._reader = threading.Thread(target=self._read_loop, name="eaglesrv-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name="eaglesrv-engine-writer", daemon=True)
        self._reader.start()
        self._writer.start()
        if self._followers:
            threading.Thread(target=self._watch_followers, name="eaglesrv-rank-watch", daemon=True).start()

    @classmethod
    def spawn(cls, config: EngineConfig, log_level: str = "info") -> "EngineClient":
        """Start the engine process (it loads the model in the background)."""
        ctx = multiprocessing.get_context("spawn")  # no fork: torch and threads do not survive it
        engine_inbox, to_engine = ctx.Pipe(duplex=False)
        from_engine, engine_outbox = ctx.Pipe(duplex=False)
        leader, *others = node_placements(config.parallel)
        followers = start_followers(config, others, log_level)
        process = ctx.Process(
            target=engine_process_main, args=(config, log_level, engine_inbox, engine_outbox, leader),
            name="eaglesrv-engine", daemon=True,
        )
        process.start()
        # Our copies of the engine's ends must go, or we would never see EOF when it dies.
        engine_inbox.close()
        engine_outbox.close()
        return cls(process, to_engine, from_engine, asyncio.get_running_loop(), followers)

    # ---- lifecycle ----------------------------------------------------------------------
    async def wait_ready(self) -> tuple[msg.EngineInfo, object | None]:
        """The engine's facts and tokenizer, once loaded. Raises EngineStartupError."""
        ready: msg.EngineReady = await asyncio.shield(self._ready)
        tokenizer = pickle.loads(ready.tokenizer_pickle) if ready.tokenizer_pickle is not None else None
        return ready.info, tokenizer

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    def shutdown(self, timeout_s: float = 10.0) -> int | None:
        """Ask the engine process to exit, wait for it, kill it if it does not; its exit code.

        Blocks (call it from a thread when the event loop must keep running).
        """
        self._closing = True
        if self._process.is_alive() and self._loaded:
            self._send(msg.Shutdown())
            self._process.join(timeout_s)
        elif self._process.is_alive():
            self._process.join(min(timeout_s, 1.0))  # a start-up failure is on its way out already
        if self._process.is_alive():
            if self._loaded:
                logger.warning("engine process did not exit within %.0f s; killing it", timeout_s)
            self._process.kill()  # still loading: it holds no requests, and would not read Shutdown yet
            self._process.join(5.0)
        # rank 0 stopped them on its way out, unless it failed
        stop_followers(self._followers, timeout_s if self._process.exitcode == 0 else 1.0)
        self._outgoing.put(None)
        self._writer.join(5.0)
        self._to_engine.close()
        return self._process.exitcode

    async def watchdog(self, timeout_s: float) -> None:
        """Run while the engine lives: ping it once it has been quiet for a third of
        `timeout_s` (it answers between two steps, busy or idle); after `timeout_s` of
        silence, fail every open stream and report the engine stalled until it is heard
        from again."""
        while self.is_alive:
            await asyncio.sleep(min(timeout_s / 6, 1.0))
            quiet = time.monotonic() - self._last_heard
            if not self._loaded or quiet < timeout_s / 3:
                continue
            if not self._pinged:
                self._pinged = True
                self._send(msg.StatsQuery(PING_QUERY_ID))
            if quiet >= timeout_s and self.stall_reason is None:
                self._stall(f"the engine has made no progress for {quiet:.0f} s (--watchdog-timeout {timeout_s:g})")

    # ---- requests -----------------------------------------------------------------------
    async def stream(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[msg.EngineOutput]:
        """Yield a new request's outputs until it finishes; raises RequestRejected (the
        engine refused it: the message says why) or EngineDeadError.

        Use it under contextlib.aclosing, so that leaving early aborts at once.
        """
        if not self.is_alive:
            raise EngineDeadError(f"the engine has stopped: {self.dead_reason}")
        request_id = str(next(self._request_ids))
        inbox: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = inbox
        finished = False
        try:
            self._send(msg.AddRequest(request_id, list(prompt_token_ids), params))
            while not finished:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it, or is gone
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.is_alive:
                self._send(msg.AbortRequest(request_id))

    async def stats(self, timeout_s: float = 10.0, flush_cache: bool = False) -> msg.EngineStats:
        """A fresh scheduler snapshot from the engine process (taken between two steps),
        after evicting every cached page no request uses if `flush_cache`."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine has stopped: {self.dead_reason}")
        query_id = next(self._query_ids)
        future = self._loop.create_future()
        self._stats_waiters[query_id] = future
        try:
            self._send(msg.StatsQuery(query_id, flush_cache))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._stats_waiters.pop(query_id, None)

    # ---- plumbing -----------------------------------------------------------------------
    def _send(self, message) -> None:
        self._outgoing.put(message)

    def _write_loop(self) -> None:
        """Writer thread: send queued messages in order, blocking here rather than on the loop."""
        while (message := self._outgoing.get()) is not None:
            try:
                self._to_engine.send(message)
            except (OSError, ValueError) as exc:  # broken pipe or closed handle: the engine is gone
                self._call_on_loop(self._mark_dead, f"cannot reach the engine process ({exc})")
                return

    def _read_loop(self) -> None:
        """Reader thread: block on the pipe, hand every message to the event loop."""
        reason = None
        while True:
            try:
                message = self._from_engine.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # noqa: BLE001 - any decoding failure
                # Some request's output is lost and nobody can tell whose: rather than leave
                # its stream waiting forever, treat the engine as gone (the server exits 1
                # and its supervisor restarts it).
                logger.exception("unreadable message from the engine process")
                reason = f"an unreadable message from the engine process ({type(exc).__name__}: {exc})"
                break
            self._call_on_loop(self._dispatch, message)
        if reason is None:
            self._process.join(5.0)
            reason = f"the engine process exited (exit code {self._process.exitcode})"
        self._call_on_loop(self._mark_dead, reason)

    def _watch_followers(self) -> None:
        """Rank-watch thread: the first other rank to exit ends the engine for the server."""
        by_sentinel = {follower.sentinel: follower for follower in self._followers}
        gone = by_sentinel[multiprocessing.connection.wait(list(by_sentinel))[0]]
        gone.join(1.0)
        if not self._loaded:
            self._process.join(2.0)  # a failed start-up fails every rank: rank 0's own report says more
        if not self._closing:
            self._call_on_loop(self._mark_dead,
                               f"the tensor-parallel process {gone.name} exited (exit code {gone.exitcode})")

    def _call_on_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: the server is gone already

    def _dispatch(self, message) -> None:
        self._last_heard = time.monotonic()
        self._pinged = False
        if self.stall_reason is not None:
            logger.warning("the engine is making progress again after: %s", self.stall_reason)
            self.stall_reason = None
        if isinstance(message, msg.StepOutputs):
            for out in message.outputs:
                inbox = self._streams.get(out.request_id)
                if inbox is not None:
                    inbox.put_nowait(out)
        elif isinstance(message, msg.AddRequestFailed):
            inbox = self._streams.get(message.request_id)
            if inbox is not None:
                inbox.put_nowait(RequestRejected(message.message))
        elif isinstance(message, msg.StatsReply):
            future = self._stats_waiters.get(message.query_id)
            if future is not None and not future.done():
                future.set_result(message.stats)
        elif isinstance(message, msg.EngineReady):
            self._loaded = True
            if not self._ready.done():
                self._ready.set_result(message)
        elif isinstance(message, msg.StartupFailed):
            self._fail_startup(message.message)
        elif isinstance(message, msg.EngineFailed):
            self._mark_dead(f"the engine failed: {message.message}")

    def _fail_startup(self, reason: str) -> None:
        if not self._ready.done():
            self._ready.set_exception(EngineStartupError(reason))
            self._ready.exception()  # retrieved here too, so asyncio does not warn if nobody waits

    def _stall(self, reason: str) -> None:
        self.stall_reason = reason
        logger.error("%s; failing its %d open requests", reason, len(self._streams))
        self._fail_waiting(EngineStalledError(reason))

    def _fail_waiting(self, error: EngineDeadError) -> None:
        for inbox in self._streams.values():
            inbox.put_nowait(error)
        for future in self._stats_waiters.values():
            if not future.done():
                future.set_exception(error)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self._fail_startup(reason)
        if not self._closing:
            logger.error("%s", reason)
        self._fail_waiting(EngineDeadError(f"the engine has stopped: {reason}"))
        if self.on_death is not None and not self._closing:
            self.on_death(reason)
