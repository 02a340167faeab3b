"""Split training in the web UI, in a real browser against a real server running real tiny-Flux trainers: the queue
form queues a cache job and a train job that trains from its cache; the queue and both job pages show the pair."""

from __future__ import annotations

import pytest

from tests.browser.conftest import shot, tiny_backends, tiny_train_config
from tests.browser.test_webui import until

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


def test_the_queue_runs_a_cache_job_then_a_train_job_from_its_cache(page, server):
    config = tiny_train_config(max_train_steps=4, checkpointing_steps=4, lr_warmup_steps=1, validation_steps=4,
                               validation_prompt="a red square", validation_num_inference_steps=2,
                               validation_resolution="64")
    created = server.http.post("/api/configs", json={"name": "tiny-flux-split", "train_config": config,
                                                     "data_backends": tiny_backends()})
    assert created.status_code == 201, created.text

    page.goto(f"{server.url}/queue")
    page.wait_for_selector("body[data-ready]")
    page.select_option("#submit-config", "tiny-flux-split")
    page.select_option("#submit-split", "split")
    page.click("#submit-button")
    until(page, "document.querySelectorAll('#jobs-body tr[data-job]').length === 2", timeout=30_000)
    jobs = {j["kind"]: j for j in server.http.get("/api/jobs").json()["jobs"]}
    cache, train = jobs["cache"], jobs["train"]
    assert train["depends_on"] == cache["id"]
    train_row = page.locator(f'#jobs-body tr[data-job="{train["id"]}"] .pair')
    cache_row = page.locator(f'#jobs-body tr[data-job="{cache["id"]}"] .pair')
    assert train_row.inner_text() == f"trains from cache job #{cache['id']}"
    assert cache_row.inner_text() == f"cache job · for #{train['id']}"
    shot(page, "split-queue-1280")

    done = server.wait_job(cache["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done
    trained = server.wait_job(train["id"], {"succeeded", "failed"})
    assert trained["status"] == "succeeded", trained
    assert trained["started_at"] >= done["finished_at"]
    detail = server.http.get(f"/api/jobs/{train['id']}").json()
    assert detail["train_config"]["train_from_cache"] is True
    # stage 2 never ran an encoder: every latent and embedding came from the cache job's manifest
    results = trained["results"]
    assert results["text_encoder_forwards"] == 0 and results["vae_forwards"] == 0 and results["lora_path"]
    assert done["results"]["cache_manifest"].endswith("cache/text/cache_manifest.json")

    page.goto(f"{server.url}/jobs/{train['id']}")
    page.wait_for_selector("body[data-ready]")
    link = page.locator("#pair-link a")
    assert link.inner_text() == f"job {cache['id']}"
    link.click()
    page.wait_for_url(f"{server.url}/jobs/{cache['id']}")
    page.wait_for_selector("body[data-ready]")
    until(page, f"document.getElementById('pair-link')?.textContent === 'job {train['id']}'")
    details = page.inner_text("#details")
    assert "cache (split training, stage 1)" in details and "cache_manifest.json" in details
    shot(page, "split-cache-job-1280")
