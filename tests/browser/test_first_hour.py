"""A user's first hour, in Chromium against a real server: upload a folder of images with captions, see them on the
dataset page, edit a caption, make a config from the tiny preset, run it and download the LoRA (which FluxPipeline
loads), cancel a second job after a checkpoint and Resume it from that step; data problems shown before any job
starts; the API docs with no internet; a config.json imported as SimpleTuner writes it."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.browser.conftest import shot
from tests.conftest import REPO

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


def field(page, path: str):
    return page.locator(f'[data-path="{path}"]').locator("input, select, textarea").first


def until(page, expression: str, **kwargs) -> None:
    page.wait_for_function(f"() => ({expression})", **kwargs)


def answer_dialog(page, yes: bool = True) -> None:
    dialog = page.locator("#confirm-dialog")
    dialog.wait_for(state="visible")
    dialog.locator("#confirm-yes" if yes else "#confirm-no").click()


def loads_in_fluxpipeline(lora_file) -> None:
    """The downloaded file is a diffusers LoRA for the tiny Flux: FluxPipeline loads it and it changes the output."""
    import torch
    from diffusers import FluxPipeline

    from simpletuner.models.base import TextEmbedding
    from simpletuner.models.flux import FluxAdapter
    from tests.helpers import flux_config

    adapter = FluxAdapter(flux_config())
    pipe = FluxPipeline.from_pretrained(adapter.model_path())
    g = torch.Generator().manual_seed(0)
    latents = adapter.encode_images(torch.rand(1, 3, 64, 64, generator=g) * 2 - 1)
    text = TextEmbedding.collate(adapter.encode_prompts(["a photo"]))
    sigma = torch.tensor([0.5])
    with torch.no_grad():
        base = adapter.predict(pipe.transformer, latents, sigma, text)
        pipe.load_lora_weights(str(lora_file))
        tuned = adapter.predict(pipe.transformer, latents, sigma, text)
    assert pipe.get_list_adapters(), "no LoRA adapter loaded"
    assert (tuned - base).abs().max().item() > 1e-6


def test_first_hour(page, server, tmp_path):
    # ---- a dataset from a folder of images with captions ----
    folder = tmp_path / "my-photos"
    shutil.copytree(REPO / "datasets" / "sample", folder)
    page.goto(f"{server.url}/datasets")
    page.wait_for_selector("body[data-ready]")
    page.fill("#dataset-name", "photos")
    page.click("#create-dataset")
    page.wait_for_url("**/datasets/photos")
    page.wait_for_selector("body[data-ready]")
    page.set_input_files("#upload-folder", str(folder))
    page.click("#upload-button")
    until(page, "document.querySelectorAll('#thumbs figure.thumb').length === 12", timeout=30_000)
    assert page.locator("#upload-status").inner_text() == "saved 24, skipped 0"
    assert page.locator('[data-fact="images"]').inner_text() == "12"
    assert page.locator('[data-fact="captioned"]').inner_text().startswith("12 (caption strategy textfile")
    assert page.locator("#buckets tbody tr").count() >= 1
    first = page.locator("#thumbs figure.thumb").first
    name = first.get_attribute("data-path")
    original = (folder / name).with_suffix(".txt").read_text().strip()
    assert first.locator("textarea").input_value() == original
    until(page, "[...document.querySelectorAll('#thumbs img')].every(i => i.complete && i.naturalWidth > 0)")

    # ---- edit a caption in place ----
    first.locator("textarea").fill("a photo of sks shapes")
    first.locator("button", has_text="Save").click()
    until(page, "document.querySelector('#thumbs figure.thumb [role=status]').textContent === 'saved'")
    stored = server.data_dir / "datasets" / "photos" / name
    assert stored.with_suffix(".txt").read_text() == "a photo of sks shapes\n"
    shot(page, "first-hour-dataset")

    # ---- remove an image (asked first) ----
    last = page.locator("#thumbs figure.thumb").last
    gone = last.get_attribute("data-path")
    last.locator("button", has_text="Remove").click()
    answer_dialog(page)
    until(page, "document.querySelectorAll('#thumbs figure.thumb').length === 11")
    until(page, "document.querySelector('[data-fact=images]').textContent === '11'")  # the scan follows
    assert not (server.data_dir / "datasets" / "photos" / gone).exists()

    # ---- a config from the tiny preset ----
    page.click("#new-config-link")
    page.wait_for_selector("body[data-ready]")
    assert page.evaluate("document.body.dataset.preset") == "tiny-cpu-demo"
    assert field(page, "data_backends[photos].instance_data_dir").input_value() == str(server.data_dir / "datasets"
                                                                                       / "photos")
    assert page.locator('label[for] >> text="Training steps"').count() >= 1  # readable labels
    assert field(page, "train_config.lora_dropout").is_hidden()  # basic form: advanced settings hidden
    page.fill("#config-name", "first-lora")
    for key, value in {"max_train_steps": 12, "checkpointing_steps": 6, "validation_steps": 6}.items():
        field(page, f"train_config.{key}").fill(str(value))
    assert page.locator("#dirty-note").inner_text() == "unsaved changes"
    page.locator("#save-button").scroll_into_view_if_needed()
    page.mouse.wheel(0, 4000)
    assert page.locator("#save-button").is_visible()  # the actions stay in view
    page.click("#queue-button")
    page.wait_for_url("**/jobs/*")
    job_id = int(page.url.rsplit("/", 1)[1])
    page.wait_for_selector("body[data-ready]")

    # ---- run: start-up stages, then steps; download the LoRA ----
    until(page, "document.querySelectorAll('#activity li[data-type=status]').length > 0", timeout=120_000)
    server.wait_job(job_id, {"succeeded"}, timeout=300)
    until(page, "document.body.dataset.status === 'succeeded'", timeout=30_000)
    stages = [e["data"].get("stage") for e in server.all_events(job_id)
              if e["type"] == "status" and e["data"].get("status") == "starting"]
    assert "caching VAE latents" in stages and "loading the model" in stages
    button = page.locator("#download-lora")
    until(page, "!document.getElementById('download-lora').hidden", timeout=30_000)
    assert button.inner_text() == "Download LoRA"
    with page.expect_download() as info:
        button.click()
    lora = tmp_path / "downloaded.safetensors"
    info.value.save_as(lora)
    loads_in_fluxpipeline(lora)
    # a LoRA for every checkpoint
    until(page, "document.querySelectorAll('#checkpoints a[data-lora]').length === 2", timeout=30_000)

    # ---- the lightbox: prompt, step and seed ----
    until(page, "document.querySelectorAll('#gallery figure.validation-image img').length > 0")
    page.locator("#gallery figure.validation-image img").first.click()
    page.locator("#lightbox").wait_for(state="visible")
    assert page.locator('#lightbox [data-fact="prompt"]').inner_text() == "a photo"
    assert page.locator('#lightbox [data-fact="step"]').inner_text() in ("6", "12")
    assert page.locator('#lightbox [data-fact="seed"]').inner_text() == "1"
    shot(page, "first-hour-lightbox", full_page=False)
    page.click("#lightbox-close")

    # the loss chart fits a 420 px window: no tick label past the chart's edge
    page.set_viewport_size({"width": 420, "height": 800})
    page.wait_for_timeout(300)
    clipped = page.evaluate("""(() => [...document.querySelectorAll('#loss-chart svg text')].filter(t => {
        const b = t.getBBox(), w = t.ownerSVGElement.viewBox.baseVal.width;
        return b.x < 0 || b.x + b.width > w + 0.5; }).map(t => t.textContent))()""")
    assert clipped == []
    page.set_viewport_size({"width": 1280, "height": 800})

    # ---- a second, longer job: cancelled after a checkpoint, then resumed from it ----
    page.goto(f"{server.url}/configs/first-lora")
    page.wait_for_selector("body[data-ready]")
    field(page, "train_config.max_train_steps").fill("20000")  # cancelled long before its end
    field(page, "train_config.checkpointing_steps").fill("5")
    field(page, "train_config.validation_steps").fill("20000")
    page.click("#queue-button")
    page.wait_for_url("**/jobs/*")
    second = int(page.url.rsplit("/", 1)[1])
    assert second != job_id
    page.wait_for_selector("body[data-ready]")
    until(page, "document.querySelector('#checkpoints li[data-step]') !== null", timeout=180_000)
    page.click("#cancel-button")
    answer_dialog(page, yes=False)  # asked first: "No" keeps it running
    assert server.http.get(f"/api/jobs/{second}").json()["status"] == "running"
    page.click("#cancel-button")
    answer_dialog(page)
    cancelled = server.wait_job(second, {"cancelled"}, timeout=120)
    step = cancelled["results"]["last_checkpoint_step"]
    assert step >= 5 and step % 5 == 0
    until(page, "!document.getElementById('resume-button').hidden", timeout=30_000)
    assert page.locator("#resume-button").inner_text() == f"Resume from step {step}"
    assert page.locator("#retry-button").is_visible()
    page.click("#resume-button")
    page.wait_for_selector("body[data-ready]")
    server.wait_job(second, {"running"}, timeout=60)

    def resumed_progress():
        return [e["data"]["step"] for e in server.all_events(second) if e["type"] == "progress" and e["attempt"] == 2]

    import time
    deadline = time.time() + 180
    while not resumed_progress() and time.time() < deadline:
        time.sleep(1)
    steps = resumed_progress()
    assert steps and steps[0] == step + 1, (step, steps[:5])
    job_events = [e["data"] for e in server.all_events(second) if e["type"] == "job" and e["attempt"] == 2]
    assert any(d.get("resumes_from_step") == step for d in job_events)
    page.click("#cancel-button")
    answer_dialog(page)
    server.wait_job(second, {"cancelled"}, timeout=120)


def test_data_problems_show_before_any_job_starts(page, server):
    """A missing folder, images without captions and images too small: each shown at its field when validating
    in the editor, and nothing is queued."""
    uncaptioned = server.workdir / "uncaptioned"
    uncaptioned.mkdir(exist_ok=True)
    for p in sorted((REPO / "datasets" / "sample").glob("*.png"))[:2]:
        shutil.copy(p, uncaptioned / p.name)
    page.goto(f"{server.url}/configs/new?preset=tiny-cpu-demo")
    page.wait_for_selector("body[data-ready]")
    page.fill("#config-name", "problems")
    folder = field(page, "data_backends[my-images].instance_data_dir")

    folder.fill("datasets/nowhere")
    page.click("#validate-button")
    err = page.locator('[data-path="data_backends[my-images].instance_data_dir"] .err')
    err.wait_for(state="visible")
    assert "does not exist" in err.inner_text()

    folder.fill("uncaptioned")
    field(page, "data_backends[my-images].caption_strategy").select_option("textfile")
    page.click("#validate-button")
    err = page.locator('[data-path="data_backends[my-images].caption_strategy"] .err')
    err.wait_for(state="visible")
    assert "2 of 2 file(s) have no .txt caption" in err.inner_text()

    folder.fill("datasets/sample")
    page.click("#mode-button")  # minimum_image_size is an advanced setting
    field(page, "data_backends[my-images].minimum_image_size").fill("4096")
    page.click("#validate-button")
    err = page.locator('[data-path="data_backends[my-images].minimum_image_size"] .err')
    err.wait_for(state="visible")
    assert "all 12 image(s) are smaller than 4096" in err.inner_text()
    assert "problem" in page.locator("#error-title").inner_text()
    page.click("#queue-button")  # Save and queue refuses it too
    page.wait_for_timeout(500)
    assert "/configs/new" in page.url
    assert server.http.get("/api/jobs").json()["total"] == 0 or all(
        j["config_name"] != "problems" for j in server.http.get("/api/jobs").json()["jobs"])
    page.on("dialog", lambda d: d.accept())  # the unsaved-changes prompt on leaving


def test_unsaved_changes_prompt_and_import(page, server, tmp_path):
    page.goto(f"{server.url}/configs/new")
    page.wait_for_selector("body[data-ready]")
    # import config.json + multidatabackend.json as SimpleTuner writes them
    config = json.loads((REPO / "config" / "config.json").read_text())
    backends = json.loads((REPO / "config" / "multidatabackend.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "multidatabackend.json").write_text(json.dumps(backends))
    page.set_input_files("#import-files", [str(tmp_path / "config.json"), str(tmp_path / "multidatabackend.json")])
    page.locator("#ok-summary").wait_for(state="visible")
    assert "valid" in page.locator("#ok-summary").inner_text()
    assert field(page, "data_backends[sample].instance_data_dir").input_value() == "datasets/sample"
    # validate's data summary, as the CLI prints it
    assert page.locator("#data-summary li").first.inner_text().startswith("datasets[sample] (image): 12 images")
    # a bare config.json naming its data_backend_config (config/multidatabackend.json in the server's working
    # dir, as in a SimpleTuner checkout): that file is read, not a placeholder dataset
    (server.workdir / "config").mkdir(exist_ok=True)
    shutil.copy(REPO / "config" / "multidatabackend.json", server.workdir / "config" / "multidatabackend.json")
    page.goto(f"{server.url}/configs/new")
    seen = []
    page.on("dialog", lambda d: (seen.append(d.type), d.accept()))
    page.wait_for_selector("body[data-ready]")
    page.set_input_files("#import-files", str(REPO / "config" / "config.json"))
    page.locator("#ok-summary").wait_for(state="visible")
    assert page.locator("#backends .backend-card").count() == 0
    page.fill("#config-name", "imported")
    assert page.evaluate("document.body.dataset.dirty") == "true"
    page.goto(f"{server.url}/queue")  # leaving with unsaved changes asks first
    assert seen == ["beforeunload"]


def test_api_docs_work_offline(page, server):
    blocked = []

    def only_local(route):
        if route.request.url.startswith(server.url):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    page.route("**/*", only_local)
    page.goto(f"{server.url}/queue")
    page.click("nav >> text=API")
    page.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
    assert "SimpleTuner server" in page.locator(".swagger-ui .info .title").inner_text()
    assert page.locator(".opblock-tag", has_text="datasets").count() == 1
    assert blocked == []


def test_allowing_a_folder(page, server, tmp_path):
    """A folder outside the allowed roots is refused with how to allow it; one inside is used as it is."""
    page.goto(f"{server.url}/datasets")
    page.wait_for_selector("body[data-ready]")
    page.fill("#dataset-name", "elsewhere")
    page.fill("#dataset-path", str(tmp_path))
    page.click("#create-dataset")
    err = page.locator('[data-path="path"] .err')
    err.wait_for(state="visible")
    assert f"--allowed-root {tmp_path}" in err.inner_text()
    # the refusal is the API's 422, which Chromium also logs; nothing else may have gone wrong
    page.errors[:] = [e for e in page.errors if "status of 422" not in e or "/api/datasets'" not in e]
    page.fill("#dataset-name", "sample")
    page.fill("#dataset-path", "datasets/sample")
    page.click("#create-dataset")
    page.wait_for_url("**/datasets/sample")
    page.wait_for_selector("body[data-ready]")
    assert page.locator("#thumbs figure.thumb").count() == 12
    assert "(your folder)" in page.locator("#dataset-sub").inner_text()
