"""The UI's routes without a browser: pages, static files, the schema routes, headers, and the import boundary."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from simpletuner.server.app import create_app
from tests.server.helpers import LOOPBACK, REMOTE, make_settings

PAGES = ["/queue", "/configs", "/configs/new", "/configs/tiny-flux", "/jobs/1", "/system"]


@pytest.fixture
def ui(tmp_path):
    app = create_app(make_settings(tmp_path, tmp_path, run_scheduler=False))
    with TestClient(app, client=LOOPBACK, base_url="http://127.0.0.1") as c:
        yield c


@pytest.mark.parametrize("path", PAGES)
def test_pages_are_html_shells_with_their_script(ui, path):
    r = ui.get(path)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert '<script type="module" src="/static/js/' in r.text
    assert "<script>" not in r.text  # nothing inline: the CSP would block it
    assert 'href="/static/css/app.css' in r.text


def test_root_redirects_to_the_queue_and_static_files_are_served(ui):
    r = ui.get("/", follow_redirects=False)
    assert r.status_code in (302, 307) and r.headers["location"] == "/queue"
    js = ui.get("/static/js/job.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert ui.get("/static/css/app.css").headers["content-type"].startswith("text/css")
    assert ui.get("/favicon.ico").headers["content-type"] == "image/svg+xml"
    assert ui.get("/static/../app.py").status_code == 404


def test_every_page_script_import_exists(ui):
    import re

    from simpletuner.server.routes.ui import STATIC

    for script in (STATIC / "js").glob("*.js"):
        for name in re.findall(r'from "\./([\w.]+)"', script.read_text()):
            assert (STATIC / "js" / name).exists(), f"{script.name} imports missing {name}"


def test_page_names_are_escaped(ui):
    r = ui.get("/configs/a.b-c_d")
    assert 'data-config-name="a.b-c_d"' in r.text
    bad = ui.get("/configs/<script>")  # not a config name: the not-found page, with the name escaped
    assert bad.status_code == 404 and "&#39;&lt;script&gt;&#39;" in bad.text and "<script>'" not in bad.text
    from simpletuner.server.routes.ui import _templates

    html = _templates().get_template("queue.html").render(title="<b>x</b>", page="queue", version="1")
    assert "&lt;b&gt;x&lt;/b&gt;" in html and "<b>x</b>" not in html


def test_train_config_schema_groups_every_field(ui):
    body = ui.get("/api/schema/train-config").json()
    groups = [g["id"] for g in body["groups"]]
    assert groups[:7] == ["model", "training", "lora", "memory", "tread", "validation", "logging"]
    props = body["schema"]["properties"]
    assert {p["group"] for p in props.values()} <= set(groups)
    assert all(p.get("description") for p in props.values())
    assert "TreadRoute" in body["schema"]["$defs"]


def test_data_backend_schemas(ui):
    body = ui.get("/api/schema/data-backends").json()
    assert "instance_data_dir" in body["dataset"]["properties"]
    assert "cache_dir" in body["text_embeds"]["properties"]


def test_schema_routes_need_the_token_off_loopback(tmp_path):
    app = create_app(make_settings(tmp_path, tmp_path, run_scheduler=False))
    with TestClient(app, client=REMOTE) as c:
        assert c.get("/api/schema/train-config").status_code == 401
        headers = {"Authorization": "Bearer test-token"}
        assert c.get("/api/schema/train-config", headers=headers).status_code == 200
        assert c.get("/queue").status_code == 200  # the page shell holds no data; its API calls send the token


def test_serving_the_ui_imports_no_torch(tmp_path):
    code = f"""
import sys
from fastapi.testclient import TestClient
from simpletuner.server.app import create_app
from simpletuner.server.settings import ServerSettings
app = create_app(ServerSettings(data_dir={str(tmp_path)!r}, workdir={str(tmp_path)!r}, run_scheduler=False, token="t"))
with TestClient(app, client=("127.0.0.1", 50000), base_url="http://127.0.0.1") as c:
    for path in {PAGES!r} + ["/api/schema/train-config", "/api/schema/data-backends", "/static/js/form.js"]:
        assert c.get(path).status_code == 200, path
assert "torch" not in sys.modules, "torch was imported"
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("path", ["/jobs/abc", "/jobs/0", "/configs/..%2Fetc", "/no-such-page"])
def test_bad_page_urls_get_an_html_not_found_page(ui, path):
    r = ui.get(path, headers={"accept": "text/html"})
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("text/html")
    assert "Not found" in r.text and 'href="/queue"' in r.text
    assert "/static/js/?" not in r.text  # a page without a script names none


def test_api_clients_keep_json_errors(ui):
    r = ui.get("/api/no-such-route", headers={"accept": "text/html"})
    assert r.status_code == 404 and r.json()["detail"] == "Not Found"
    assert ui.get("/no-such-page").headers["content-type"].startswith("application/json")
