"""``simpletuner train``: validate the config and its data backends, then train in the foreground.

Any config key can be given as a flag, as on SimpleTuner's command line (``--lora_rank=4``, ``--seed 42``, a bare
``--gradient_checkpointing`` for true); flags and ``--set key=value`` win over the file. Nothing is written before
both configs validate and the packages the options need are found. With ``--num_processes N`` (N > 1) the same
trainer is started under ``accelerate launch`` with N processes; with ``--num_machines M`` the same command runs on
each of M machines with its ``--machine_rank`` and rank 0's ``--main_process_ip``/``--main_process_port``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from simpletuner.config.launch import LaunchSpec, accelerate_command, launch_env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="config/config.json", help="config.json (default: %(default)s)")
    parser.add_argument("--data_backend_config", "--data-backend-config", dest="data_backend_config",
                        help="multidatabackend.json (default: the config's data_backend_config)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set max_train_steps=10 (repeatable)")
    parser.add_argument("--num_processes", type=int, default=1,
                        help="processes to launch with accelerate, over all machines (one per GPU); default 1")
    parser.add_argument("--num_machines", type=int, default=1,
                        help="machines the run spans (run the same command on each with its --machine_rank)")
    parser.add_argument("--machine_rank", type=int, default=0, help="this machine's rank (0 = the main one)")
    parser.add_argument("--main_process_ip", default=None, help="rank 0's address (several machines)")
    parser.add_argument("--main_process_port", type=int, default=None, help="rank 0's rendezvous port")


def parse_overrides(items: list[str], config_flags: list[str] | None = None) -> dict:
    """Config overrides from SimpleTuner-style flags (``--key=value``, ``--key value``, ``--flag``) and then
    ``--set KEY=VALUE`` items (which win)."""
    from simpletuner.config.loader import parse_extra_args

    out: dict = {}
    if config_flags:
        stray = [t for i, t in enumerate(config_flags) if not t.startswith("--")
                 and (i == 0 or not config_flags[i - 1].startswith("--") or "=" in config_flags[i - 1])]
        if stray:
            raise SystemExit(f"error: unexpected argument {stray[0]!r}: config keys are given as --key=value, "
                             "--key value or --flag")
        out.update(parse_extra_args(config_flags))
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


def load_configs(config_path: str, data_backend_config: str | None, overrides: dict):
    """(LoadedConfig, DataBackends); prints every error with its field path and exits 1 on invalid input."""
    from simpletuner.config import (ConfigError, data_backend_beside, flavour_path_errors, found_beside_message,
                                    load_data_backends, load_train_config)

    try:
        loaded = load_train_config(config_path, overrides=overrides)
        contradictions = flavour_path_errors(loaded.config)
        if contradictions:
            raise ConfigError(contradictions, source=config_path)
    except ConfigError as exc:
        print(f"error: invalid config\n{exc}", file=sys.stderr)
        raise SystemExit(1) from None
    backend_path = data_backend_config or loaded.config.data_backend_config
    if not backend_path:
        backend_path = data_backend_beside(config_path)
        if backend_path:
            print(found_beside_message(backend_path, config_path), file=sys.stderr)
            loaded.config.data_backend_config = backend_path
    if not backend_path:
        print(f"error: {config_path}: data_backend_config: not set (give it in the config, with "
              "--data_backend_config, or put multidatabackend.json beside the config)", file=sys.stderr)
        raise SystemExit(1)
    try:
        backends = load_data_backends(backend_path, config=loaded.config)
    except ConfigError as exc:
        print(f"error: invalid data backend config\n{exc}", file=sys.stderr)
        raise SystemExit(1) from None
    for warning in loaded.warnings + backends.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return loaded, backends


def launch_spec(args) -> LaunchSpec:
    return LaunchSpec(num_processes=args.num_processes, num_machines=getattr(args, "num_machines", 1),
                      machine_rank=getattr(args, "machine_rank", 0),
                      main_process_ip=getattr(args, "main_process_ip", None),
                      main_process_port=getattr(args, "main_process_port", None), use_cpu=not _has_cuda())


def launch_command(args, module: str = "simpletuner.train") -> list[str]:
    """``accelerate launch`` of ``python -m <module>`` (the trainer, or split training's stage 1
    ``simpletuner.cache``) with the same arguments (the shared launcher)."""
    train_args = ["--config", args.config]
    if args.data_backend_config:
        train_args += ["--data_backend_config", args.data_backend_config]
    for item in args.set:
        train_args += ["--set", item]
    try:
        return accelerate_command(launch_spec(args), train_args + list(getattr(args, "config_flags", None) or []),
                                  module=module)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def _has_cuda() -> bool:
    import shutil

    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


def check_packages(config, fields: tuple[str, ...] | None = None) -> None:
    """Exit 1, before anything is loaded or cached, when an option needs a package that is not installed (only
    options of ``fields``, by prefix, when given)."""
    from simpletuner.config.requirements import missing_packages

    errors = [e for e in missing_packages(config.__dict__) if fields is None or e.path.startswith(fields)]
    if errors:
        print("error: missing packages\n" + "\n".join(str(e) for e in errors), file=sys.stderr)
        raise SystemExit(1)


def run(args) -> int:
    return run_recipe(args, "simpletuner.train")


def run_recipe(args, module: str) -> int:
    """Load and check both configs, then run the recipe of ``module`` (``simpletuner.train``, or split training's
    stage 1 ``simpletuner.cache``) here, or under ``accelerate launch`` with ``--num_processes`` N > 1."""
    overrides = parse_overrides(args.set, getattr(args, "config_flags", None))
    loaded, backends = load_configs(args.config, args.data_backend_config, overrides)
    caching = module == "simpletuner.cache"
    check_packages(loaded.config, ("text_encoder_",) if caching else None)  # stage 1 loads only the encoders
    if args.num_processes > 1 or getattr(args, "num_machines", 1) > 1:
        if not caching and loaded.config.distillation is not None:  # refused here, before any rank starts
            from simpletuner.training.distill import single_process_error

            field, message = single_process_error(args.num_processes)
            print(f"error: {field}: {message}", file=sys.stderr)
            return 1
        return subprocess.call(launch_command(args, module), env=launch_env(launch_spec(args)))
    # transformers' import-time notices (e.g. about torchvision) are noise in a training log
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from simpletuner.config import ConfigError
    from simpletuner.data.discovery import DatasetError

    if caching:
        from simpletuner.training.split import run_cache as run_module
    elif loaded.config.distillation is not None:  # the distillation recipe, beside fine-tuning's
        from simpletuner.training.distill import run as run_module
    else:
        from simpletuner.training.trainer import run as run_module
    try:
        return run_module(loaded.config, backends)
    except (ConfigError, DatasetError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
