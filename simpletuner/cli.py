"""The ``simpletuner`` console script.

Every subcommand imports its implementation only when it runs, so ``simpletuner --help``,
``simpletuner validate`` and ``simpletuner server`` never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module provides ``add_arguments(parser)`` and ``run(args) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("simpletuner.training.cli", "train a model from config.json + multidatabackend.json"),
    "cache": ("simpletuner.training.cache_cli", "split training, stage 1: encode the data and prompts once and "
                                                "write the cache manifest that train_from_cache trains from"),
    "distill-pairs": ("simpletuner.training.distill_cli",
                      "make the teacher's ODE trajectories of a distillation config (ode_regression, gan)"),
    "stream-video": ("simpletuner.training.stream_cli",
                     "stream a video block by block from a causal (Self-Forcing) Wan student"),
    "validate": ("simpletuner.config.cli", "check a config (and its data backends) without training"),
    "server": ("simpletuner.server.cli", "run the training server and web UI (default http://127.0.0.1:8001)"),
    "jobs": ("simpletuner.server.client", "submit, list, show, cancel and tail jobs on a server"),
    "worker": ("simpletuner.server.agent", "run a server's jobs on this machine (claims, heartbeats, launches)"),
    "workers": ("simpletuner.server.workers_cli", "list a server's workers; create, list and revoke worker tokens"),
    "configure": ("simpletuner.config.wizard", "interactive wizard that writes config/config.json"),
    "consolidate": ("simpletuner.training.consolidate",
                    "turn a sharded (FSDP) checkpoint into a diffusers transformer folder or a LoRA file"),
}


# commands that take any config key as a flag, as SimpleTuner's command line does: `--lora_rank=4 --seed 42`
CONFIG_FLAG_COMMANDS = ("train", "cache", "validate", "distill-pairs")


class _LazyParser(argparse.ArgumentParser):
    """Top-level parser; subcommand arguments are added only for the subcommand being run."""


def families_epilog() -> str:
    """The model families and their flavours, from the family table (no model code is imported)."""
    from simpletuner.config.families import FAMILIES

    lines = ["model families (model_family: model_flavour choices, default first):"]
    for name, fam in sorted(FAMILIES.items()):
        others = [f for f in fam.flavours if f != fam.default_flavour]
        lines.append(f"  {name}: {', '.join([fam.default_flavour, *others])}")
    return "\n".join(lines)


def _build_parser(selected: str | None) -> argparse.ArgumentParser:
    parser = _LazyParser(prog="simpletuner", description="Fine-tune diffusion models.", epilog=families_epilog(),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        extra = {"epilog": families_epilog(), "formatter_class": argparse.RawDescriptionHelpFormatter} \
            if name in ("train", "cache", "validate", "configure") else {}
        if name in CONFIG_FLAG_COMMANDS:
            # `--lora_rank=4` must never be taken as an abbreviation of one of the command's own options
            extra["allow_abbrev"] = False
        sp = sub.add_parser(name, help=help_text, description=help_text, **extra)
        if name == selected:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    if selected not in SUBCOMMANDS:
        selected = None
    parser = _build_parser(selected)
    if selected in CONFIG_FLAG_COMMANDS:
        args, config_flags = parser.parse_known_args(argv)
        args.config_flags = config_flags
    else:
        args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
