"""``python -m simpletuner.cache --config RUN_DIR/config.json``: split training's stage 1 (``simpletuner cache``) as
one rank, the entry point server cache jobs and ``simpletuner cache --num_processes N`` run under
``accelerate launch``."""

from __future__ import annotations

import sys

from simpletuner.train import main

if __name__ == "__main__":
    sys.exit(main(module="simpletuner.cache"))
