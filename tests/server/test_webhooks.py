"""WebhookReporter (trainer side): ordering, seq, signing, retries, non-blocking, raw and Discord hooks."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from simpletuner.training.webhooks import SIGNATURE_HEADER, WebhookReporter, sign, verify

from tests.server.helpers import PNG


class Receiver:
    """A tiny HTTP server recording requests; ``fail_first`` answers 500 that many times first."""

    def __init__(self, fail_first: int = 0, status: int = 200, delay: float = 0.0,
                 hold: threading.Event | None = None):
        self.requests: list[dict] = []
        self.fail_first = fail_first
        self.arrived = threading.Event()  # set when a request has come in (before any hold)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.arrived.set()
                if hold is not None:
                    hold.wait(30)
                if delay:
                    time.sleep(delay)
                if outer.fail_first > 0:
                    outer.fail_first -= 1
                    self.send_response(500)
                    self.end_headers()
                    return
                outer.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def json(self) -> list[dict]:
        return [json.loads(r["body"]) for r in self.requests]

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def receiver():
    made = []

    def make(**kw):
        made.append(Receiver(**kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_nothing_configured_is_a_cheap_no_op(monkeypatch):
    for var in ("SIMPLETUNER_WEBHOOK_URL", "SIMPLETUNER_WEBHOOK_SECRET", "SIMPLETUNER_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    r = WebhookReporter.from_env()
    assert not r.enabled
    r.progress(1, 10, 0.5, 1e-4, 1.0, 9.0)
    r.image("validation", 1, "/does/not/exist.png")
    assert r._thread is None and r.close() is True


def test_server_events_are_signed_ordered_and_numbered(receiver, monkeypatch):
    rx = receiver()
    monkeypatch.setenv("SIMPLETUNER_WEBHOOK_URL", rx.url)
    monkeypatch.setenv("SIMPLETUNER_WEBHOOK_SECRET", "sekrit")
    monkeypatch.setenv("SIMPLETUNER_JOB_ID", "7")
    r = WebhookReporter.from_env()
    r.status("running")
    for step in range(1, 21):
        r.progress(step, 20, 1.0 / step, 1e-4, 5.0, 20 - step, epoch=0)
    r.checkpoint(20, "/out/checkpoint-20")
    r.scores(20, {"clip_score": 0.25})
    r.log("hello", level="warning")
    r.status("succeeded", final_loss=0.05)
    assert r.close(10)
    events = rx.json()
    assert [e["seq"] for e in events] == list(range(1, 26))
    assert all(e["job_id"] == 7 for e in events)
    assert [e["data"]["step"] for e in events if e["type"] == "progress"] == list(range(1, 21))
    for req in rx.requests:
        assert verify("sekrit", req["body"], req["headers"][SIGNATURE_HEADER])
    assert events[-1]["data"] == {"status": "succeeded", "final_loss": 0.05}


def test_retries_with_backoff_preserve_order(receiver):
    rx = receiver(fail_first=3)
    r = WebhookReporter(rx.url, "s", 1, backoff=0.01)
    for step in range(1, 4):
        r.progress(step, 3, 0.1, 1e-4, 1.0, 0.0)
    assert r.close(10)
    assert [e["seq"] for e in rx.json()] == [1, 2, 3]


def test_4xx_is_not_retried(receiver):
    rx = receiver(status=403)
    r = WebhookReporter(rx.url, "wrong", 1, backoff=0.01)
    r.status("running")
    assert r.close(5)
    assert len(rx.requests) == 1 and r.failed == 1


def test_sending_never_blocks_the_training_loop(receiver):
    release = threading.Event()
    rx = receiver(hold=release)  # a server that answers nothing until released
    r = WebhookReporter(rx.url, "s", 1, max_queue=50)
    r.status("running")
    assert rx.arrived.wait(30)  # the sender thread is now stuck on that request
    for step in range(500):
        r.progress(step, 500, 0.1, 1e-4, 1.0, 0.0)
    r.status("succeeded")  # important events are never dropped
    # every call above returned while the server still held the first request: none waited on the network
    assert not release.is_set() and rx.requests == []
    assert r.dropped > 0 and len(r._queue) <= 51
    assert any(e["type"] == "status" and e["data"]["status"] == "succeeded" for e in r._queue)
    release.set()
    assert r.close(30)
    assert [e["data"]["status"] for e in rx.json() if e["type"] == "status"] == ["running", "succeeded"]


def test_unreachable_server_gives_up_without_raising():
    r = WebhookReporter("http://127.0.0.1:9/none", "s", 1, max_attempts=2, backoff=0.01, timeout=0.5)
    r.status("running")
    assert r.close(10)
    assert r.failed == 1


def test_raw_and_discord_hooks(receiver, tmp_path):
    raw, discord = receiver(), receiver()
    img = tmp_path / "v.png"
    img.write_bytes(PNG)
    hooks = [
        {"webhook_type": "raw", "callback_url": raw.url, "log_level": "info", "message_prefix": "run-1",
         "secret": "rawsecret"},
        {"webhook_type": "discord", "callback_url": discord.url, "log_level": "info", "message_prefix": "[tiny]"},
    ]
    r = WebhookReporter(webhook_config=hooks, backoff=0.01)
    r.progress(1, 2, 0.5, 1e-4, 1.0, 1.0)  # debug level: neither hook wants it
    r.checkpoint(2, "/out/checkpoint-2")
    r.image("validation", 2, img, prompt="a cat")
    r.status("succeeded", final_loss=0.1)
    assert r.close(10)
    assert [e["type"] for e in raw.json()] == ["checkpoint", "image", "status"]
    assert raw.json()[0]["message_prefix"] == "run-1"
    assert verify("rawsecret", raw.requests[0]["body"], raw.requests[0]["headers"][SIGNATURE_HEADER])
    texts = [req for req in discord.requests]
    assert json.loads(texts[0]["body"])["content"].startswith("[tiny] checkpoint saved at step 2")
    assert texts[1]["headers"]["Content-Type"].startswith("multipart/form-data")
    assert PNG in texts[1]["body"] and b"validation image at step 2: a cat" in texts[1]["body"]
    assert "training succeeded" in json.loads(texts[2]["body"])["content"]


def test_error_level_hook_only_gets_errors(receiver):
    rx = receiver()
    r = WebhookReporter(webhook_config={"webhook_type": "raw", "callback_url": rx.url, "log_level": "error"})
    r.status("running")
    r.error("boom", "Traceback...")
    r.status("failed")
    assert r.close(10)
    assert [(e["type"], e["data"].get("status")) for e in rx.json()] == [("error", None), ("status", "failed")]


def test_bad_webhook_config_names_the_field():
    with pytest.raises(ValueError, match=r"webhook_config\[0\].webhook_type"):
        WebhookReporter(webhook_config=[{"webhook_type": "slack", "callback_url": "http://x"}])
    with pytest.raises(ValueError, match=r"webhook_config\[1\].callback_url"):
        WebhookReporter(webhook_config=[{"webhook_type": "raw", "callback_url": "http://x"}, {"webhook_type": "raw"}])


def test_values_are_plain_json():
    class Scalar:
        def item(self):
            return 0.25

    r = WebhookReporter(webhook_config={"webhook_type": "raw", "callback_url": "http://127.0.0.1:9/x"},
                        max_attempts=1)
    r.progress(1, 2, Scalar(), float("nan"), 1.0, float("inf"))
    ev = r._queue[0]
    assert ev["data"]["loss"] == 0.25 and ev["data"]["lr"] is None and ev["data"]["eta_s"] is None
    json.dumps(ev, allow_nan=False)
    r.close(0.1)


def test_sign_and_verify():
    assert verify("k", b"body", sign("k", b"body"))
    assert not verify("k", b"body", sign("other", b"body"))
    assert not verify("k", b"body", None)
