"""Split training on the server (torch-free): a cache job runs stage 1 (``simpletuner cache``); a train job may
depend on it, waiting in the queue until it succeeds and failing, with the reason, if it does not.

The pair shares one cache: the caches are the data backends' folders (``cache_dir_vae``, the text-embeds
``cache_dir``) and the manifest beside them, paths any worker that can read the server's allowed roots can read. A
train job is only accepted as a cache job's dependent when both configs name the same manifest.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import exists
from sqlalchemy.orm import aliased

from simpletuner.config.split import cache_manifest_path

from .db import FINISHED, JobRow
from .validation import FieldProblem, InvalidConfig


def manifest_of(train_config: dict, data_backends: list, workdir: Path) -> str | None:
    """Where a (frozen, validated) config's cache manifest is, read from ``workdir`` as its job reads it; None when
    its data backends cannot say."""
    from simpletuner.config import ConfigError, parse_data_backends

    try:
        backends = parse_data_backends(list(data_backends))
    except ConfigError:
        return None
    return os.path.realpath(cache_manifest_path(train_config.get("cache_manifest"), backends.text_embeds.cache_dir,
                                                workdir))


def check_dependency(session, *, kind: str, depends_on: int | None, frozen: dict, data_backends: list,
                     workdir: Path) -> list[str]:
    """Warnings for a job about to be submitted; InvalidConfig naming ``depends_on`` when it cannot wait for that
    job (no such job, not a cache job, already failed, or another cache)."""
    if depends_on is None:
        return []
    if kind == "cache":
        raise InvalidConfig([FieldProblem("depends_on", "a cache job waits for nothing; give depends_on to the train "
                                                        "job that trains from its cache")])
    dep = session.get(JobRow, depends_on)
    if dep is None:
        raise InvalidConfig([FieldProblem("depends_on", f"job {depends_on} does not exist")])
    if dep.kind != "cache":
        raise InvalidConfig([FieldProblem("depends_on", f"job {depends_on} is a {dep.kind} job; a train job waits "
                                                        "only for a cache job (kind 'cache')")])
    if dep.status in ("failed", "cancelled"):
        raise InvalidConfig([FieldProblem("depends_on", f"cache job {depends_on} {dep.status}"
                                                        f"{f' ({dep.reason})' if dep.reason else ''}; retry it first")])
    ours = manifest_of(frozen, data_backends, workdir)
    theirs = manifest_of(dep.train_config or {}, dep.data_backends or [], workdir)
    if ours != theirs:
        raise InvalidConfig([FieldProblem("depends_on", f"cache job {depends_on} writes its cache manifest to "
                                                        f"{theirs}, and this config reads {ours}: give both configs "
                                                        "the same text_embeds cache_dir (or cache_manifest)")])
    if not frozen.get("train_from_cache"):
        return [f"depends_on: train_from_cache is not set, so this job loads the encoders itself (the entries cache "
                f"job {depends_on} wrote are reused); set train_from_cache: true to train from its cache alone"]
    return []


def waiting_for_cache_job():
    """SQL condition on ``JobRow``: its cache job exists and has not finished (``dependency_state``'s "waiting").
    The schedulers leave these out of their scan, so any number of waiting jobs never hides one that can start."""
    dep = aliased(JobRow)
    return exists().where(dep.id == JobRow.depends_on, dep.status.not_in(FINISHED))


def dependency_state(session, job_id: int, depends_on: int | None) -> tuple[str, str | None]:
    """("ready" | "waiting" | "failed", why) for a queued job: ready without a dependency or once its cache job
    succeeded; failed, with the reason, when that job failed, was cancelled or is gone."""
    if depends_on is None:
        return "ready", None
    dep = session.get(JobRow, depends_on)
    if dep is None:
        return "failed", f"cache job {depends_on} no longer exists"
    if dep.status == "succeeded":
        return "ready", None
    if dep.status in FINISHED:
        reason = f": {dep.reason}" if dep.reason else ""
        return "failed", f"cache job {depends_on} {dep.status}{reason}; retry it, then this job"
    return "waiting", f"waits for cache job {depends_on}"
