"""The web UI in a real browser: build a tiny-Flux config in the form (a server validation error shown at its
input, then fixed), queue it, watch it train to the end; reload a job page mid-run without losing events;
manage configs; reach the controls by keyboard; fit a narrow window."""

from __future__ import annotations

import re

import pytest

from tests.browser.conftest import shot, tiny_backends, tiny_train_config

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


def field(page, path: str):
    """The input of the generated form field with this server-side path."""
    return page.locator(f'[data-path="{path}"]').locator("input, select, textarea").first


def show_advanced(page) -> None:
    """The editor opens on the basic form; these tests set advanced settings too."""
    if page.get_attribute("#mode-button", "aria-pressed") != "true":
        page.click("#mode-button")


def until(page, expression: str, **kwargs) -> None:
    """Wait until the JavaScript expression is true (as a function: the pages' CSP forbids eval of strings)."""
    page.wait_for_function(f"() => ({expression})", **kwargs)


def sideways_overflow(page) -> list[str]:
    """Elements reaching past the right edge of the window (empty when the page does not scroll sideways)."""
    return page.evaluate("""(() => {
        if (document.documentElement.scrollWidth <= window.innerWidth + 1) return [];
        return [...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > window.innerWidth + 1)
            .map(e => `${e.tagName.toLowerCase()}#${e.id}.${e.className}`).slice(0, 20);
    })()""")


def validation_images(server, job_id: int) -> list[dict]:
    return [e for e in server.all_events(job_id)
            if e["type"] == "image" and (e["data"] or {}).get("kind", "validation") != "preview"]


def test_form_to_finished_job(page, server):
    page.goto(f"{server.url}/configs/new")
    page.wait_for_selector("body[data-ready]")
    show_advanced(page)
    page.fill("#config-name", "tiny-flux")
    page.fill("#config-description", "made in the browser test")
    field(page, "train_config.model_family").select_option("flux")
    field(page, "train_config.model_flavour").select_option("tiny")
    field(page, "train_config.mixed_precision").select_option("no")
    for path, value in {"max_train_steps": 12, "checkpointing_steps": 6, "lr_warmup_steps": 2, "seed": 42,
                        "train_batch_size": 2, "learning_rate": -1, "lora_rank": 8, "lora_alpha": 8,
                        "flow_schedule_shift": 1, "validation_steps": 6, "validation_prompt": "a red square",
                        "validation_num_inference_steps": 2, "validation_resolution": "64", "validation_seed": 3,
                        "validation_preview_steps": 1, "eval_steps_interval": 6}.items():
        field(page, f"train_config.{path}").fill(str(value))
    field(page, "train_config.validation_preview").check()
    field(page, "train_config.evaluation_type").select_option("clip")
    page.click("#add-prompt")
    page.fill("#lib-nick-0", "circle")
    page.fill("#lib-prompt-0", "an orange circle")

    # the dataset: renamed, its folder picked in the folder browser, a bad resolution
    field(page, "data_backends[my-dataset].id").fill("sample")
    page.locator('[data-path="data_backends[sample].instance_data_dir"] button').click()
    dialog = page.locator("#browse-dialog")
    dialog.wait_for(state="visible")
    dialog.locator('#browse-list button[data-path$="/datasets"]').click()
    dialog.locator('#browse-list button[data-path$="/datasets/sample"]').click()
    until(page, "document.getElementById('browse-path').textContent.endsWith('/datasets/sample')")
    dialog.locator("#browse-choose").click()
    assert field(page, "data_backends[sample].instance_data_dir").input_value().endswith("/datasets/sample")
    until(page, "document.querySelector('.backend-card .scan').textContent.includes('12 images')")
    field(page, "data_backends[sample].caption_strategy").select_option("textfile")
    field(page, "data_backends[sample].resolution").fill("-3")
    field(page, "data_backends[sample].resolution_type").select_option("pixel")
    field(page, "data_backends[sample].cache_dir_vae").fill("cache/vae/sample")
    # a held-out set for eval loss
    page.click("#add-dataset")
    field(page, "data_backends[my-dataset-2].id").fill("held-out")
    field(page, "data_backends[held-out].dataset_type").select_option("eval")
    field(page, "data_backends[held-out].instance_data_dir").fill("datasets/held-out")
    field(page, "data_backends[held-out].caption_strategy").select_option("textfile")
    field(page, "data_backends[held-out].resolution").fill("64")
    field(page, "data_backends[held-out].resolution_type").select_option("pixel")
    field(page, "data_backends[held-out].cache_dir_vae").fill("cache/vae/held-out")

    # save: the server refuses, and each error shows at its own input
    page.click("#save-button")
    summary = page.locator("#error-summary")
    summary.wait_for(state="visible")
    lr = page.locator('[data-path="train_config.learning_rate"]')
    assert "must be > 0" in lr.locator(".err").inner_text()
    assert field(page, "train_config.learning_rate").get_attribute("aria-invalid") == "true"
    res = page.locator('[data-path="data_backends[sample].resolution"]')
    assert "must be > 0" in res.locator(".err").inner_text()
    assert "2 problems" in summary.inner_text()
    assert page.evaluate("document.activeElement.closest('[data-path]').dataset.path") == "train_config.learning_rate"
    shot(page, "config-error-1280")
    shot(page, "config-error-at-input-1280", full_page=False)  # the focused input, scrolled into view
    assert page.evaluate("fetch('/api/configs').then(r => r.json()).then(l => l.length)") == 0

    # fixed, saved and queued
    field(page, "train_config.learning_rate").fill("3e-3")
    field(page, "data_backends[sample].resolution").fill("64")
    page.click("#queue-button")
    page.wait_for_url(re.compile(r"/jobs/\d+$"), timeout=30_000)
    job_id = int(page.url.rsplit("/", 1)[1])
    page.wait_for_selector("body[data-ready]")

    # progress bar and loss chart move
    until(page, "Number(document.getElementById('loss-chart').dataset.points || 0) >= 2", timeout=180_000)
    first = int(page.get_attribute("[role=progressbar]", "aria-valuenow"))
    first_points = int(page.get_attribute("#loss-chart", "data-points"))
    until(page, f"Number(document.querySelector('[role=progressbar]').getAttribute('aria-valuenow')) > {first}",
                           timeout=120_000)
    until(page, f"Number(document.getElementById('loss-chart').dataset.points) > {first_points}")
    assert page.locator("#loss-chart svg path").count() >= 2  # loss and learning-rate lines
    shot(page, "job-running-1280")

    # to the end
    page.wait_for_selector('body[data-status="succeeded"]', timeout=240_000)
    page.wait_for_selector("body[data-stream-ended]", timeout=30_000)
    assert page.get_attribute("[role=progressbar]", "aria-valuenow") == "100"
    assert page.inner_text("#stat-step") == "12 / 12"
    until(page, "document.querySelectorAll('#checkpoints li[data-step]').length >= 1")
    until(page, "document.getElementById('artefacts').textContent.includes('pytorch_lora_weights.safetensors')")
    until(page, "document.getElementById('log').textContent.includes('Training')")
    link = page.locator("#artefacts a", has_text="pytorch_lora_weights.safetensors").first
    assert page.evaluate(f"fetch({link.get_attribute('href')!r}).then(r => r.status)") == 200

    # validation images (two prompts at steps 6 and 12): every one the server stored is in the gallery, and loads
    images = validation_images(server, job_id)
    assert sorted({(e["data"]["step"], e["data"]["nickname"]) for e in images}) == [
        (6, "circle"), (6, "validation"), (12, "circle"), (12, "validation")]
    gallery = page.locator("#gallery .validation-image img")
    assert gallery.count() == len(images)
    assert page.locator("#gallery .gallery-step h3").all_inner_texts() == ["Step 12", "Step 6"]
    page.select_option("#gallery-prompt", "circle")
    assert page.locator("#gallery .validation-image:visible").count() == 2
    page.select_option("#gallery-prompt", "")
    # live previews: the latest denoising state per prompt
    assert page.locator("#previews .preview-image img").count() == 2
    # CLIP score and eval loss charts
    for group in ("clip_score", "eval"):
        assert int(page.get_attribute(f'[data-metric="{group}"]', "data-points")) >= 2, group
    for i in range(gallery.count()):
        gallery.nth(i).scroll_into_view_if_needed()
        page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=gallery.nth(i).element_handle())
    shot(page, "job-finished-1280")

    page.set_viewport_size({"width": 420, "height": 800})
    page.wait_for_timeout(200)
    assert not sideways_overflow(page)
    shot(page, "job-finished-420")


def test_queue_and_reload_mid_run_misses_no_events(page, server):
    created = server.http.post("/api/configs", json={"name": "tiny-flux-api", "train_config": tiny_train_config(max_train_steps=60),
                                                     "data_backends": tiny_backends()})
    assert created.status_code == 201, created.text

    # submitted from the queue page, whose row follows the job live
    page.goto(f"{server.url}/queue")
    page.wait_for_selector("body[data-ready]")
    page.select_option("#submit-config", "tiny-flux-api")
    page.fill("#submit-name", "reload-me")
    page.click("#submit-button")
    row = page.locator("tr[data-job]", has_text="reload-me")
    row.wait_for()
    job_id = int(row.get_attribute("data-job"))
    until(page, f"""Number(document.querySelector('tr[data-job="{job_id}"] [role=progressbar]')
        ?.getAttribute('aria-valuenow')) > 0""", timeout=180_000)
    assert row.locator(".status").inner_text().lower() == "running"
    shot(page, "queue-running-1280")

    page.click(f'tr[data-job="{job_id}"] a[href="/jobs/{job_id}"]')
    page.wait_for_selector("body[data-ready]")
    until(page, "Number(document.getElementById('loss-chart').dataset.points || 0) >= 6", timeout=180_000)
    before = int(page.get_attribute("#event-count", "data-count"))

    page.reload()
    page.wait_for_selector("body[data-ready]")
    status = server.http.get(f"/api/jobs/{job_id}").json()
    assert status["status"] == "running" and status["progress"]["step"] < 60, "the reload should happen mid-run"
    # straight after the reload the replay already holds everything seen before it
    until(page, f"Number(document.getElementById('event-count').dataset.count) >= {before}")

    page.wait_for_selector("body[data-stream-ended]", timeout=240_000)
    events = server.all_events(job_id)
    assert int(page.get_attribute("#event-count", "data-count")) == len(events)
    assert int(page.get_attribute("#event-count", "data-last-id")) == events[-1]["id"]
    progress_steps = {e["data"]["step"] for e in events if e["type"] == "progress"}
    assert progress_steps == set(range(1, 61))
    assert int(page.get_attribute("#loss-chart", "data-points")) == 2 * len(progress_steps)
    stages = [e["data"].get("stage") for e in events if e["type"] == "status" and e["data"].get("status") == "starting"]
    repeated = sum(1 for a, b in zip(stages, stages[1:]) if a == b)  # "caching N/M" updates: one line per stage
    assert page.locator("#activity li").count() == sum(1 for e in events if e["type"] not in ("progress",)
                                                      and not (e["type"] == "image" and e["data"].get("kind") == "preview")
                                                      ) - repeated
    shot(page, "job-reloaded-1280")

    # back on the queue: filter, retry, cancel
    page.goto(f"{server.url}/queue")
    page.wait_for_selector("body[data-ready]")
    page.click('#filters button[data-status="succeeded"]')
    succeeded = server.http.get("/api/jobs", params={"status": "succeeded"}).json()["total"]
    until(page, f"document.querySelectorAll('#jobs-body tr[data-job]').length === {succeeded}")
    assert set(page.locator("#jobs-body tr[data-job]").evaluate_all("rows => rows.map(r => r.dataset.status)")) == {"succeeded"}
    page.click('#filters button[data-status=""]')
    total = server.http.get("/api/jobs").json()["total"]
    assert page.locator(f'[aria-label^="Resume job {job_id}"]').count() == 0  # it finished: nothing to resume
    page.click(f'[aria-label="Retry job {job_id} from the start"]')
    # Retry puts the same job back in the queue, to run again from step 0 (its output kept aside)
    page.wait_for_selector(f'tr[data-job="{job_id}"][data-status="queued"], tr[data-job="{job_id}"][data-status="running"]')
    page.click(f'[aria-label="Cancel job {job_id}"]')
    page.locator("#confirm-dialog #confirm-yes").click()  # Cancel asks first
    page.wait_for_selector(f'tr[data-job="{job_id}"][data-status="cancelled"]', timeout=60_000)
    again = server.http.get(f"/api/jobs/{job_id}").json()
    assert again["status"] == "cancelled" and again["attempt"] == 2
    assert server.http.get("/api/jobs").json()["total"] == total  # no new job: the same one, attempt 2
    requeued = [e for e in server.all_events(job_id) if e["type"] == "job" and e["data"]["status"] == "queued"]
    assert requeued[-1]["data"]["start_over"] is True
    shot(page, "queue-1280")


def test_job_page_resumes_after_the_server_restarts(page, server):
    server.http.post("/api/configs", json={"name": "tiny-flux-restart", "train_config": tiny_train_config(max_train_steps=60),
                                           "data_backends": tiny_backends()}).raise_for_status()
    job_id = server.http.post("/api/jobs", json={"config_name": "tiny-flux-restart"}).json()["id"]
    page.goto(f"{server.url}/jobs/{job_id}")
    page.wait_for_selector("body[data-ready]")
    until(page, "Number(document.getElementById('loss-chart').dataset.points || 0) >= 4", timeout=180_000)
    seen = int(page.get_attribute("#event-count", "data-last-id"))

    server.crash_and_restart()  # the page's stream drops; EventSource reconnects with Last-Event-ID
    assert server.http.get(f"/api/jobs/{job_id}").json()["status"] == "running"  # adopted by the new server
    page.wait_for_selector("body[data-stream-ended]", timeout=240_000)
    events = server.all_events(job_id)
    assert any(e["type"] == "job" and e["data"].get("adopted") for e in events)
    assert events[-1]["id"] > seen
    assert int(page.get_attribute("#event-count", "data-count")) == len(events)
    assert int(page.get_attribute("#event-count", "data-last-id")) == events[-1]["id"]
    assert {e["data"]["step"] for e in events if e["type"] == "progress"} == set(range(1, 61))
    assert page.get_attribute("body", "data-status") == "succeeded"
    # while the server was down, the reconnect attempts and log polls failed; nothing else may have
    expected = ("ERR_CONNECTION_REFUSED", "ERR_EMPTY_RESPONSE", "ERR_INCOMPLETE_CHUNKED_ENCODING", "ERR_CONNECTION_RESET")
    page.errors[:] = [e for e in page.errors if not any(x in e for x in expected)]


def test_resume_button_continues_a_crashed_run_from_its_checkpoint(page, server):
    """The trainer dies (kill -9) mid-run; the job page's Resume continues the same run from its newest checkpoint
    instead of step 0."""
    import os
    import signal
    import time

    server.http.post("/api/configs", json={"name": "tiny-flux-crash", "data_backends": tiny_backends(),
                                           "train_config": tiny_train_config(max_train_steps=30)}).raise_for_status()
    job_id = server.http.post("/api/jobs", json={"config_name": "tiny-flux-crash"}).json()["id"]
    page.goto(f"{server.url}/jobs/{job_id}")
    page.wait_for_selector("body[data-ready]")
    deadline = time.time() + 180
    while True:  # past the first checkpoint (every 6 steps)
        job = server.http.get(f"/api/jobs/{job_id}").json()
        if (job["results"] or {}).get("last_checkpoint") and (job["progress"] or {}).get("step", 0) >= 7:
            break
        assert job["status"] == "running" and time.time() < deadline, job
        time.sleep(0.05)
    os.killpg(job["pid"], signal.SIGKILL)
    page.wait_for_selector("body[data-status=failed]", timeout=60_000)
    page.wait_for_selector("#resume-button:not([hidden])")
    assert page.is_visible("#retry-button")  # Retry (from step 0) beside Resume
    page.click("#resume-button")
    page.wait_for_selector("body[data-status=succeeded]", timeout=240_000)
    events = server.all_events(job_id)
    job = server.http.get(f"/api/jobs/{job_id}").json()
    assert job["attempt"] == 2 and job["results"]["steps"] == 30
    first = [e["data"]["step"] for e in events if e["type"] == "progress" and e["attempt"] == 1]
    saved = max(e["data"]["step"] for e in events if e["type"] == "checkpoint" and e["attempt"] == 1)
    second = [e["data"]["step"] for e in events if e["type"] == "progress" and e["attempt"] == 2]
    assert second == list(range(saved + 1, 31))  # resumed from its newest checkpoint, not from step 0
    assert saved >= 6 and max(first) - saved <= 6  # at most one checkpoint interval was lost
    shot(page, "job-retried-1280")


def test_configs_list_duplicate_raw_json_and_delete(page, server):
    server.http.post("/api/configs", json={"name": "to-copy", "train_config": tiny_train_config(), "data_backends": tiny_backends()})
    page.goto(f"{server.url}/configs")
    page.wait_for_selector("body[data-ready]")
    page.click('[aria-label="Duplicate to-copy"]')
    page.wait_for_selector("body[data-ready]")
    assert page.input_value("#config-name") == "to-copy-copy"
    assert field(page, "train_config.max_train_steps").input_value() == "12"  # "--max_train_steps" read into the form

    # the raw JSON view: edit, apply, and the form follows
    page.click("#sec-raw > summary")
    raw = page.locator("#raw-json")
    text = raw.input_value().replace('"max_train_steps": 12', '"max_train_steps": 7')
    raw.fill(text)
    page.click("#raw-apply")
    assert field(page, "train_config.max_train_steps").input_value() == "7"
    raw.fill("{not json")
    page.click("#raw-apply")
    assert "not valid JSON" in page.inner_text("#raw-err")

    page.click("#save-button")
    page.wait_for_selector("#ok-summary:not([hidden])")
    assert page.url.endswith("/configs/to-copy-copy")
    saved = server.http.get("/api/configs/to-copy-copy").json()
    assert saved["latest"]["train_config"]["max_train_steps"] == 7
    assert "--max_train_steps" not in saved["latest"]["train_config"]  # one spelling per key

    # editing a stored config adds a version
    field(page, "train_config.lora_rank").fill("4")
    page.fill("#config-comment", "smaller rank")
    page.click("#save-button")
    page.wait_for_selector("#ok-summary:has-text('version 2')")
    versions = server.http.get("/api/configs/to-copy-copy/versions").json()
    assert [v["version"] for v in versions] == [2, 1] and versions[0]["comment"] == "smaller rank"
    assert server.http.get("/api/configs/to-copy-copy").json()["latest"]["train_config"]["lora_rank"] == 4

    page.goto(f"{server.url}/configs")
    page.wait_for_selector('tr[data-config="to-copy-copy"]')
    page.click('[aria-label="Delete to-copy-copy"]')
    page.click('#delete-dialog button[value="delete"]')
    page.wait_for_selector('tr[data-config="to-copy-copy"]', state="detached")
    assert server.http.get("/api/configs/to-copy-copy").status_code == 404
    shot(page, "configs-1280")


def test_keyboard_and_narrow_window(page, server):
    page.goto(f"{server.url}/queue")
    page.wait_for_selector("body[data-ready]")
    reached = []
    for _ in range(40):
        page.keyboard.press("Tab")
        reached.append(page.evaluate(
            "(() => { const a = document.activeElement; return `${a.tagName.toLowerCase()}#${a.id}|${a.textContent.trim()}` })()"))
    joined = "\n".join(reached)
    for wanted in ("a#|Queue", "a#|Configs", "a#|Hardware", "select#submit-config", "button#submit-button|Queue job",
                   "button#|Running"):
        assert wanted in joined, f"Tab never reached {wanted}:\n{joined}"
    for url in ("/queue", "/configs", "/configs/new", "/system"):
        page.goto(f"{server.url}{url}")
        page.wait_for_selector("body[data-ready]")
        unlabeled = page.evaluate("""[...document.querySelectorAll('button, a[href]')]
            .filter(b => !(b.textContent.trim() || b.getAttribute('aria-label'))).map(b => b.outerHTML)""")
        assert not unlabeled, f"{url}: controls without a label: {unlabeled}"
    page.goto(f"{server.url}/system")
    page.wait_for_selector("body[data-ready]")
    assert page.locator("input[type=radio]").count() == 3  # auto / manual / disabled
    shot(page, "hardware-1280")

    page.set_viewport_size({"width": 420, "height": 800})
    for url, name in (("/queue", "queue-420"), ("/configs/new", "config-new-420"), ("/system", "hardware-420")):
        page.goto(f"{server.url}{url}")
        page.wait_for_selector("body[data-ready]")
        assert not sideways_overflow(page), f"{url} scrolls sideways at 420px"
        shot(page, name)


def test_family_options_follow_the_family_table(page, server):
    """The form offers each family's own flavours, LoRA presets and objectives (from /api/system/model-families),
    not every value any family takes."""
    families = server.http.get("/api/system/model-families").json()
    page.goto(f"{server.url}/configs/new")
    page.wait_for_selector("body[data-ready]")
    show_advanced(page)

    def options(key):
        return [o for o in field(page, f"train_config.{key}").locator("option").all_inner_texts()
                if not o.startswith(("default", "—"))]

    assert "epsilon" in options("prediction_type")  # no family chosen: everything the schema allows
    field(page, "train_config.model_family").select_option("flux")
    assert options("model_flavour") == families["flux"]["flavours"]
    assert options("lora_target") == families["flux"]["lora_targets"]
    assert options("prediction_type") == families["flux"]["objectives"] == ["flow_matching"]
