"""Who may call the API.

- A loopback client is trusted (unless ``require_token``) only when the request also *names* a loopback host
  (``Host: 127.0.0.1:8001`` / ``localhost`` / ``[::1]``, or an ``--allowed-host``) and, if it carries an
  ``Origin``, comes from the same origin: a web page elsewhere, or a DNS-rebound name, gets no trust.
- Everyone else shows the token: ``Authorization: Bearer <token>``, or the web UI's session cookie (HttpOnly,
  SameSite=Strict), which ``POST /api/session`` sets for a client that showed the token; browsers' EventSource
  and ``<img>`` cannot send headers, and a token in a URL would end up in logs and histories, so ``?token=``
  is refused.
- State-changing requests (anything but GET/HEAD/OPTIONS) from another origin are refused outright
  (``origin_guard`` in ``app.py``), token or not.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from urllib.parse import urlsplit

from fastapi import HTTPException, Request, status

SESSION_COOKIE = "simpletuner_session"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


def _host_name(netloc: str) -> str:
    """``"[::1]:8001"`` -> ``"::1"``, ``"Localhost:8001"`` -> ``"localhost"``."""
    try:
        return (urlsplit(f"//{netloc}").hostname or "").lower()
    except ValueError:
        return ""


def names_loopback(request: Request) -> bool:
    """The Host header names this machine's loopback (or a host the operator allowed)."""
    name = _host_name(request.headers.get("host", ""))
    return name in LOOPBACK_NAMES or is_loopback(name) or name in request.app.state.settings.allowed_hosts


def _allowed_origins(request: Request) -> set[str]:
    settings = request.app.state.settings
    origins = {o.rstrip("/").lower() for o in settings.allowed_origins}
    if settings.public_url:
        parts = urlsplit(settings.public_url)
        origins.add(f"{parts.scheme}://{parts.netloc}".lower())
    return origins


def same_origin(request: Request) -> bool:
    """No ``Origin`` (not a browser's cross-site request) or the origin this request was sent to."""
    origin = request.headers.get("origin")
    if origin is None:
        return request.headers.get("sec-fetch-site", "same-origin") in ("same-origin", "none")
    if origin.rstrip("/").lower() in _allowed_origins(request):
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == request.headers.get("host", "").lower()


def presented_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def session_value(token: str) -> str:
    """The UI session cookie's value: derived from the token, so the cookie itself is no API token."""
    return hmac.new(token.encode(), b"simpletuner-ui-session", hashlib.sha256).hexdigest()


def client_is_trusted(request: Request) -> bool:
    settings = request.app.state.settings
    if settings.require_token or not settings.trust_loopback:
        return False
    return (is_loopback(request.client.host if request.client else None) and names_loopback(request)
            and same_origin(request))


def token_ok(request: Request) -> bool:
    expected = request.app.state.token
    if not expected:
        return False
    token = presented_token(request)
    if token and hmac.compare_digest(token.encode(), expected.encode()):
        return True
    cookie = request.cookies.get(SESSION_COOKIE)
    return bool(cookie) and hmac.compare_digest(cookie.encode(), session_value(expected).encode())


def require_auth(request: Request) -> None:
    """FastAPI dependency: 401 unless the client is a trusted loopback client or shows the token."""
    if "token" in request.query_params:
        raise HTTPException(status_code=400, detail="a token in the URL is refused (URLs end up in logs): send "
                                                    "'Authorization: Bearer <token>'")
    if client_is_trusted(request) or token_ok(request):
        return
    raise HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED,
        detail="missing or invalid API token (send 'Authorization: Bearer <token>')",
        headers={"WWW-Authenticate": "Bearer"},
    )
