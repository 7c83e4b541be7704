"""Tensor parallelism's communication: one TensorParallel per engine process, made by
connect() and owned by the model it was sharded for (LlamaForCausalLM.tp).

Three process groups, all through torch.distributed (rendezvous through its TCP store):

    compute   activations inside forward passes: NCCL on CUDA, gloo on the CPU. Its
              collectives time out after --dist-timeout, so a rank that dies or hangs
              fails the others' next pass instead of leaving them waiting forever.
    control   gloo, Python objects from rank 0 (step commands, rank 0's decisions). Rank 0
              sends under --dist-timeout (a stopped follower blocks its sends: measured),
              but the other ranks receive with no bound, on purpose: they wait there for
              the next step for as long as the server idles. A rank 0 that dies still
              ends that wait at once, since its sockets close. (A timeout is each
              process's own setting for a group, so the two sides may differ.)
    startup   gloo, what the ranks agree on while they load (the pool size, rank 0's cost
              model): no bound on either side, as loading takes as long as it takes; a
              rank that dies meanwhile still ends the others' wait.

With one rank every method is a pass-through, so the single-device path is unchanged.
"""

from __future__ import annotations

import datetime
import logging
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch

from eaglesrv.engine.parallel.ranks import RankPlacement

logger = logging.getLogger(__name__)

T = TypeVar("T")
UNBOUNDED_WAIT = datetime.timedelta(days=365)  # "never": see the module docstring


class RanksLost(RuntimeError):
    """A collective failed: another rank exited, or did not answer within --dist-timeout."""


@contextmanager
def _collective(rank: int) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:  # gloo's and NCCL's errors alike (DistBackendError is one)
        raise RanksLost(f"tensor-parallel rank {rank} lost the other ranks (one exited, or hung past "
                        f"--dist-timeout): {exc}") from exc


class TensorParallel:
    def __init__(self, rank: int = 0, size: int = 1, compute=None, control=None, startup=None) -> None:
        self.rank, self.size = rank, size
        self._compute, self._control, self._startup = compute, control, startup

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def part(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's share of `total` rows split evenly (heads,
        intermediate rows: sharding.check_divisible has made sure they divide)."""
        length = total // self.size
        return self.rank * length, length

    def vocab_part(self, vocab: int) -> tuple[int, int, int]:
        """(start, length, padded length) of this rank's vocabulary rows: each rank holds
        ceil(vocab / size) rows, the last one's tail padding (zeros, cut from the logits)."""
        padded = -(-vocab // self.size)
        start = min(self.rank * padded, vocab)
        return start, min(padded, vocab - start), padded

    # ---- inside forward passes (compute group) -------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (row-parallel outputs, the embedding)."""
        if self.size > 1:
            with _collective(self.rank):
                torch.distributed.all_reduce(x, group=self._compute)
        return x

    def gather_last_dim(self, x: torch.Tensor, keep: int) -> torch.Tensor:
        """Every rank's [n, m] side by side along the last dimension, cut to `keep` columns
        (the vocabulary-parallel logits; the cut drops the padding rows)."""
        if self.size == 1:
            return x
        stacked = self._gather(x)  # [size * n, m]
        rows = x.shape[0]
        return stacked.view(self.size, rows, -1).transpose(0, 1).reshape(rows, -1)[:, :keep]

    def gather_rows(self, x: torch.Tensor, keep: int) -> torch.Tensor:
        """Every rank's rows stacked, cut to `keep` rows (a full embedding from its shards)."""
        return x if self.size == 1 else self._gather(x)[:keep]

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        # One output tensor, not a list of them: the form NCCL records into a CUDA graph.
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        with _collective(self.rank):
            torch.distributed.all_gather_single(out, x.contiguous(), group=self._compute)
        return out

    # ---- decisions (control and startup groups) -----------------------------------------
    def leader_value(self, compute: Callable[[], T], startup: bool = False) -> T:
        """Rank 0's `compute()`, on every rank; the other ranks do not call it. For what must
        be the same everywhere but is measured or decided on one rank (a step command, a
        speculation decision; at start-up, the cost model)."""
        if self.size == 1:
            return compute()
        box: list[Any] = [compute() if self.is_leader else None]
        with _collective(self.rank):
            torch.distributed.broadcast_object_list(box, src=0, group=self._startup if startup else self._control)
        return box[0]

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value`, at start-up (KV pages: every rank must have
        as many)."""
        if self.size == 1:
            return value
        box = torch.tensor([value], dtype=torch.long)
        with _collective(self.rank):
            torch.distributed.all_reduce(box, op=torch.distributed.ReduceOp.MIN, group=self._startup)
        return int(box.item())

    def close(self) -> None:
        if self.size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def connect(placement: RankPlacement, device: torch.device, timeout_s: float) -> TensorParallel:
    """Join the group (blocks until every rank has joined, at most `timeout_s`)."""
    if placement.size == 1:
        return TensorParallel.single()
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    torch.distributed.init_process_group(
        backend, init_method=placement.init_method, rank=placement.rank, world_size=placement.size, timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    control = torch.distributed.new_group(backend="gloo",
                                          timeout=timeout if placement.is_leader else UNBOUNDED_WAIT)
    startup = torch.distributed.new_group(backend="gloo", timeout=UNBOUNDED_WAIT)
    # One collective now opens the compute group's connections: NCCL must not set them up
    # inside a CUDA graph capture, where the first pass's all-reduce would otherwise be.
    with _collective(placement.rank):
        torch.distributed.all_reduce(torch.zeros(1, device=device))
    logger.info("Tensor parallelism: rank %d of %d (pid %d), backend %s, rendezvous %s, collectives time out "
                "after %g s", placement.rank, placement.size, os.getpid(), backend, placement.init_method, timeout_s)
    return TensorParallel(placement.rank, placement.size, torch.distributed.group.WORLD, control, startup)
