"""``simpletuner configure``: ask a few questions (or take them as flags) and write config.json +
multidatabackend.json, then print what ``simpletuner validate`` says about them.

Plain ``input()`` prompts with the default in brackets (Enter keeps it), so it also works with piped stdin. Every
question has a flag (``--family flux --flavour krea --data ./imgs ...``); a question answered by a flag is not asked.
Every answer is checked against the same schema as ``simpletuner validate``; an invalid typed answer prints the
error and asks again, an invalid flag stops with the error. The dataset folder must exist and hold images; the
wizard counts its images and captions and offers the caption strategy they suggest. Existing files are never
overwritten unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .data import DatasetBackend, parse_data_backends
from .errors import ConfigError, errors_from_validation
from .families import family_names, get_family
from .files import write_text_atomic
from .loader import load_train_config
from .scan import media_files
from .versions import CURRENT_CONFIG_VERSION

CAPTION_STRATEGIES = ("filename", "textfile", "instanceprompt")


class Aborted(Exception):
    """Input ended (or was interrupted) before the wizard finished."""


def _matching(errors: list, key: str) -> list[str]:
    return [e.message for e in errors if e.path == key or e.path.startswith(key + ".") or e.path.startswith(key + "[")]


def check_train_field(answers: dict[str, Any], key: str, value: str) -> tuple[Any, str | None]:
    """Validate ``value`` for config key ``key`` with the other answers so far: (parsed value, error or None)."""
    candidate = {"model_family": "flux", "max_train_steps": 1000, **answers, key: value}
    try:
        loaded = load_train_config(candidate)
    except ConfigError as exc:
        found = _matching(exc.errors, key)
        if found:
            return None, "; ".join(found)
        return value, None  # problems elsewhere are reported by the final check
    return getattr(loaded.config, key), None


def check_dataset_field(entry: dict[str, Any], key: str, value: str) -> tuple[Any, str | None]:
    """Validate ``value`` for dataset key ``key`` (``entry`` holds the dataset answers so far)."""
    candidate = {"id": "wizard", "instance_data_dir": "datasets", **entry, key: value}
    try:
        parsed = DatasetBackend.model_validate(candidate)
    except ValidationError as exc:
        found = _matching(errors_from_validation(exc), key)
        if found:
            return None, "; ".join(found)
        return value, None
    return getattr(parsed, key), None


def _read_line(prompt: str) -> str:
    """``input()``, echoing the answer when stdin is not a terminal so piped sessions read like typed ones."""
    answer = input(prompt)
    if not sys.stdin.isatty():
        print(answer)
    return answer


# question key -> (flag, help); every question the wizard asks has one
FLAGS: dict[str, tuple[str, str]] = {
    "model_family": ("--family", "model family (model_family)"),
    "model_flavour": ("--flavour", "flavour of the family (model_flavour)"),
    "model_type": ("--model-type", "lora or full"),
    "lora_rank": ("--lora-rank", "LoRA rank"),
    "max_train_steps": ("--steps", "training steps (max_train_steps)"),
    "learning_rate": ("--learning-rate", "peak learning rate"),
    "mixed_precision": ("--mixed-precision", "no, bf16 or fp16"),
    "instance_data_dir": ("--data", "the dataset folder of images (and .txt captions)"),
    "caption_strategy": ("--caption-strategy", "filename, textfile or instanceprompt"),
    "instance_prompt": ("--instance-prompt", "the caption of every image (caption_strategy instanceprompt)"),
    "resolution": ("--resolution", "training resolution in pixels"),
    "output_dir": ("--output-dir", "where checkpoints and the LoRA are written"),
}


def folder_facts(folder: str, video: bool = False) -> tuple[int, int] | str:
    """(training files, of them with a .txt caption) in ``folder``, or why it cannot be a dataset folder."""
    path = Path(folder).expanduser()
    if not path.exists():
        return f"folder {folder!r} does not exist"
    if not path.is_dir():
        return f"{folder!r} is not a folder"
    files = media_files(path, video)
    if not files:
        return f"folder {folder!r} holds no images (.png .jpg .jpeg .webp .bmp)"
    return len(files), sum(1 for p in files if p.with_suffix(".txt").is_file())


class Wizard:
    """The question loop; ``ask`` re-asks until the checker accepts the answer. ``given`` holds answers from
    flags (question key -> text): those are checked, not asked."""

    def __init__(self, read: Callable[[str], str] = _read_line, write: Callable[[str], None] = print,
                 accept_defaults=False, given: dict[str, Any] | None = None):
        self.read = read
        self.write = write
        self.accept_defaults = accept_defaults
        self.given = {k: v for k, v in (given or {}).items() if v is not None}

    def ask(self, question: str, default: Any, check: Callable[[str], tuple[Any, str | None]],
            key: str | None = None) -> Any:
        shown = "" if default is None else str(default)
        if key in self.given:
            text = str(self.given[key]).strip()
            value, error = check(text)
            if error is not None:
                raise Aborted(f"{FLAGS[key][0]} {text!r}: {error}")
            self.write(f"{question}: {text} ({FLAGS[key][0]})")
            return value
        while True:
            if self.accept_defaults:
                raw = ""
                self.write(f"{question} [{shown}]: {shown}")
            else:
                try:
                    raw = self.read(f"{question} [{shown}]: ")
                except (EOFError, KeyboardInterrupt):
                    raise Aborted from None
            text = raw.strip() or shown
            value, error = check(text)
            if error is None:
                return value
            if self.accept_defaults:
                raise Aborted(f"the default for {question!r} is invalid: {error}")
            self.write(f"  invalid: {error}")

    def run(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Ask everything; returns (config.json dict without data_backend_config, dataset entry)."""
        answers: dict[str, Any] = {}

        def train(key: str) -> Callable[[str], tuple[Any, str | None]]:
            return lambda text: check_train_field(answers, key, text)

        families = family_names()
        default = "flux" if "flux" in families else families[0]  # the flagship, not the first name alphabetically
        answers["model_family"] = self.ask(f"Model family ({', '.join(families)})", default, train("model_family"),
                                           "model_family")
        family = get_family(answers["model_family"])
        answers["model_flavour"] = self.ask(
            f"Flavour ({', '.join(family.flavours)})", family.default_flavour, train("model_flavour"), "model_flavour"
        )
        answers["model_type"] = self.ask("Model type (lora, full)", "lora", train("model_type"), "model_type")
        if answers["model_type"] == "lora":
            answers["lora_rank"] = self.ask("LoRA rank", 16, train("lora_rank"), "lora_rank")
        answers["max_train_steps"] = self.ask("Training steps", 1000, train("max_train_steps"), "max_train_steps")
        default_lr = "1e-4" if answers["model_type"] == "lora" else "1e-5"
        answers["learning_rate"] = self.ask("Learning rate", default_lr, train("learning_rate"), "learning_rate")
        tiny = family.flavours.get(answers["model_flavour"] or "") is None
        answers["mixed_precision"] = self.ask("Mixed precision (no, bf16, fp16)", "no" if tiny else "bf16",
                                              train("mixed_precision"), "mixed_precision")

        entry: dict[str, Any] = {}
        video = family.modality == "video"
        facts: dict[str, tuple[int, int]] = {}

        def data(key: str) -> Callable[[str], tuple[Any, str | None]]:
            return lambda text: check_dataset_field(entry, key, text)

        def folder(text: str) -> tuple[Any, str | None]:
            value, error = data("instance_data_dir")(text)
            if error is not None:
                return value, error
            found = folder_facts(value, video)
            if isinstance(found, str):
                return None, found
            facts["counts"] = found
            return value, None

        entry["instance_data_dir"] = self.ask("Dataset folder (images)", "datasets/my-images", folder,
                                              "instance_data_dir")
        files, captioned = facts["counts"]
        kind = "videos and images" if video else "images"
        self.write(f"  found {files} {kind}, {captioned} with a .txt caption")
        suggested = "textfile" if captioned else "filename"
        entry["caption_strategy"] = self.ask(
            f"Caption strategy ({', '.join(CAPTION_STRATEGIES)})", suggested, data("caption_strategy"),
            "caption_strategy")
        if entry["caption_strategy"] == "instanceprompt":
            entry["instance_prompt"] = self.ask("Instance prompt (caption of every image)", None,
                                                data("instance_prompt"), "instance_prompt")
        answers["resolution"] = self.ask("Resolution (pixels)", 64 if tiny else 1024, train("resolution"),
                                         "resolution")
        answers["output_dir"] = self.ask("Output folder", "output/models", train("output_dir"), "output_dir")
        return answers, entry


def _dataset_id(folder: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(folder.rstrip("/\\")).name).strip("-")
    return name or "my-dataset"


def build_files(answers: dict[str, Any], entry: dict[str, Any], data_backend_path: str) -> tuple[dict, list]:
    """The config.json and multidatabackend.json contents for the wizard's answers."""
    family = answers["model_family"]
    dataset_id = _dataset_id(entry["instance_data_dir"])
    config = {"config_version": CURRENT_CONFIG_VERSION, **answers, "data_backend_config": data_backend_path}
    config.setdefault("checkpointing_steps", 500)
    dataset = {
        "id": dataset_id,
        "type": "local",
        "dataset_type": "image",
        **entry,
        "resolution": answers["resolution"],
        "resolution_type": "pixel_area",
        "repeats": 0,
        "cache_dir_vae": f"cache/vae/{family}/{dataset_id}",
    }
    text_embeds = {
        "id": "text-embeds",
        "dataset_type": "text_embeds",
        "type": "local",
        "default": True,
        "cache_dir": f"cache/text/{family}",
    }
    return config, [dataset, text_embeds]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config_dir", "--config-dir", default="config",
                        help="folder for config.json and multidatabackend.json (default: config)")
    parser.add_argument("--config", default=None, help="config.json path (default: CONFIG_DIR/config.json)")
    parser.add_argument("--data_backend_config", "--data-backend-config", default=None,
                        help="multidatabackend.json path (default: CONFIG_DIR/multidatabackend.json)")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    parser.add_argument("--yes", "-y", action="store_true", help="accept every default without asking")
    answers = parser.add_argument_group("answers", "each answers one question, which is then not asked")
    for key, (flag, help_text) in FLAGS.items():
        answers.add_argument(flag, dest=f"answer_{key}", default=None, metavar=key.upper(), help=help_text)


def run(args: argparse.Namespace) -> int:
    config_path = args.config or os.path.join(args.config_dir, "config.json")
    data_path = args.data_backend_config or os.path.join(args.config_dir, "multidatabackend.json")
    existing = [p for p in (config_path, data_path) if os.path.exists(p)]
    if existing and not args.force:
        print(f"error: {' and '.join(existing)} already exist; use --force to overwrite", file=sys.stderr)
        return 1

    given = {key: getattr(args, f"answer_{key}", None) for key in FLAGS}
    wizard = Wizard(accept_defaults=args.yes, given=given)
    try:
        answers, entry = wizard.run()
    except Aborted as exc:
        print(f"\nerror: {str(exc) or 'input ended before the wizard finished'}; nothing written", file=sys.stderr)
        return 1

    config, backends = build_files(answers, entry, data_path)
    try:
        loaded = load_train_config(config)
        parse_data_backends(backends, resolution=loaded.config.resolution)
    except ConfigError as exc:
        print(f"error: the answers do not form a valid config:\n{exc}", file=sys.stderr)
        return 1

    for path, content in ((config_path, config), (data_path, backends)):
        write_text_atomic(path, json.dumps(content, indent=2) + "\n")
    print(f"\nwrote {config_path} and {data_path}\n")
    print(f"simpletuner validate --config {config_path}")
    from .cli import print_report, validate_files

    report = validate_files(config_path, data_path)
    print_report(report)
    if not report.ok:
        print(f"fix the errors above, then: simpletuner train --config {config_path}")
        return 1
    print(f"OK\nnext: simpletuner train --config {config_path}")
    return 0

