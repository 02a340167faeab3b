"""Presets: starting points for a new config (simpletuner.config.presets), optionally filled with a dataset."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from sqlalchemy import select

from .. import deps
from ..db import DatasetRow
from ..schemas import ERRORS, NAME_PATTERN, NOT_FOUND

router = APIRouter(prefix="/api/presets", tags=["configs"], responses=ERRORS)


def _folder(request: Request, dataset: str | None) -> tuple[str, str] | None:
    if not dataset:
        return None
    with deps.db(request).session() as s:
        row = s.scalar(select(DatasetRow).where(DatasetRow.name == dataset))
    if row is None:
        raise deps.not_found(f"dataset {dataset!r}")
    return row.path, row.name


@router.get("", response_model=list[dict[str, Any]], responses=NOT_FOUND,
            summary="Presets for a new config: the tiny CPU demo, Flux LoRA by GPU memory, one LoRA per family")
def list_presets(request: Request, dataset: Annotated[str | None, Query(pattern=NAME_PATTERN, max_length=200,
                                                                          description="fill in this dataset")] = None
                 ) -> list[dict[str, Any]]:
    from simpletuner.config.presets import presets

    found = _folder(request, dataset)
    return [p.to_dict(*found) if found else p.to_dict() for p in presets()]
