"""``simpletuner cache``: split training's stage 1. Encodes what the config trains and validates on (loading only
the VAE and the text encoders) and writes the cache manifest that ``train_from_cache: true`` trains from; see
``simpletuner.training.split``. Takes the same arguments as ``simpletuner train``; with ``--num_processes N`` the
samples are split across N ranks under ``accelerate launch``.
"""

from __future__ import annotations

from simpletuner.training.cli import add_arguments, run_recipe

__all__ = ["add_arguments", "run"]


def run(args) -> int:
    return run_recipe(args, "simpletuner.cache")
