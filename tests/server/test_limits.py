"""Request size limits (issue 15): a 100 MB submit was stored and took ~1 GB of server memory. Every body is
limited (``max_request_bytes``, 8 MiB by default; trainer webhooks ``max_event_bytes``) and an oversized one is
answered 413 without being read, whether it says its length or comes chunked. Over real HTTP (uvicorn)."""

from __future__ import annotations

import json

import httpx

from tests.server.helpers import job_body

MB = 1024 * 1024


def _big_body(size: int) -> bytes:
    body = job_body()
    body["train_config"]["validation_prompt"] = "x" * size
    return json.dumps(body).encode()


def _chunks(data: bytes, size: int = 256 * 1024):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_a_100_mb_submit_is_refused_and_nothing_is_stored(live_server):
    srv = live_server(run_scheduler=False)
    big = _big_body(100 * MB)
    r = srv.http.post("/api/jobs", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "too large" in r.json()["detail"]
    try:  # chunked, no Content-Length: the server stops reading at the limit
        r = srv.http.post("/api/jobs", content=_chunks(big), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
    except httpx.TransportError:
        pass  # the server answered and closed while the client was still sending: also refused
    assert srv.http.get("/api/jobs").json()["total"] == 0
    assert srv.http.post("/api/configs", content=big, headers={"Content-Type": "application/json"}).status_code == 413


def test_the_limit_is_configurable_and_normal_requests_pass(live_server):
    srv = live_server(run_scheduler=False, max_request_bytes=64 * 1024)
    assert srv.http.post("/api/jobs", json=job_body()).status_code == 201
    r = srv.http.post("/api/jobs", content=_big_body(100 * 1024), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "65536" in r.json()["detail"]


def test_trainer_webhooks_have_their_own_larger_limit(live_server):
    srv = live_server(run_scheduler=False, max_request_bytes=64 * 1024, max_event_bytes=512 * 1024)
    job = srv.http.post("/api/jobs", json=job_body()).json()["id"]
    event = json.dumps({"seq": 1, "type": "log", "time": 1.0, "data": {"message": "y" * 200_000}}).encode()
    r = srv.http.post(f"/api/jobs/{job}/events", content=event, headers={"X-SimpleTuner-Signature": "sha256=00"})
    assert r.status_code == 403  # past the size check; refused for its signature
    huge = json.dumps({"seq": 1, "type": "log", "time": 1.0, "data": {"message": "y" * 600_000}}).encode()
    r = srv.http.post(f"/api/jobs/{job}/events", content=huge, headers={"X-SimpleTuner-Signature": "sha256=00"})
    assert r.status_code == 413
