"""The trainer -> server event wire contract: event types, signing, and the environment a job runs with.

Both ends import this (the trainer's webhook client in ``simpletuner.training.webhooks`` and the server's event
ingestion), so it stays in the config layer: standard library only, no torch.

An event is JSON ``{"job_id", "seq", "type", "time", "data"}``. To the server it is signed with HMAC-SHA256 over
the raw body, sent as ``X-SimpleTuner-Signature: sha256=<hex>``.
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "X-SimpleTuner-Signature"
# set by the server for every job it launches
URL_ENV = "SIMPLETUNER_WEBHOOK_URL"
SECRET_ENV = "SIMPLETUNER_WEBHOOK_SECRET"
JOB_ID_ENV = "SIMPLETUNER_JOB_ID"

EVENT_TYPES = ("progress", "checkpoint", "image", "scores", "status", "error", "log")


def sign(secret: str, body: bytes) -> str:
    """The signature header value for ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, header: str | None) -> bool:
    """True when ``header`` is the signature of ``body`` under ``secret`` (constant-time compare)."""
    if not header or not secret:
        return False
    return hmac.compare_digest(sign(secret, body), header.strip())
