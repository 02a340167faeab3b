"""Each video family's job in a real browser: a tiny LoRA (Wan, LTX-Video, LTX-2, HunyuanVideo) on the sample video dataset,
queued through the API, whose job page shows each validation video as a playable <video> (the mp4 the trainer sent
over the webhook, its first frame as the poster), decoded by Chromium to the expected size and length."""

from __future__ import annotations

import shutil

import pytest

from tests.browser.conftest import shot
from tests.conftest import REPO

pytestmark = [pytest.mark.browser, pytest.mark.e2e]
FPS = 16
# two latent frames of each video family: its VAE's temporal compression + 1
VIDEO_FAMILIES = {"wan": 5, "ltxvideo": 9, "ltxvideo2": 9, "hunyuanvideo": 5}


@pytest.mark.parametrize("family", sorted(VIDEO_FAMILIES))
def test_job_page_plays_the_validation_video(family, page, server):
    frames = VIDEO_FAMILIES[family]
    shutil.copytree(REPO / "datasets" / "sample_video", server.workdir / "datasets" / "sample_video",
                    dirs_exist_ok=True)
    config = {"--model_family": family, "--model_flavour": "tiny", "--model_type": "lora", "--lora_rank": 4,
              "--mixed_precision": "no", "--train_batch_size": 1, "--max_train_steps": 2, "--learning_rate": 1e-3,
              "--seed": 1, "--validation_steps": 2, "--validation_prompt": "a red circle moving left to right",
              "--validation_resolution": "64", "--validation_num_video_frames": frames, "--framerate": FPS,
              "--validation_num_inference_steps": 2, "--validation_guidance": 1.0, "--report_to": "none"}
    backends = [{"id": "clips", "dataset_type": "video", "instance_data_dir": "datasets/sample_video",
                 "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel",
                 "cache_dir_vae": f"cache/vae/{family}", "video": {"num_frames": frames, "frame_rate": 8}},
                {"id": "text-embeds", "dataset_type": "text_embeds", "default": True,
                 "cache_dir": f"cache/text/{family}"}]
    created = server.http.post("/api/configs", json={"name": f"tiny-{family}", "train_config": config,
                                                     "data_backends": backends})
    assert created.status_code == 201, created.text
    job_id = server.http.post("/api/jobs", json={"config_name": f"tiny-{family}"}).json()["id"]

    page.goto(f"{server.url}/jobs/{job_id}")
    page.wait_for_selector("body[data-ready]")
    page.wait_for_selector("body[data-stream-ended]", timeout=240_000)
    assert page.get_attribute("body", "data-status") == "succeeded"
    videos = [e["data"] for e in server.all_events(job_id)
              if e["type"] == "image" and e["data"].get("kind") == "validation"]
    assert videos and all(d.get("video_url", "").endswith(".mp4") and d.get("image_url") for d in videos)

    player = page.locator("#gallery .validation-image video.validation-video")
    assert player.count() == len(videos)
    assert player.first.get_attribute("poster").split("?")[0] == videos[-1]["image_url"]
    assert player.first.get_attribute("controls") is not None
    # Chromium loads and decodes the mp4: its size, and a duration of `frames` frames at FPS
    page.wait_for_function("() => document.querySelector('#gallery video').readyState >= 2", timeout=30_000)
    width, height, duration = player.first.evaluate("v => [v.videoWidth, v.videoHeight, v.duration]")
    assert (width, height) == (64, 64) and abs(duration - frames / FPS) < 1.5 / FPS
    player.first.evaluate("v => v.play()")
    page.wait_for_function("() => document.querySelector('#gallery video').currentTime > 0", timeout=30_000)
    shot(page, f"job-video-{family}-1280")
