"""Ranks other than 0 ("followers"): each builds the same engine on its shard and runs every
step rank 0 runs, told what to run over the control group.

    rank 0 (Engine)                            a follower (follow())
    batch = scheduler.schedule()
    followers.step(batch) ----- Step ------->  runner.run(batch)
    runner.run(batch)                          (the passes' collectives pair up)
    scheduler.update(...)
    followers.release(ids) ---- Release ---->  runner.release(ids)
    followers.stop() ---------- Stop ------->  exits 0

A follower's runner must run every pass rank 0's runs, in the same order, or collectives
would pair up wrong: so nothing reaches its runner but these commands, and what rank 0
decides from timings (adaptive speculation) reaches it through TensorParallel.leader_value.
Each Step carries a digest of the tokens rank 0 sampled the step before; a follower whose
own tokens differ stops with an error rather than go on from a KV cache that has diverged.

A follower's process (its entry point, and the launch of a node's ranks) is
engine/follower_process.py.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Step:
    batch: Any  # ScheduledBatch
    previous_digest: int | None  # sampled_digest of rank 0's step before; None: no step yet


@dataclass(frozen=True)
class Release:
    request_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class AfterWarmup:
    pass


@dataclass(frozen=True)
class Stop:
    pass


def sampled_digest(results) -> int:
    """A checksum of the tokens a step sampled (StepResults), for rank agreement."""
    return zlib.crc32(repr([result.token_ids for result in results.sampled]).encode())


class Followers:
    """Rank 0's side: sends the commands. With one rank every call does nothing."""

    def __init__(self, tp) -> None:
        self.tp = tp
        self._digest: int | None = None

    def step(self, batch) -> None:
        if self.tp.size > 1:
            self._send(Step(batch, self._digest))

    def stepped(self, results) -> None:
        """What rank 0's runner returned, for the next Step's digest."""
        if self.tp.size > 1:
            self._digest = sampled_digest(results)

    def release(self, request_ids: list[str]) -> None:
        if self.tp.size > 1:
            self._send(Release(list(request_ids)))

    def after_warmup(self) -> None:
        if self.tp.size > 1:
            self._send(AfterWarmup())

    def stop(self) -> None:
        """Tell the followers to exit and leave the group (whoever started their processes
        joins them: follower_process.stop_followers)."""
        if self.tp.size > 1:
            try:
                self._send(Stop())
            except RuntimeError:  # RanksLost: a follower is gone already, nothing to stop
                pass
        self.tp.close()

    def _send(self, command) -> None:
        self.tp.leader_value(lambda: command)


def follow(runner, tp) -> None:
    """A follower's loop: run rank 0's commands until Stop."""
    digest = None
    while True:
        command = tp.leader_value(lambda: None)
        if isinstance(command, Stop):
            return
        if isinstance(command, Step):
            if command.previous_digest is not None and command.previous_digest != digest:
                raise RuntimeError(f"tensor-parallel rank {tp.rank} sampled other tokens than rank 0 in the last "
                                   "step: the ranks' KV caches have diverged")
            digest = sampled_digest(runner.run(command.batch))
        elif isinstance(command, Release):
            runner.release(command.request_ids)
        elif isinstance(command, AfterWarmup):
            runner.after_warmup()
        else:
            raise RuntimeError(f"unknown command from rank 0: {command!r}")
