"""``simpletuner distill-pairs``: make the teacher's ODE trajectories of a distillation config before training (the
run makes any that are missing itself; this stage lets a cluster make them first, one share per rank).

Same arguments as ``simpletuner train``. With ``--num_processes N`` it runs under ``accelerate launch`` and each rank
makes its share; a stopped run resumes where it was. Imports torch only once the configs are valid.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from simpletuner.training import cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_arguments(parser)


def run(args) -> int:
    overrides = cli.parse_overrides(args.set, getattr(args, "config_flags", None))
    loaded, backends = cli.load_configs(args.config, args.data_backend_config, overrides)
    config = loaded.config
    if config.distillation is None or not config.distillation.uses_pairs:
        print(f"error: {args.config}: distillation.objective: distill-pairs makes the teacher's trajectories that "
              "ode_regression and gan learn from; this config has "
              f"{config.distillation.objective if config.distillation else 'no distillation block'}", file=sys.stderr)
        return 1
    cli.check_packages(config)
    if args.num_processes > 1:
        command = cli.launch_command(args, module="simpletuner.training.distill_cli")
        return subprocess.call(command, env=cli.launch_env(cli.launch_spec(args)))
    from simpletuner.config import ConfigError
    from simpletuner.data.discovery import DatasetError
    from simpletuner.training.distill import make_pairs

    try:
        made, total, folder = make_pairs(config, backends)
    except (ConfigError, DatasetError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{made} teacher trajectories made; {total} stored in {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m simpletuner.training.distill_cli``: one rank of ``distill-pairs --num_processes N``."""
    parser = argparse.ArgumentParser(prog="python -m simpletuner.training.distill_cli", allow_abbrev=False)
    add_arguments(parser)
    args, args.config_flags = parser.parse_known_args(argv)
    args.num_processes = 1  # already launched
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
