"""``python -m simpletuner.train --config RUN_DIR/config.json``: the trainer entry point that server jobs run
under ``accelerate launch``. Same code path as ``simpletuner train``."""

from __future__ import annotations

import argparse
import sys

from simpletuner.config.launch import die_with_parent_from_env
from simpletuner.training import cli


def main(argv: list[str] | None = None, module: str = "simpletuner.train") -> int:
    """Run the recipe of ``module`` (this one, or ``simpletuner.cache``) in this process, as one rank."""
    die_with_parent_from_env()  # a worker's run: no trainer outlives its launcher
    parser = argparse.ArgumentParser(prog=f"python -m {module}", allow_abbrev=False)
    cli.add_arguments(parser)
    args, args.config_flags = parser.parse_known_args(argv)
    args.num_processes, args.num_machines = 1, 1  # already launched by accelerate when run this way
    return cli.run_recipe(args, module)


if __name__ == "__main__":
    sys.exit(main())
