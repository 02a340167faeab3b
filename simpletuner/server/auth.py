"""Bearer-token auth: loopback clients are trusted unless ``require_token``; everyone else needs the token.

Browsers' EventSource cannot send headers, so ``?token=`` is accepted as well.
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import HTTPException, Request, status


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


def presented_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.query_params.get("token") or None


def client_is_trusted(request: Request) -> bool:
    settings = request.app.state.settings
    if settings.require_token or not settings.trust_loopback:
        return False
    return is_loopback(request.client.host if request.client else None)


def require_auth(request: Request) -> None:
    """FastAPI dependency: 401 unless the client is a trusted loopback client or shows the token."""
    if client_is_trusted(request):
        return
    expected = request.app.state.token
    token = presented_token(request)
    if token and expected and hmac.compare_digest(token.encode(), expected.encode()):
        return
    raise HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED,
        detail="missing or invalid API token (send 'Authorization: Bearer <token>')",
        headers={"WWW-Authenticate": "Bearer"},
    )
