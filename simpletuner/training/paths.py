"""Open-time path checks in a server's job.

The server checked every path field when the job was submitted; the job carries its allowed roots
(``SIMPLETUNER_ALLOWED_ROOTS``) and the trainer checks them again here, before it opens anything, so a symlink
swapped in after the submit cannot lead outside. ``simpletuner train`` on its own has no roots and checks nothing:
it works on the user's own files.
"""

from __future__ import annotations

import os

from simpletuner.config import paths


def check_run_paths(config, backends) -> None:
    """PathOutsideRoots listing every path field of ``config`` and ``backends`` that resolves outside the job's
    roots (relative paths from where the trainer reads them: the working directory, or ``output_dir``)."""
    roots = paths.roots_from_env()
    if roots is None:
        return
    cwd = os.getcwd()
    output = paths.resolve(config.output_dir, cwd)
    problems = []
    for field, value, spec in paths.config_paths(config, backends):
        message = paths.field_problem(spec, value, roots, cwd, output)
        if message:
            problems.append((field, message))
    if problems:
        raise paths.PathOutsideRoots(problems[0][0], "; ".join(
            [problems[0][1]] + [f"{field}: {message}" for field, message in problems[1:]]))
