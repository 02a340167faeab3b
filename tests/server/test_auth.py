"""Token auth: loopback trusted by default; remote (or --require-token) needs the bearer token."""

import pytest
from fastapi.testclient import TestClient

from simpletuner.server.app import create_app

from tests.server.helpers import LOOPBACK, REMOTE


@pytest.fixture
def remote(settings_factory):
    with TestClient(create_app(settings_factory(run_scheduler=False)), client=REMOTE) as c:
        yield c


PROTECTED = [("GET", "/api/jobs"), ("GET", "/api/configs"), ("GET", "/api/system"), ("GET", "/api/events"),
             ("POST", "/api/jobs"), ("GET", "/api/jobs/1/events"), ("GET", "/api/stream"),
             ("GET", "/api/datasets/browse"), ("POST", "/api/jobs/1/cancel"), ("GET", "/api/jobs/1/log")]


@pytest.mark.parametrize("method,path", PROTECTED)
def test_remote_without_token_is_401(remote, method, path):
    r = remote.request(method, path, json={} if method == "POST" else None)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"


def test_remote_with_token(remote):
    assert remote.get("/api/jobs", headers={"Authorization": "Bearer test-token"}).status_code == 200
    assert remote.get("/api/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert remote.get("/api/health").status_code == 200  # liveness stays open


def test_loopback_trusted_unless_required(settings_factory):
    loopback = {"client": LOOPBACK, "base_url": "http://127.0.0.1"}
    with TestClient(create_app(settings_factory(run_scheduler=False)), **loopback) as c:
        assert c.get("/api/jobs").status_code == 200
    with TestClient(create_app(settings_factory(run_scheduler=False, require_token=True)), **loopback) as c:
        assert c.get("/api/jobs").status_code == 401
        assert c.get("/api/jobs", headers={"Authorization": "Bearer test-token"}).status_code == 200


def test_generated_token_is_stored_and_reused(settings_factory, monkeypatch):
    monkeypatch.delenv("SIMPLETUNER_API_TOKEN", raising=False)
    s = settings_factory(token=None, run_scheduler=False)
    app = create_app(s)
    assert app.state.token_generated and len(app.state.token) > 30
    stored = (s.data_dir / "api_token")
    assert stored.read_text().strip() == app.state.token
    assert oct(stored.stat().st_mode & 0o777) == "0o600"
    again = create_app(settings_factory(token=None, run_scheduler=False))
    assert again.state.token == app.state.token and not again.state.token_generated


def test_token_from_env(settings_factory, monkeypatch):
    monkeypatch.setenv("SIMPLETUNER_API_TOKEN", "from-env")
    app = create_app(settings_factory(token=None, run_scheduler=False))
    with TestClient(app, client=REMOTE) as c:
        assert c.get("/api/jobs", headers={"Authorization": "Bearer from-env"}).status_code == 200
