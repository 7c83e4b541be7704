from __future__ import annotations

from dataclasses import dataclass

from eaglesrv.configs.errors import require

DEFAULT_DIST_TIMEOUT_S = 300


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism across processes (GPUs, or CPU ranks), on one node or several.

    Every node is started with the same flags but its own --node-rank; node 0 serves HTTP.
    """

    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of rank 0's TCP store; None: a free local port (one node)
    # Seconds a collective inside a forward pass (and the rendezvous) may wait for the other
    # ranks before failing: a rank that hangs takes the server down in bounded time.
    dist_timeout: float = DEFAULT_DIST_TIMEOUT_S

    def __post_init__(self) -> None:
        require(self.tp_size >= 1, f"--tp-size must be at least 1, got {self.tp_size}")
        require(self.nnodes >= 1, f"--nnodes must be at least 1, got {self.nnodes}")
        require(0 <= self.node_rank < self.nnodes,
                f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}")
        require(self.tp_size % self.nnodes == 0,
                f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} (as many ranks on every node)")
        require(self.nnodes == 1 or self.dist_init_addr is not None,
                "--nnodes above 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)")
        require(self.dist_init_addr is None or _is_host_port(self.dist_init_addr),
                f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        require(self.dist_timeout > 0, f"--dist-timeout must be positive, got {self.dist_timeout}")


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
