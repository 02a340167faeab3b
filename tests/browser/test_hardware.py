"""The hardware panel on a server that (thanks to a stand-in nvidia-smi) sees two GPUs: the multi-GPU choice
sets num_processes of the jobs the browser submits. Job submission is intercepted: no GPU job really starts."""

from __future__ import annotations

import json

import pytest

from tests.browser.conftest import Server, shot, tiny_backends, tiny_train_config

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("gpus"), "test_hardware", fake_gpus=2)
    yield srv
    srv.close()


def submitted_processes(page, server) -> int:
    """Submit from the queue page; return the num_processes the browser asked for."""
    bodies = []

    def fake_submit(route):
        if route.request.method != "POST":
            return route.continue_()
        body = json.loads(route.request.post_data)
        bodies.append(body)
        route.fulfill(status=201, content_type="application/json", body=json.dumps({"id": 99, "warnings": []}))

    page.route("**/api/jobs", fake_submit)
    page.goto(f"{server.url}/queue")
    page.wait_for_selector("body[data-ready]")
    page.select_option("#submit-config", "gpu-config")
    page.click("#submit-button")
    page.wait_for_selector(".toast >> text=Queued job 99")
    page.unroute("**/api/jobs")
    assert bodies[0]["config_name"] == "gpu-config"
    return bodies[0]["num_processes"]


def test_multi_gpu_choice_sets_num_processes(page, gpu_server):
    gpu_server.http.post("/api/configs", json={"name": "gpu-config", "train_config": tiny_train_config(),
                                               "data_backends": tiny_backends()}).raise_for_status()
    page.goto(f"{gpu_server.url}/system")
    page.wait_for_selector("body[data-ready]")
    assert page.locator("#accelerators li").all_inner_texts()[0].startswith("GPU 0")
    assert page.locator("#accelerators li").count() == 2
    assert page.is_checked('input[type=radio][value="auto"]')
    assert "2 of 2 GPUs (auto)" in page.inner_text("#gpu-choice")
    shot(page, "hardware-gpus-1280")
    assert submitted_processes(page, gpu_server) == 2

    page.goto(f"{gpu_server.url}/system")
    page.wait_for_selector("body[data-ready]")
    page.check('input[type=radio][value="manual"]')
    page.fill('#gpu-choice input[type=number]', "1")
    assert "1 of 2 GPUs (manual)" in page.inner_text("#gpu-choice")
    assert submitted_processes(page, gpu_server) == 1
    assert "1 of 2 GPUs (manual)" in page.inner_text("#submit-gpus")

    page.goto(f"{gpu_server.url}/system")
    page.wait_for_selector("body[data-ready]")
    page.check('input[type=radio][value="disabled"]')
    assert submitted_processes(page, gpu_server) == 1
    assert "multi-GPU off" in page.inner_text("#submit-gpus")


def test_remote_style_server_asks_for_the_token(page, tmp_path_factory):
    """With --require-token even loopback needs the token: the page asks for it once, then everything works
    (fetch with the Authorization header; EventSource, images and downloads with the session cookie)."""
    srv = Server(tmp_path_factory.mktemp("token"), "test_token", extra_args=("--require-token",), token="s3cret-token")
    urls = []
    page.on("request", lambda req: urls.append(req.url))
    try:
        page.goto(f"{srv.url}/queue")
        page.wait_for_selector("#token-dialog[open]")
        page.fill("#token-input", "s3cret-token")
        page.click('#token-dialog button[value="save"]')
        page.wait_for_selector("body[data-ready]")
        page.wait_for_selector("#live-text:has-text('live')")
        assert "0 jobs" in page.inner_text("#queue-summary")
        assert page.is_visible("#token-button")
        assert not [u for u in urls if "token=" in u]  # the stream authenticates with the session cookie
        shot(page, "token-1280")
    finally:
        page.goto("about:blank")  # close the event stream before its server goes
        srv.close()
    # only the first, token-less calls were refused
    page.errors[:] = [e for e in page.errors if "status of 401" not in e]
