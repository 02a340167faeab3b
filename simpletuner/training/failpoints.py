"""Crash drills: kill the trainer (SIGKILL, as a power cut or the OOM killer would) at a named point, so tests can
prove what survives a crash exactly there. Inert unless ``SIMPLETUNER_FAILPOINT`` is set.

``SIMPLETUNER_FAILPOINT=checkpoint.save:16`` dies halfway through writing ``checkpoint-16`` (weights and optimizer
state written, the rest not, nothing renamed into place). With ``SIMPLETUNER_FAILPOINT_ONCE=FILE`` it fires once:
it creates FILE first and stays quiet while FILE exists (so a retried run gets past it).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ENV = "SIMPLETUNER_FAILPOINT"
ONCE_ENV = "SIMPLETUNER_FAILPOINT_ONCE"


def hit(name: str, step: int) -> None:
    """Die here when the drill names this point and step."""
    wanted = os.environ.get(ENV)
    if not wanted or wanted != f"{name}:{step}":
        return
    once = os.environ.get(ONCE_ENV)
    if once:
        marker = Path(once)
        if marker.exists():
            return
        marker.write_text(f"{name}:{step} pid {os.getpid()}\n")
    os.kill(os.getpid(), signal.SIGKILL)
