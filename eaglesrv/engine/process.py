"""The engine process: load the model, then step the engine and trade messages with the
API process over two one-way pipes (see protocol.py for the messages; client.py is the
API process's side).

The loop never waits on the API process while it has work: between two steps it takes
whatever messages have arrived (without blocking), then runs the next step. With no work
it blocks on the inbox, so an idle server uses no CPU.

With tensor parallelism this process is rank 0; the API process has started the other
ranks beside it, and Engine sends them every step (parallel/followers.py).

Signals: SIGINT and SIGTERM are ignored here. The API process decides when the engine
stops (after draining HTTP requests) and says so with Shutdown; if the API process dies,
the inbox reaches EOF and the loop ends as well.
"""

from __future__ import annotations

import gc
import logging
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from eaglesrv.configs import EngineConfig
from eaglesrv.engine import protocol as msg
from eaglesrv.engine.parallel.ranks import SINGLE, RankPlacement

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0  # how long an idle loop blocks on the inbox before looking again


def engine_process_main(config: EngineConfig, log_level: str, inbox: Connection, outbox: Connection,
                        placement: RankPlacement = SINGLE) -> None:
    """Entry point of the spawned process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    try:
        engine = _load_engine(config, placement)
        outbox.send(msg.EngineReady(_engine_info(engine, config), _pickled_tokenizer(engine.tokenizer)))
    except BaseException as exc:  # noqa: BLE001 - any start-up failure must reach the API process
        logger.debug("engine start-up failed", exc_info=True)
        _send_quietly(outbox, msg.StartupFailed(f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    try:
        EngineLoop(engine, inbox, outbox).run()
    except BaseException as exc:  # noqa: BLE001 - every stream must hear that the engine is gone
        logger.error("engine loop failed:\n%s", traceback.format_exc())
        _send_quietly(outbox, msg.EngineFailed(f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    engine.close()
    logger.info("engine process exiting")


class EngineLoop:
    """Owns the Engine in this process: applies inbox messages, steps, sends outputs."""

    def __init__(self, engine, inbox: Connection, outbox: Connection) -> None:
        self.engine = engine
        self._inbox = inbox
        self._outbox = outbox
        self._num_steps = 0

    def run(self) -> None:
        while True:
            wait_s = 0.0 if self.engine.has_unfinished else _IDLE_POLL_S
            if not self._take_messages(wait_s):
                return
            if self.engine.has_unfinished:
                outputs = self.engine.step()
                self._num_steps += 1
                if outputs:
                    self._outbox.send(msg.StepOutputs([_wire_output(out) for out in outputs]))

    def _take_messages(self, wait_s: float) -> bool:
        """Apply every message that has arrived (waiting up to wait_s for the first).

        Returns False when the loop should end (Shutdown, or the API process is gone).
        """
        try:
            while self._inbox.poll(wait_s):
                wait_s = 0.0
                message = self._inbox.recv()
                if isinstance(message, msg.Shutdown):
                    return False
                self._apply(message)
        except (EOFError, OSError):
            logger.warning("the API process went away; stopping the engine")
            return False
        return True

    def _apply(self, message) -> None:
        if isinstance(message, msg.AddRequest):
            try:
                self.engine.add_request(message.prompt_token_ids, message.params, message.request_id)
            except ValueError as exc:  # too long, empty, duplicate id: the client's fault
                self._outbox.send(msg.AddRequestFailed(message.request_id, str(exc)))
        elif isinstance(message, msg.AbortRequest):
            self.engine.abort(message.request_id)
        elif isinstance(message, msg.StatsQuery):
            if message.flush_cache:
                logger.info("flushed %d cached KV pages", self.engine.flush_cache())
            self._outbox.send(msg.StatsReply(message.query_id, self._stats()))
        else:
            logger.error("ignoring unknown message %r", message)

    def _stats(self) -> msg.EngineStats:
        snapshot = self.engine.stats()
        return msg.EngineStats(
            num_running=snapshot["num_running_reqs"],
            num_waiting=snapshot["num_waiting_reqs"],
            kv_pages_total=snapshot["kv_pages_total"],
            kv_pages_free=snapshot["kv_pages_free"],
            kv_pages_used=snapshot["kv_pages_used"],
            page_size=snapshot["page_size"],
            num_steps=self._num_steps,
            speculation=self.engine.spec_stats,  # None without speculation
            prefix_cache={k: v for k, v in snapshot.items() if k.startswith("prefix_cache_")},
        )


def _load_engine(config: EngineConfig, placement: RankPlacement):
    # Imported here so that the API process never imports torch or the model code.
    from eaglesrv.engine.llm_engine import Engine

    engine = Engine(config, placement)
    engine.warmup()  # the first forward in a process is slow; pay for it before serving
    # What start-up made (weights, modules, tokenizer) lives as long as the process: keep
    # the collector's full passes from walking it again and again while serving.
    gc.collect()
    gc.freeze()
    return engine


def _engine_info(engine, config: EngineConfig) -> msg.EngineInfo:
    from eaglesrv.engine.loader.default_model import DEFAULT_MODEL_NAME

    model = config.model
    return msg.EngineInfo(
        model_name=model.served_model_name or model.model_path or DEFAULT_MODEL_NAME,
        model_path=model.model_path,
        tokenizer_path=model.tokenizer_path or model.model_path,
        max_context_len=min(engine.max_context_len, engine.scheduler.pool_capacity_tokens),
        vocab_size=engine.arch.vocab_size,
        eos_token_ids=tuple(sorted(engine.eos_token_ids)),
        page_size=engine.scheduler.page_size,
        num_pages=engine.scheduler.pages.num_pages,
        max_running_requests=config.scheduler.max_running_requests,
        dtype=str(engine.dtype).removeprefix("torch."),
        device=str(engine.device),
    )


def _pickled_tokenizer(tokenizer) -> bytes | None:
    return None if tokenizer is None else pickle.dumps(tokenizer)


def _wire_output(out) -> msg.EngineOutput:
    return msg.EngineOutput(
        request_id=out.request_id,
        new_token_ids=list(out.new_token_ids),
        num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=out.num_output_tokens,
        finish_reason=out.finish_reason,
        new_logprobs=[
            (lp.token_id, float(lp.logprob), [(int(t), float(p)) for t, p in lp.top]) for lp in out.new_logprobs
        ],
        new_prompt_logprobs=list(out.new_prompt_logprobs),
        spec_verify_ct=out.spec_verify_ct,
        num_cached_tokens=out.num_cached_tokens,
    )


def _send_quietly(outbox: Connection, message) -> None:
    try:
        outbox.send(message)
    except (OSError, ValueError):
        pass  # the API process is already gone
