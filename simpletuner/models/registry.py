"""model_family -> adapter class, read from the family table and imported only when that family is used.

The table (``simpletuner.config.families``) names each adapter as a ``"module:Class"`` string, so ``--help``, the
server and the other families never import a family's module, and one family's missing optional dependency
cannot stop another family from training.
"""

from __future__ import annotations

import importlib

from simpletuner.config.families import family_names, get_family


def available_families() -> list[str]:
    return family_names()


def get_adapter_class(model_family: str):
    """Import and return the adapter class for ``model_family``."""
    target = get_family(model_family).adapter  # ConfigError naming model_family when unknown
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"model_family {model_family!r} needs a package that is not installed: {exc}") from exc
    return getattr(module, attr)


def create_adapter(config, **kwargs):
    return get_adapter_class(config.model_family)(config, **kwargs)
