"""The processes of tensor-parallel ranks other than 0 (parallel/followers.py says what
they do): their entry point, their start, and a node other than 0, which runs only them.
Torch-free at import: the API process and launch.py start these processes.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import signal
import sys

from eaglesrv.configs import EngineConfig
from eaglesrv.engine.parallel.followers import follow
from eaglesrv.engine.parallel.ranks import RankPlacement, node_placements

logger = logging.getLogger(__name__)


def follower_main(config: EngineConfig, placement: RankPlacement, log_level: str) -> None:
    """Entry point of a follower process: build this rank's engine, then follow rank 0."""
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [rank {placement.rank}] %(name)s: %(message)s")
    from eaglesrv.engine.builder import build_engine  # torch, here only

    try:
        parts = build_engine(config, placement)
        gc.collect()
        gc.freeze()
        follow(parts.runner, parts.tp)
    except BaseException as exc:  # noqa: BLE001 - rank 0 hears of it through its next collective
        logger.error("tensor-parallel rank %d failed: %s: %s", placement.rank, type(exc).__name__, exc,
                     exc_info=not isinstance(exc, RuntimeError))
        sys.exit(1)
    parts.tp.close()


def start_followers(config: EngineConfig, placements: list[RankPlacement], log_level: str) -> list:
    """One process per placement (never rank 0's), started now; they wait at the rendezvous."""
    ctx = multiprocessing.get_context("spawn")
    processes = []
    for placement in placements:
        process = ctx.Process(target=follower_main, args=(config, placement, log_level),
                              name=f"eaglesrv-rank-{placement.rank}", daemon=True)
        process.start()
        processes.append(process)
    return processes


def stop_followers(processes: list, timeout_s: float) -> None:
    """Wait up to `timeout_s` for each process to exit (rank 0 has told them to stop, or has
    failed), then kill what is left: no rank outlives the process that started it."""
    for process in processes:
        process.join(timeout_s)
        if process.is_alive():
            logger.warning("%s did not exit; killing it", process.name)
            process.kill()
            process.join(5.0)


def run_other_node(config: EngineConfig, log_level: str) -> int:
    """A node other than 0 (launch.py --node-rank N): run its ranks, no HTTP, until they
    end (rank 0 stops them when the server shuts down); 1 if any failed. SIGTERM or
    SIGINT here stops them at once (and so the server, whose collectives then fail)."""
    placements = node_placements(config.parallel)
    logger.info("node %d: tensor-parallel ranks %d..%d, meeting rank 0 at %s", config.parallel.node_rank,
                placements[0].rank, placements[-1].rank, placements[0].init_method)
    processes = start_followers(config, placements, log_level)

    def stop(signum, frame) -> None:
        for process in processes:
            process.kill()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    failed = []
    for process in processes:
        process.join()
        if process.exitcode != 0:
            failed.append(f"{process.name} (exit code {process.exitcode})")
    if failed:
        logger.error("node %d: %s failed", config.parallel.node_rank, ", ".join(failed))
    return 1 if failed else 0
