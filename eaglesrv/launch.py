"""Start the OpenAI-compatible server; flags follow SGLang's `sglang.launch_server`.

    python -m eaglesrv.launch                      # SmolLM2-135M-Instruct at 127.0.0.1:30000
    python -m eaglesrv.launch --model-path meta-llama/Llama-3.1-8B-Instruct --port 8000
    python -m eaglesrv.launch --model-path meta-llama/Llama-3.1-70B-Instruct --tp-size 8   # 8 GPUs

The engine runs in its own process; this process serves HTTP, tokenizes and detokenizes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Sequence

from eaglesrv.configs.cli import add_engine_args, engine_config_from_args
from eaglesrv.configs.errors import ConfigError
from eaglesrv.configs.server import add_server_args, server_config_from_args

logger = logging.getLogger("eaglesrv.launch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eaglesrv.launch",
        description="Serve a model over OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models) "
                    "and SGLang's native one (/generate, /get_server_info). Flags follow sglang.launch_server.",
        epilog="Start-up names any flag that has no effect together with the others given.",
    )
    add_server_args(parser)
    add_engine_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        server_config = server_config_from_args(args)
        engine_config = engine_config_from_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Imported after parsing, so that --help and flag errors answer at once.
    from eaglesrv.server.lifecycle import serve
    from eaglesrv.server.not_landed import report_ignored_flags

    report_ignored_flags(engine_config)
    if engine_config.parallel.node_rank > 0:  # tensor-parallel ranks only: node 0 serves
        from eaglesrv.engine.follower_process import run_other_node

        return run_other_node(engine_config, server_config.log_level)
    try:
        return asyncio.run(serve(server_config, engine_config))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
