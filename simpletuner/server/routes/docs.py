"""The API docs page, served offline: Swagger UI's own files come from the swagger-ui-bundle-v2 package (no CDN), so
the page works behind a firewall and with no internet at all."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse

router = APIRouter(include_in_schema=False)
ASSETS = "/static/swagger"


def assets_dir() -> str:
    """The folder of Swagger UI's files (swagger-ui-bundle.js, swagger-ui.css, ...) inside the installed package."""
    from swagger_ui_bundle import swagger_ui_path

    return str(swagger_ui_path)


@router.get("/docs", response_class=HTMLResponse)
def docs(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url=request.app.openapi_url, title=f"{request.app.title} · API",
                               swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                               swagger_css_url=f"{ASSETS}/swagger-ui.css",
                               swagger_favicon_url="/static/favicon.svg",
                               oauth2_redirect_url="/docs/oauth2-redirect")


@router.get("/docs/oauth2-redirect", response_class=HTMLResponse)
def oauth2_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()
