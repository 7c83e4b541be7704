"""Which tensor-parallel ranks run on this node, and where they meet. Torch-free: the API
process (or launch.py on a node other than 0) starts these processes.

Ranks are numbered node by node: node n runs ranks n * k .. n * k + k - 1, with
k = tp_size / nnodes, each on its own GPU (local rank) on CUDA. Rank 0, on node 0,
schedules; its TCP store (--dist-init-addr, or a free local port on one node) is the
rendezvous.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from eaglesrv.configs.parallel import ParallelConfig


@dataclass(frozen=True)
class RankPlacement:
    """Where one process sits in a tensor-parallel group."""

    rank: int  # 0 schedules; the others follow it
    size: int  # --tp-size
    local_rank: int  # index among this node's ranks: its GPU on CUDA
    ranks_per_node: int
    init_method: str  # tcp://host:port, rank 0's TCP store

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


SINGLE = RankPlacement(rank=0, size=1, local_rank=0, ranks_per_node=1, init_method="")


def node_placements(parallel: ParallelConfig) -> list[RankPlacement]:
    """The ranks this node runs, in order (rank 0 first on node 0)."""
    if parallel.tp_size == 1:
        return [SINGLE]
    per_node = parallel.tp_size // parallel.nnodes
    init_method = f"tcp://{parallel.dist_init_addr or _free_local_address()}"
    first = parallel.node_rank * per_node
    return [RankPlacement(first + local, parallel.tp_size, local, per_node, init_method) for local in range(per_node)]


def _free_local_address() -> str:
    """A port nobody listens on now, for a group that lives on this machine alone."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"
