"""``simpletuner validate``: check config.json and multidatabackend.json without training (and without torch).

Prints what each dataset folder holds (images, captions, sizes, buckets, batches; see
:mod:`simpletuner.config.scan`), every problem as ``FILE: path: message``, warnings as ``warning: ...``, then ``OK``
when there are no errors. Exit status 1 on errors (a missing dataset folder, missing captions, no batch that can
be formed, ...), 0 otherwise; warnings (settings that will do nothing) do not fail it. ``--no-scan`` checks the
files alone, for a config that trains on another machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from .data import data_backend_beside, found_beside_message, load_data_backends
from .errors import ConfigError, FieldError
from .loader import dump_train_config, load_train_config, parse_extra_args, prepare_train_config
from .requirements import missing_packages
from .scan import scan_data
from .train import check_train_paths, flavour_path_errors

DEFAULT_CONFIG = os.path.join("config", "config.json")


@dataclass
class ValidationReport:
    """Everything ``validate`` found: errors as (source file or None, FieldError), warnings as text."""

    errors: list[tuple[str | None, FieldError]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] | None = None
    datasets: list[str] = field(default_factory=list)
    data: dict[str, Any] | None = None  # the data scan (DataScan.to_dict()), when it ran

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(self, exc: ConfigError) -> None:
        self.errors.extend((exc.source, e) for e in exc.errors)


def _prefixed(source: str | None, lines: list[str]) -> list[str]:
    return [f"{source}: {line}" if source else line for line in lines]


def validate_files(config_path: str, data_backend_config: str | None = None,
                   overrides: dict[str, Any] | None = None, scan: bool = True) -> ValidationReport:
    """Validate ``config_path`` (with ``overrides``, as ``train`` would apply them), the packages its options need,
    and its data backends (``data_backend_config``, the config's own setting, or a ``multidatabackend.json`` beside
    the config file); with ``scan``, also what the dataset folders hold (:func:`~simpletuner.config.scan.scan_data`).

    Relative paths are resolved against the working directory, as SimpleTuner does.
    """
    report = ValidationReport()
    config = None
    readable = True
    try:
        loaded = load_train_config(config_path, overrides=overrides)
    except ConfigError as exc:
        report.add(exc)
        configured = None
        try:
            configured = prepare_train_config(config_path, overrides=overrides)[0].get("data_backend_config")
        except ConfigError:
            readable = False
    else:
        config = loaded.config
        report.errors += [(config_path, e) for e in flavour_path_errors(config)]
        report.warnings += _prefixed(config_path, loaded.warnings + check_train_paths(config))
        report.config = dump_train_config(config)
        report.errors.extend((config_path, e) for e in missing_packages(config.__dict__))
        configured = config.data_backend_config

    data_path = data_backend_config or configured
    if not data_path and readable:
        data_path = data_backend_beside(config_path)
        if data_path:
            report.notes.append(found_beside_message(data_path, config_path))
    if not data_path:
        if not readable:
            return report  # nothing more to say until the config file itself can be read
        report.errors.append(
            (
                config_path,
                FieldError("data_backend_config", "not set; set it in config.json, pass --data_backend_config, or "
                                                  "put multidatabackend.json beside the config"),
            )
        )
        return report
    if not isinstance(data_path, str):
        return report  # the config's own error already names data_backend_config
    try:
        backends = load_data_backends(data_path, config=config)
    except ConfigError as exc:
        report.add(exc)
    else:
        report.warnings += _prefixed(data_path, backends.warnings)
        report.datasets = [d.id for d in backends.datasets]
        if scan and config is not None:
            found = scan_data(config, backends)
            report.data = found.to_dict()
            report.errors += [(data_path if e.path.startswith("datasets") else config_path, e) for e in found.errors]
            report.warnings += [f"{data_path if w.startswith('datasets') else config_path}: {w}"
                                for w in found.warnings]
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"config.json to check (default: {DEFAULT_CONFIG})"
    )
    parser.add_argument(
        "--data_backend_config",
        "--data-backend-config",
        default=None,
        help="multidatabackend.json to check (default: the config's data_backend_config)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value as train does, e.g. --set model_flavour=tiny (repeatable)")
    parser.add_argument("--no-scan", "--no_scan", dest="scan", action="store_false",
                        help="do not look into the dataset folders (for a config that trains on another machine)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    flags = getattr(args, "config_flags", None)
    overrides = parse_extra_args(flags) if flags else {}
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            print(f"error: --set {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        overrides[key.strip()] = value
    report = validate_files(args.config, args.data_backend_config, overrides or None, scan=args.scan)
    if args.json:
        payload = {
            "ok": report.ok,
            "errors": [{"source": src, "path": e.path, "message": e.message} for src, e in report.errors],
            "warnings": report.warnings,
            "notes": report.notes,
            "config": report.config,
            "datasets": report.datasets,
            "data": report.data,
        }
        print(json.dumps(payload, indent=2))
        return 0 if report.ok else 1
    print_report(report)
    if report.ok:
        print("OK")
        return 0
    count = len(report.errors)
    print(f"{count} error{'s' if count != 1 else ''}", file=sys.stderr)
    return 1


def print_report(report: ValidationReport) -> None:
    """The report as ``validate`` prints it (the wizard ends with it too): notes, the data summary, warnings,
    errors."""
    for note in report.notes:
        print(note)
    for line in (report.data or {}).get("summary", []):
        print(line)
    for warning in report.warnings:
        print(f"warning: {warning}")
    for source, error in report.errors:
        print(f"{source}: {error}" if source else str(error))
