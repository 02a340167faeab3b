"""model_family -> adapter class, imported only when that family is used.

Keeping this table as strings means ``--help``, the server and the other families never import a family's
module, and one family's missing optional dependency cannot stop another family from training.
"""

from __future__ import annotations

import importlib

ADAPTERS: dict[str, str] = {
    "flux": "simpletuner.models.flux:FluxAdapter",
}


def available_families() -> list[str]:
    return sorted(ADAPTERS)


def get_adapter_class(model_family: str):
    """Import and return the adapter class for ``model_family``."""
    try:
        target = ADAPTERS[model_family]
    except KeyError:
        raise ValueError(
            f"model_family: {model_family!r} is not one of {', '.join(available_families())}"
        ) from None
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"model_family {model_family!r} needs a package that is not installed: {exc}") from exc
    return getattr(module, attr)


def create_adapter(config, **kwargs):
    return get_adapter_class(config.model_family)(config, **kwargs)
