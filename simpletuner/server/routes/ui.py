"""The web UI's pages. Each page is an HTML shell rendered with autoescaping Jinja2; its script loads the data
from the REST API (so the shells hold nothing a token would protect) and follows the SSE streams."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Path as PathParam, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse

from simpletuner import __version__
from webui import STATIC, TEMPLATES

from ..schemas import MAX_ID, NAME_PATTERN

router = APIRouter(include_in_schema=False)
# Pages load only their own scripts (no inline script runs); style attributes are used for small layout tweaks.
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data: blob:; connect-src 'self'; object-src 'none'; "
                               "base-uri 'none'; frame-ancestors 'none'",
}
_env = None


def _templates():
    global _env
    if _env is None:
        import jinja2

        _env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                                  trim_blocks=True, lstrip_blocks=True)
    return _env


def render(request: Request, template: str, title: str, **context) -> HTMLResponse:
    html = _templates().get_template(template).render(request=request, title=title, version=__version__,
                                                      **context)
    return HTMLResponse(html, headers=PAGE_HEADERS)


def not_found(request: Request, message: str) -> HTMLResponse:
    """The HTML 404 page (browsers get this; API clients keep JSON errors)."""
    response = render(request, "not_found.html", "Not found", page="", message=message)
    response.status_code = 404
    return response


def wants_html(request: Request) -> bool:
    return not request.url.path.startswith("/api/") and "text/html" in request.headers.get("accept", "")


@router.get("/")
def home() -> RedirectResponse:
    return RedirectResponse("/queue")


@router.get("/favicon.ico")
def favicon() -> FileResponse:
    return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")


@router.get("/queue", response_class=HTMLResponse)
def queue_page(request: Request) -> HTMLResponse:
    return render(request, "queue.html", "Queue", page="queue")


@router.get("/configs", response_class=HTMLResponse)
def configs_page(request: Request) -> HTMLResponse:
    return render(request, "configs.html", "Configs", page="configs")


@router.get("/configs/new", response_class=HTMLResponse)
def new_config_page(request: Request) -> HTMLResponse:
    return render(request, "config_edit.html", "New config", page="configs", config_name="")


@router.get("/configs/{name}", response_class=HTMLResponse)
def edit_config_page(request: Request, name: Annotated[str, PathParam(max_length=200)]) -> HTMLResponse:
    if not re.fullmatch(NAME_PATTERN, name):
        return not_found(request, f"{name!r} is not a config name (letters, digits, '.', '_' and '-').")
    return render(request, "config_edit.html", f"Config {name}", page="configs", config_name=name)


@router.get("/datasets", response_class=HTMLResponse)
def datasets_page(request: Request) -> HTMLResponse:
    return render(request, "datasets.html", "Datasets", page="datasets")


@router.get("/datasets/{name}", response_class=HTMLResponse)
def dataset_page(request: Request, name: Annotated[str, PathParam(max_length=200)]) -> HTMLResponse:
    if not re.fullmatch(NAME_PATTERN, name):
        return not_found(request, f"{name!r} is not a dataset name (letters, digits, '.', '_' and '-').")
    return render(request, "dataset.html", f"Dataset {name}", page="datasets", dataset_name=name)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: Annotated[str, PathParam(max_length=40)]) -> HTMLResponse:
    if not job_id.isdigit() or not 1 <= int(job_id) <= MAX_ID:
        return not_found(request, f"There is no job {job_id!r}: job ids are whole numbers.")
    return render(request, "job.html", f"Job {job_id}", page="queue", job_id=int(job_id))


@router.get("/system", response_class=HTMLResponse)
def system_page(request: Request) -> HTMLResponse:
    return render(request, "system.html", "Hardware", page="system")
