"""SimpleTuner: fine-tuning for diffusion models.

Importing this package is cheap on purpose: the CLI's ``--help``, ``validate`` and the server never
pull in torch. Heavy modules live in ``simpletuner.models`` / ``simpletuner.training``.
"""

__version__ = "0.1.0"
