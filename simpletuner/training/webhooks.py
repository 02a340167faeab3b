"""Trainer -> server (and user) webhooks. Torch-free: stdlib + httpx only.

``WebhookReporter.from_env()`` reads ``SIMPLETUNER_WEBHOOK_URL``, ``SIMPLETUNER_WEBHOOK_SECRET`` and
``SIMPLETUNER_JOB_ID`` (set by the server for every job) and, optionally, SimpleTuner's user-configured
``webhook_config`` (``raw`` JSON hooks and ``discord`` hooks). Events are queued and sent by one background
thread, in order, with retries, so the training loop never waits on the network. A reporter with nothing
configured does nothing and starts no thread.

Event JSON: ``{"job_id", "seq", "type", "time", "data"}``; to the server it is signed with HMAC-SHA256 over
the raw body in ``X-SimpleTuner-Signature: sha256=<hex>``.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from simpletuner.config.events import (  # noqa: F401  (re-exported: the wire contract lives in config)
    EVENT_TYPES,
    JOB_ID_ENV,
    SECRET_ENV,
    SIGNATURE_HEADER,
    URL_ENV,
    sign,
    verify,
)

logger = logging.getLogger("simpletuner.webhooks")

# Events that may be dropped when the queue is full (newer ones supersede them).
DROPPABLE = {"progress", "log"}
LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


def _event_level(event: Mapping[str, Any]) -> int:
    kind, data = event["type"], event.get("data", {})
    if kind == "error":
        return LEVELS["error"]
    if kind == "log":
        return LEVELS.get(str(data.get("level", "info")).lower(), LEVELS["info"])
    if kind == "status":
        return LEVELS["error"] if data.get("status") == "failed" else LEVELS["info"]
    if kind == "progress":
        return LEVELS["debug"]
    if kind == "image" and data.get("kind") == "preview":
        return LEVELS["debug"]
    return LEVELS["info"]


@dataclass
class _Target:
    kind: str  # "server" | "raw" | "discord"
    url: str
    secret: str | None = None
    level: int = LEVELS["info"]
    prefix: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    verify: bool = True  # TLS certificate checks (ssl_no_verify turns them off)

    def wants(self, event: Mapping[str, Any]) -> bool:
        return self.kind == "server" or _event_level(event) >= self.level


def _parse_webhook_config(webhook_config: Any) -> list[_Target]:
    if webhook_config is None or webhook_config == "" or webhook_config == []:
        return []
    if isinstance(webhook_config, (str, Path)):
        text = str(webhook_config)
        if text.lstrip().startswith(("{", "[")):
            webhook_config = json.loads(text)
        else:
            webhook_config = json.loads(Path(text).read_text())
    if isinstance(webhook_config, Mapping) or hasattr(webhook_config, "model_dump"):
        webhook_config = [webhook_config]
    targets: list[_Target] = []
    for i, hook in enumerate(webhook_config):
        if hasattr(hook, "model_dump"):  # the config layer's WebhookConfig
            hook = hook.model_dump()
        if not isinstance(hook, Mapping):
            raise ValueError(f"webhook_config[{i}]: expected an object, got {type(hook).__name__}")
        kind = str(hook.get("webhook_type", "discord")).lower()
        if kind not in ("raw", "discord"):
            raise ValueError(f"webhook_config[{i}].webhook_type: {kind!r} is not one of 'raw', 'discord'")
        url = hook.get("callback_url") or hook.get("webhook_url")
        if not url:
            raise ValueError(f"webhook_config[{i}].callback_url: required")
        level_name = str(hook.get("log_level", "info")).lower()
        if level_name not in LEVELS:
            raise ValueError(f"webhook_config[{i}].log_level: {level_name!r} is not one of {', '.join(LEVELS)}")
        targets.append(
            _Target(
                kind=kind,
                url=str(url),
                level=LEVELS[level_name],
                prefix=str(hook.get("message_prefix") or ""),
                headers={str(k): str(v) for k, v in (hook.get("headers") or {}).items()},
                secret=hook.get("secret") or None,
                verify=not bool(hook.get("ssl_no_verify", False)),
            )
        )
    return targets


def _discord_message(event: Mapping[str, Any], prefix: str) -> str:
    kind, d = event["type"], event.get("data", {})
    lead = f"{prefix} " if prefix else ""
    if kind == "progress":
        text = f"step {d.get('step')}/{d.get('total_steps')} loss {d.get('loss')} lr {d.get('lr')}"
    elif kind == "checkpoint":
        text = f"checkpoint saved at step {d.get('step')}: {d.get('path')}"
    elif kind == "image":
        text = f"{d.get('kind', 'validation')} image at step {d.get('step')}"
        if d.get("prompt"):
            text += f": {d['prompt']}"
    elif kind == "scores":
        metrics = ", ".join(f"{k}={v}" for k, v in (d.get("metrics") or {}).items())
        text = f"scores at step {d.get('step')}: {metrics}"
    elif kind == "status":
        extra = ", ".join(f"{k}={v}" for k, v in d.items() if k != "status")
        text = f"training {d.get('status')}" + (f" ({extra})" if extra else "")
    elif kind == "error":
        text = f"error: {d.get('message')}"
    else:
        text = str(d.get("message", ""))
    return (lead + text)[:2000]  # Discord's message limit


class WebhookReporter:
    """Sends training events to the job server and to user webhooks without blocking the caller."""

    def __init__(
        self,
        server_url: str | None = None,
        secret: str | None = None,
        job_id: int | str | None = None,
        webhook_config: Any = None,
        *,
        max_queue: int = 1000,
        max_attempts: int = 6,
        timeout: float = 10.0,
        backoff: float = 0.25,
    ):
        self.job_id = int(job_id) if job_id not in (None, "") and str(job_id).isdigit() else job_id
        self.targets: list[_Target] = []
        if server_url:
            self.targets.append(_Target(kind="server", url=server_url, secret=secret or ""))
        self.targets.extend(_parse_webhook_config(webhook_config))
        self.max_queue = max_queue
        self.max_attempts = max_attempts
        self.timeout = timeout
        self.backoff = backoff
        self.dropped = 0
        self.sent = 0
        self.failed = 0
        self._seq = 0
        self._queue: collections.deque[dict] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._clients: dict[bool, Any] = {}

    @classmethod
    def from_env(cls, webhook_config: Any = None, **kwargs: Any) -> "WebhookReporter":
        """A reporter for the server named in the environment (if any) plus ``webhook_config``."""
        return cls(
            server_url=os.environ.get(URL_ENV) or None,
            secret=os.environ.get(SECRET_ENV) or None,
            job_id=os.environ.get(JOB_ID_ENV) or None,
            webhook_config=webhook_config,
            **kwargs,
        )

    @property
    def enabled(self) -> bool:
        return bool(self.targets)

    # ---- public event methods ----------------------------------------------------------------
    def progress(self, step, total_steps, loss, lr, it_per_s, eta_s, epoch=None) -> None:
        self._emit(
            "progress",
            {
                "step": step,
                "total_steps": total_steps,
                "loss": _num(loss),
                "lr": _num(lr),
                "it_per_s": _num(it_per_s),
                "eta_s": _num(eta_s),
                "epoch": epoch,
            },
        )

    def checkpoint(self, step, path) -> None:
        self._emit("checkpoint", {"step": step, "path": str(path)})

    def image(self, kind, step, path, prompt=None, nickname=None, resolution=None, inference_step=None,
              video_path=None, seed=None) -> None:
        """An image event carrying the file itself (``image_base64``); a video family's validation sends its
        poster frame as the image and the mp4 as ``video_base64``."""
        if not self.enabled:
            return
        data: dict[str, Any] = {
            "kind": kind,
            "step": step,
            "path": str(path),
            "prompt": prompt,
            "nickname": nickname,
            "resolution": list(resolution) if resolution is not None else None,
            "inference_step": inference_step,
            "seed": seed,
        }
        try:
            data["image_base64"] = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        except OSError as exc:
            data["image_error"] = str(exc)
        if video_path is not None:
            data["video_path"] = str(video_path)
            try:
                data["video_base64"] = base64.b64encode(Path(video_path).read_bytes()).decode("ascii")
            except OSError as exc:
                data["video_error"] = str(exc)
        self._emit("image", data)

    def scores(self, step, metrics: dict) -> None:
        self._emit("scores", {"step": step, "metrics": {str(k): _num(v) for k, v in dict(metrics).items()}})

    def status(self, status: str, **info: Any) -> None:
        self._emit("status", {"status": status, **{k: _jsonable(v) for k, v in info.items()}})

    def error(self, message: str, traceback: str | None = None) -> None:
        self._emit("error", {"message": str(message), "traceback": traceback})

    def log(self, message: str, level: str = "info") -> None:
        self._emit("log", {"message": str(message), "level": level})

    def close(self, timeout: float = 10) -> bool:
        """Send what is queued (waiting at most ``timeout`` seconds) and stop. True if all was sent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        drained = True
        if self._thread is not None:
            self._thread.join(timeout)
            drained = not self._thread.is_alive()
        if drained:
            for client in self._clients.values():
                client.close()
        return drained and not self._queue

    def flush(self, timeout: float = 10) -> bool:
        """Wait until the queue is empty (or ``timeout``); the reporter stays open."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def __enter__(self) -> "WebhookReporter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------------
    def _emit(self, kind: str, data: dict) -> None:
        if not self.targets:
            return
        with self._cond:
            if self._closed:
                return
            self._seq += 1
            event = {"job_id": self.job_id, "seq": self._seq, "type": kind, "time": time.time(), "data": data}
            if len(self._queue) >= self.max_queue:
                victim = next((e for e in self._queue if e["type"] in DROPPABLE), None)
                if victim is not None:
                    self._queue.remove(victim)
                    self.dropped += 1
                elif kind in DROPPABLE:
                    self.dropped += 1
                    return
                # else: an important event goes in anyway; the bound is soft for those (they are rare)
            self._queue.append(event)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="simpletuner-webhooks", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                event = self._queue.popleft()
                self._busy = True
            try:
                for target in self.targets:
                    if target.wants(event):
                        self._deliver(target, event)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _http(self, verify: bool = True):
        if verify not in self._clients:
            import httpx

            # One INFO line per POST would flood the training log.
            logging.getLogger("httpx").setLevel(max(logging.getLogger("httpx").level, logging.WARNING))
            self._clients[verify] = httpx.Client(timeout=self.timeout, verify=verify)
        return self._clients[verify]

    def _deliver(self, target: _Target, event: dict) -> None:
        for attempt in range(self.max_attempts):
            try:
                response = self._send(target, event)
            except Exception as exc:  # network errors: retry
                logger.debug("webhook %s: %s", target.url, exc)
                response = None
            if response is not None:
                code = response.status_code
                if code < 300:
                    self.sent += 1
                    return
                if code == 429:
                    retry_after = _retry_after(response)
                    time.sleep(min(retry_after if retry_after is not None else self.backoff * 2**attempt, 30))
                    continue
                if 400 <= code < 500 and code != 408:
                    logger.warning("webhook %s refused %s event: HTTP %s", target.url, event["type"], code)
                    self.failed += 1
                    return
            if attempt + 1 < self.max_attempts:
                # While closing, keep retrying but don't sleep past close()'s patience.
                time.sleep(min(self.backoff * 2**attempt, 10))
        logger.warning("webhook %s: giving up on %s event seq %s", target.url, event["type"], event["seq"])
        self.failed += 1

    def _send(self, target: _Target, event: dict):
        client = self._http(target.verify)
        if target.kind == "server":
            body = json.dumps(event, separators=(",", ":")).encode()
            headers = {"Content-Type": "application/json", SIGNATURE_HEADER: sign(target.secret or "", body)}
            return client.post(target.url, content=body, headers=headers)
        if target.kind == "raw":
            payload = dict(event)
            if target.prefix:
                payload["message_prefix"] = target.prefix
            body = json.dumps(payload, separators=(",", ":")).encode()
            headers = {"Content-Type": "application/json", **target.headers}
            if target.secret:
                headers[SIGNATURE_HEADER] = sign(target.secret, body)
            return client.post(target.url, content=body, headers=headers)
        # discord
        message = {"content": _discord_message(event, target.prefix)}
        data = event.get("data", {})
        if event["type"] == "image" and (data.get("video_base64") or data.get("image_base64")):
            stem = f"{data.get('kind', 'image')}-{data.get('step', 0)}"
            if data.get("video_base64"):  # a validation video goes as the mp4 itself
                upload = (f"{stem}.mp4", base64.b64decode(data["video_base64"]), "video/mp4")
            else:
                upload = (f"{stem}.png", base64.b64decode(data["image_base64"]), "image/png")
            return client.post(
                target.url,
                data={"payload_json": json.dumps(message)},
                files={"file": upload},
                headers=target.headers,
            )
        return client.post(target.url, json=message, headers=target.headers)


def _retry_after(response) -> float | None:
    try:
        value = response.headers.get("Retry-After")
        if value is not None:
            return float(value)
        return float(response.json().get("retry_after"))
    except Exception:
        return None


def _num(value: Any) -> Any:
    """Plain float/int for tensors, numpy scalars and friends; NaN/inf become None (invalid JSON)."""
    if value is None or isinstance(value, (int, str, bool)):
        return value
    try:
        f = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return str(value)
    return f if f == f and f not in (float("inf"), float("-inf")) else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return _num(value)
