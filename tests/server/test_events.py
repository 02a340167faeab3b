"""Trainer webhooks: HMAC verification, idempotency, folding into the job, JSON and SSE read-back."""

import base64
import json
import secrets
import time

from fastapi.testclient import TestClient

from simpletuner.server.app import create_app
from simpletuner.server.db import JobRow
from simpletuner.config.events import SIGNATURE_HEADER, sign

from tests.server.helpers import PNG, REMOTE, job_body


def _running_job(client) -> tuple[int, str]:
    """Submit a job (scheduler off) and mark it running with a known secret, as a claim would."""
    job_id = client.post("/api/jobs", json=job_body()).json()["id"]
    secret = secrets.token_hex(16)
    with client.app.state.db.session(write=True) as s:
        job = s.get(JobRow, job_id)
        job.status, job.attempt, job.webhook_secret = "running", 1, secret
        job.run_dir = str(client.app.state.settings.data_dir / "runs" / f"job-{job_id}")
    return job_id, secret


def _post(client, job_id, secret, event, signature=None):
    body = json.dumps(event).encode()
    headers = {"Content-Type": "application/json"}
    if secret is not None or signature is not None:
        headers[SIGNATURE_HEADER] = signature or sign(secret, body)
    return client.post(f"/api/jobs/{job_id}/events", content=body, headers=headers)


def _event(job_id, seq, type_="progress", **data):
    return {"job_id": job_id, "seq": seq, "type": type_, "time": time.time(), "data": data}


def test_signed_event_is_stored_and_folded(client):
    job_id, secret = _running_job(client)
    r = _post(client, job_id, secret, _event(job_id, 1, step=2, total_steps=10, loss=0.5, lr=1e-4))
    assert r.status_code == 200 and r.json()["accepted"] and not r.json()["duplicate"]
    job = client.get(f"/api/jobs/{job_id}").json()
    assert job["progress"]["step"] == 2 and job["progress"]["loss"] == 0.5
    events = client.get(f"/api/jobs/{job_id}/events", params={"type": "progress"}).json()["events"]
    assert [(e["source"], e["seq"], e["data"]["step"]) for e in events] == [("trainer", 1, 2)]


def test_unsigned_forged_and_misaddressed_events_are_refused(client):
    job_id, secret = _running_job(client)
    assert _post(client, job_id, None, _event(job_id, 1)).status_code == 401
    assert _post(client, job_id, None, _event(job_id, 1), signature="sha256=" + "0" * 64).status_code == 403
    assert _post(client, job_id, "not-the-secret", _event(job_id, 1)).status_code == 403
    other_id, _ = _running_job(client)
    assert _post(client, other_id, secret, _event(other_id, 1)).status_code == 403  # another job's secret
    assert _post(client, job_id, secret, _event(other_id, 1)).status_code == 422  # body names another job
    assert _post(client, 999, secret, _event(999, 1)).status_code == 404
    queued = client.post("/api/jobs", json=job_body()).json()["id"]  # never started: no secret yet
    assert _post(client, queued, secret, _event(queued, 1)).status_code == 403
    bad = _post(client, job_id, secret, {"job_id": job_id, "seq": 1, "type": "nonsense", "time": 0, "data": {}})
    assert bad.status_code == 422
    assert client.get(f"/api/jobs/{job_id}/events").json()["events"] == [e for e in client.get(
        f"/api/jobs/{job_id}/events").json()["events"] if e["source"] == "server"]


def test_webhook_needs_no_bearer_token_but_reads_do(settings_factory):
    app = create_app(settings_factory(run_scheduler=False))
    with TestClient(app, client=REMOTE) as c:
        auth = {"Authorization": "Bearer test-token"}
        job_id = c.post("/api/jobs", json=job_body(), headers=auth).json()["id"]
        with app.state.db.session(write=True) as s:
            job = s.get(JobRow, job_id)
            job.status, job.attempt, job.webhook_secret = "running", 1, "s3cret"
        assert _post(c, job_id, "s3cret", _event(job_id, 1)).status_code == 200
        assert c.get(f"/api/jobs/{job_id}/events").status_code == 401


def test_repeated_seq_is_idempotent(client):
    job_id, secret = _running_job(client)
    first = _post(client, job_id, secret, _event(job_id, 5, step=5))
    again = _post(client, job_id, secret, _event(job_id, 5, step=5))
    assert again.status_code == 200 and again.json()["duplicate"] and again.json()["id"] == first.json()["id"]
    trainer = [e for e in client.get(f"/api/jobs/{job_id}/events").json()["events"] if e["source"] == "trainer"]
    assert len(trainer) == 1


def test_image_scores_checkpoint_status_error(client):
    job_id, secret = _running_job(client)
    png = base64.b64encode(PNG).decode()
    events = [
        _event(job_id, 1, "checkpoint", step=10, path="/x/checkpoint-10"),
        _event(job_id, 2, "image", kind="validation", step=10, path="/x/v.png", prompt="cat", image_base64=png),
        _event(job_id, 3, "image", kind="preview", step=10, path="/x/p.png", image_base64="bm90IGFuIGltYWdl"),
        _event(job_id, 4, "scores", step=10, metrics={"clip_score": 0.3}),
        _event(job_id, 5, "error", message="boom", traceback="Traceback ..."),
        _event(job_id, 6, "status", status="succeeded", final_loss=0.12, lora_path="/x/lora.safetensors"),
    ]
    for ev in events:
        assert _post(client, job_id, secret, ev).status_code == 200
    job = client.get(f"/api/jobs/{job_id}").json()
    res = job["results"]
    assert res["last_checkpoint"] == "/x/checkpoint-10" and res["scores"] == {"clip_score": 0.3}
    assert res["final_loss"] == 0.12 and res["trainer_status"] == "succeeded"
    assert job["error"] == "boom"
    stored = client.get(f"/api/jobs/{job_id}/events", params={"type": "image"}).json()["events"]
    assert "image_base64" not in stored[0]["data"]
    url = stored[0]["data"]["image_url"]
    img = client.get(url)
    assert img.status_code == 200 and img.content == PNG
    assert stored[1]["data"]["image_error"]  # not an image: kept as an event, not saved


def test_events_paging_and_global_feed(client):
    job_id, secret = _running_job(client)
    for seq in range(1, 6):
        _post(client, job_id, secret, _event(job_id, seq, step=seq))
    page = client.get(f"/api/jobs/{job_id}/events", params={"limit": 2}).json()
    rest = client.get(f"/api/jobs/{job_id}/events", params={"after": page["last_id"]}).json()
    ids = [e["id"] for e in page["events"] + rest["events"]]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert len(client.get("/api/events").json()["events"]) >= 5


def _read_sse(response, stop_after: int) -> list[dict]:
    out, current = [], {}
    for line in response.iter_lines():
        if line == "":
            if "data" in current and current.get("event") != "end":
                out.append({"id": current.get("id"), **json.loads(current["data"])})
            if current.get("event") == "end" or len(out) >= stop_after:
                break
            current = {}
        elif not line.startswith(":"):
            k, _, v = line.partition(": ")
            current[k] = v
    return out


def test_sse_replays_from_last_event_id(client):
    job_id, secret = _running_job(client)
    for seq in range(1, 5):
        _post(client, job_id, secret, _event(job_id, seq, step=seq))
    with client.app.state.db.session(write=True) as s:
        s.get(JobRow, job_id).status = "succeeded"  # so until_done closes the stream
    with client.stream("GET", f"/api/jobs/{job_id}/stream", params={"until_done": "true"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        everything = _read_sse(r, 100)
    progress = [e for e in everything if e["type"] == "progress"]
    assert [e["data"]["step"] for e in progress] == [1, 2, 3, 4]
    cut = progress[1]["id"]
    with client.stream("GET", f"/api/jobs/{job_id}/stream", params={"until_done": "true"},
                       headers={"Last-Event-ID": str(cut)}) as r:
        replay = _read_sse(r, 100)
    assert [e["data"]["step"] for e in replay if e["type"] == "progress"] == [3, 4]
    assert all(e["id"] > cut for e in replay)
