"""Browser-origin attacks on a loopback server (issue 15): a page elsewhere must not change anything, a
DNS-rebound name gets no loopback trust, a token never travels in a URL, and the token file stays off `ps`."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from simpletuner.server.app import create_app
SESSION_COOKIE = "simpletuner_session"  # simpletuner.server.auth.SESSION_COOKIE
from tests.server.helpers import LOOPBACK, REMOTE, job_body


@pytest.fixture
def local(settings_factory):
    with TestClient(create_app(settings_factory(run_scheduler=False)), client=LOOPBACK,
                    base_url="http://127.0.0.1:8001") as c:
        yield c


def _queued(c) -> int:
    r = c.post("/api/jobs", json=job_body())
    assert r.status_code == 201, r.text
    return r.json()["id"]


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:3000", "http://localhost:8001"])
def test_a_cross_origin_post_cancels_nothing(local, origin):
    job = _queued(local)
    r = local.post(f"/api/jobs/{job}/cancel", headers={"Origin": origin})
    assert r.status_code == 403
    assert local.get(f"/api/jobs/{job}").json()["status"] == "queued"
    assert local.delete("/api/configs/x", headers={"Origin": origin}).status_code == 403
    assert local.post("/api/jobs", json=job_body(), headers={"Origin": origin}).status_code == 403


def test_the_token_does_not_make_a_cross_origin_post_acceptable(local):
    job = _queued(local)
    r = local.post(f"/api/jobs/{job}/cancel", headers={"Origin": "http://evil.example",
                                                      "Authorization": "Bearer test-token"})
    assert r.status_code == 403


def test_fetch_metadata_cross_site_is_refused_too(local):
    job = _queued(local)  # a form POST from another site that carries no Origin still says Sec-Fetch-Site
    assert local.post(f"/api/jobs/{job}/cancel", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403


def test_same_origin_and_non_browser_clients_still_work(local):
    job = _queued(local)
    assert local.post(f"/api/jobs/{job}/cancel", headers={"Origin": "http://127.0.0.1:8001"}).status_code == 200
    job = _queued(local)
    assert local.post(f"/api/jobs/{job}/cancel").status_code == 200  # curl, the CLI: no Origin


def test_a_dns_rebound_name_gets_no_loopback_trust(settings_factory):
    """evil.example resolves to 127.0.0.1 after the page loaded: the request comes from loopback, but names
    evil.example in its Host header."""
    with TestClient(create_app(settings_factory(run_scheduler=False)), client=LOOPBACK,
                    base_url="http://evil.example:8001") as c:
        assert c.get("/api/jobs").status_code == 401
        assert c.get("/api/jobs", headers={"Authorization": "Bearer test-token"}).status_code == 200
    for host in ("localhost:8001", "[::1]:8001", "127.0.0.1"):
        with TestClient(create_app(settings_factory(run_scheduler=False)), client=LOOPBACK,
                        base_url=f"http://{host}") as c:
            assert c.get("/api/jobs").status_code == 200, host
    with TestClient(create_app(settings_factory(run_scheduler=False, allowed_hosts=["tuner.lan"])), client=LOOPBACK,
                    base_url="http://tuner.lan:8001") as c:
        assert c.get("/api/jobs").status_code == 200


def test_a_cross_site_read_gets_no_loopback_trust(local):
    assert local.get("/api/jobs", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 401
    assert local.get("/api/jobs", headers={"Origin": "http://evil.example"}).status_code == 401


def test_a_token_in_the_url_is_refused(settings_factory):
    with TestClient(create_app(settings_factory(run_scheduler=False)), client=REMOTE) as c:
        r = c.get("/api/jobs?token=test-token")
        assert r.status_code == 400 and "Authorization" in r.json()["detail"]
        assert c.get("/api/stream?token=test-token").status_code == 400


def test_the_ui_session_cookie_stands_for_the_token(settings_factory):
    with TestClient(create_app(settings_factory(run_scheduler=False)), client=REMOTE,
                    base_url="http://tuner.lan:8001") as c:
        assert c.post("/api/session").status_code == 401
        r = c.post("/api/session", headers={"Authorization": "Bearer test-token"})
        assert r.status_code == 204
        cookie = r.cookies.get(SESSION_COOKIE)
        assert cookie and cookie != "test-token"
        set_cookie = r.headers["set-cookie"].lower()
        assert "httponly" in set_cookie and "samesite=strict" in set_cookie
        assert c.get("/api/jobs").status_code == 200  # the cookie, no header: what EventSource and <img> send
        # the cookie is no bearer token, and a wrong cookie is nothing
        c.cookies.clear()
        assert c.get("/api/jobs", headers={"Authorization": f"Bearer {cookie}"}).status_code == 401
        c.cookies.set(SESSION_COOKIE, "forged")
        assert c.get("/api/jobs").status_code == 401
        ended = c.delete("/api/session")
        assert ended.status_code == 204 and 'max-age=0' in ended.headers["set-cookie"].lower()
