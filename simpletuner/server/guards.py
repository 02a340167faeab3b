"""Checks every request passes before any route sees it: a body size limit (``max_request_bytes``; trainer
webhooks ``max_event_bytes``; dataset uploads ``max_upload_bytes``, streamed rather than held in memory), and no
state-changing request from another origin (a page elsewhere POSTing to localhost, or a DNS-rebound name)."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import JSONResponse

from .auth import SAFE_METHODS, same_origin

WEBHOOK_PATH = re.compile(r"^/api/jobs/[^/]+/events/?$")
UPLOAD_PATH = re.compile(r"^/api/datasets/[^/]+/files/?$")


class _TooLarge(Exception):
    pass


class RequestGuard:
    """Pure ASGI middleware. A body is read (at most the limit) before the app runs, so an oversized one is
    answered 413 without being held in memory, whether it announces its length or is sent chunked."""

    def __init__(self, app, settings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        if scope["method"] not in SAFE_METHODS and not same_origin(request):
            return await JSONResponse({"detail": "cross-origin request refused"}, status_code=403)(
                scope, receive, send)
        if scope["method"] in SAFE_METHODS:
            return await self.app(scope, receive, send)
        if scope["method"] == "POST" and UPLOAD_PATH.match(scope["path"]):
            return await self._stream(scope, receive, send, request)
        is_webhook = scope["method"] == "POST" and WEBHOOK_PATH.match(scope["path"])
        limit = self.settings.max_event_bytes if is_webhook else self.settings.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await self._too_large(scope, receive, send, limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return await self._too_large(scope, receive, send, limit)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _stream(self, scope, receive, send, request):
        """An upload: its announced length must fit ``max_upload_bytes``; the body passes through as it arrives
        (the multipart parser spools files to disk) and is cut off if it grows past what it announced."""
        limit = self.settings.max_upload_bytes
        length = request.headers.get("content-length")
        if length is None:
            return await JSONResponse({"detail": "an upload must send Content-Length"}, status_code=411)(
                scope, receive, send)
        if not length.isdigit() or int(length) > limit:
            return await self._too_large(scope, receive, send, limit)
        announced, seen = int(length), 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > announced:
                raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            return await self._too_large(scope, receive, send, limit)

    @staticmethod
    async def _too_large(scope, receive, send, limit: int):
        response = JSONResponse({"detail": f"request body too large (limit {limit} bytes)"}, status_code=413,
                                headers={"Connection": "close"})
        await response(scope, receive, send)
