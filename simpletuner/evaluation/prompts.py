"""The validation prompt list: ``validation_prompt`` plus the ``user_prompt_library`` JSON ({nickname: prompt}, or
{nickname: {"prompt": ..., "reference_image": ...}} for an edit model), each with its reference image if any."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# the nickname of ``validation_prompt`` (library entries use their own keys)
DEFAULT_NICKNAME = "validation"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class ValidationPrompt:
    nickname: str  # safe as a file name
    prompt: str
    reference_image: str | None = None  # the image an edit model edits (a path, relative to the working directory)


def sanitise_nickname(name: str, max_length: int = 64) -> str:
    """A file-name-safe version of ``name``: letters, digits, '.', '_' and '-' only, no leading dot."""
    safe = _UNSAFE.sub("_", str(name).strip()).strip("._")
    return safe[:max_length].rstrip("._") or "prompt"


def load_prompt_library(path: str | Path) -> dict[str, tuple[str, str | None]]:
    """Read a user prompt library: a JSON object of {nickname: prompt} (a value may also be {"prompt": ...,
    "reference_image": path}); returns {nickname: (prompt, reference image or None)}."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"user_prompt_library: file {str(path)!r} does not exist")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"user_prompt_library: {file} is not valid JSON (line {exc.lineno}, column {exc.colno})"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"user_prompt_library: {file} must hold a JSON object of {{nickname: prompt}}")
    library = {}
    for key, value in data.items():
        reference = None
        if isinstance(value, dict):
            reference = value.get("reference_image")
            if reference is not None and (not isinstance(reference, str) or not reference.strip()):
                raise ValueError(f"user_prompt_library[{key!r}].reference_image: expected a path to an image")
            value = value.get("prompt")
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"user_prompt_library[{key!r}]: expected a non-empty prompt string")
        library[str(key)] = (value, reference)
    return library


def validation_prompts(config) -> list[ValidationPrompt]:
    """``validation_prompt`` (nickname "validation") then the library's entries, with unique sanitised nicknames."""
    entries: list[tuple[str, tuple[str, str | None]]] = []
    if config.validation_prompt:
        entries.append((DEFAULT_NICKNAME, (config.validation_prompt, getattr(config, "validation_reference_image",
                                                                           None))))
    if config.user_prompt_library:
        entries.extend(load_prompt_library(config.user_prompt_library).items())
    prompts, used = [], set()
    for name, (prompt, reference) in entries:
        base = nickname = sanitise_nickname(name)
        n = 2
        while nickname in used:  # two names that sanitise alike must not overwrite each other's files
            nickname = f"{base}_{n}"
            n += 1
        used.add(nickname)
        prompts.append(ValidationPrompt(nickname, prompt, reference))
    return prompts
