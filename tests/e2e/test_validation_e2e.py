"""A tiny-Flux CLI run with validation, live previews, CLIP score, eval loss, webhooks, wandb and TensorBoard.

One run (10 steps; validation at startup and every 5 steps with 4 inference steps and a preview every 2; eval loss
every 5 steps; report_to all with wandb offline) posts its events to a stdlib HTTP receiver standing in for the
server. A second run with everything evaluation-related off must log bit-identical training losses.
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from simpletuner.config.events import SIGNATURE_HEADER, verify
from tests.conftest import REPO
from tests.e2e.test_train_cli import SERIAL, losses, simpletuner
from tests.evaluation.readers import tensorboard_image_tags, tensorboard_scalars, wandb_scalars

pytestmark = pytest.mark.e2e

STEPS = 10
SECRET = "s3cret"
JOB_ID = "7"
INFERENCE_STEPS = 4
PREVIEW_EVERY = 2
EVAL_SIGMAS = ("0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9")


class Receiver:
    """Records every POSTed body with its signature header."""

    def __init__(self):
        self.requests: list[tuple[bytes, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests.append((body, self.headers.get(SIGNATURE_HEADER)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/api/jobs/{JOB_ID}/events"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def events(self) -> list[dict]:
        return [json.loads(body) for body, _ in self.requests]


def write_config(tmp: Path, **overrides) -> tuple[Path, Path]:
    dataset, evalset = tmp / "sample", tmp / "eval"
    if not dataset.exists():
        shutil.copytree(REPO / "datasets" / "sample", dataset)
        evalset.mkdir()
        for name in ("00_orange_circle", "01_red_square"):  # held-out copies, cached like training data
            for ext in (".png", ".txt"):
                shutil.copy(dataset / f"{name}{ext}", evalset / f"{name}{ext}")
    config = json.loads((REPO / "config" / "config.json").read_text())
    config.update({
        "--output_dir": str(tmp / "output"), "--data_backend_config": str(tmp / "multidatabackend.json"),
        "--max_train_steps": STEPS, "--checkpointing_steps": 100,
        # LoRA dropout draws from torch's global RNG in train mode: a validation that left the model in eval
        # mode, or the RNG advanced, would change every later loss
        "--lora_dropout": 0.25,
    })
    config.update({f"--{k}": v for k, v in overrides.items()})
    backends = json.loads((REPO / "config" / "multidatabackend.json").read_text())
    backends[0].update(instance_data_dir=str(dataset), cache_dir_vae=str(tmp / "cache" / "vae"))
    backends[1].update(cache_dir=str(tmp / "cache" / "text"))
    backends.insert(1, {"id": "held-out", "dataset_type": "eval", "instance_data_dir": str(evalset),
                        "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel",
                        "cache_dir_vae": str(tmp / "cache" / "vae-eval")})
    (tmp / "config.json").write_text(json.dumps(config))
    (tmp / "multidatabackend.json").write_text(json.dumps(backends))
    return tmp / "config.json", tmp / "output"


VALIDATION = {
    "validation_steps": 5, "validation_on_startup": True, "validation_prompt": "an orange circle",
    "validation_resolution": "64", "validation_num_inference_steps": INFERENCE_STEPS, "validation_seed": 3,
    "validation_guidance": 3.5, "validation_preview": True, "validation_preview_steps": PREVIEW_EVERY,
    "evaluation_type": "clip", "eval_steps_interval": 5, "report_to": "all", "tracker_run_name": "e2e",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_flux_path):
    # tiny_flux_path: the checkpoint exists before either run, so neither run writes it (writing seeds torch)
    tmp = tmp_path_factory.mktemp("validation")
    library = tmp / "prompts.json"
    library.write_text(json.dumps({"Red Square!": "a red square"}))
    config, output = write_config(tmp, user_prompt_library=str(library), **VALIDATION)
    receiver = Receiver()
    env = {**SERIAL, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "SIMPLETUNER_WEBHOOK_URL": receiver.url,
           "SIMPLETUNER_WEBHOOK_SECRET": SECRET, "SIMPLETUNER_JOB_ID": JOB_ID}
    proc = simpletuner("train", "--config", str(config), env=env)
    receiver.httpd.shutdown()
    return tmp, output, receiver, proc


def test_validation_images_and_previews_are_written(run):
    _, output, _, _ = run
    for step in (0, 5, 10):
        folder = output / "validation" / f"step_{step}"
        assert sorted(p.name for p in folder.glob("*.png")) == ["Red_Square_64x64.png", "validation_64x64.png"]
        with Image.open(folder / "validation_64x64.png") as im:
            assert im.size == (64, 64)
        assert sorted(p.name for p in (folder / "previews").glob("*.png")) == [
            f"{nick}_64x64_{i}.png" for nick in ("Red_Square", "validation") for i in (2, 4)
        ]
    assert not (output / "validation" / "step_1").exists()


def test_server_receives_signed_events_in_order(run):
    _, output, receiver, _ = run
    for body, signature in receiver.requests:
        assert verify(SECRET, body, signature)
    events = receiver.events()
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert {e["job_id"] for e in events} == {int(JOB_ID)}
    assert events[0]["type"] == "status" and events[0]["data"]["status"] == "running"
    assert events[-1]["type"] == "status" and events[-1]["data"]["status"] == "succeeded"

    def describe(e):
        d = e["data"]
        if e["type"] == "image":
            return ("image", d["kind"], d["step"], d["nickname"], d["inference_step"])
        return (e["type"], d.get("step"))

    timeline = [describe(e) for e in events if e["type"] in ("image", "scores", "progress")]
    expected = []
    for step in range(0, STEPS + 1):
        if step:
            expected.append(("progress", step))
        if step % 5 == 0:
            for nick in ("validation", "Red_Square"):
                expected += [("image", "preview", step, nick, i) for i in (2, 4)]
                expected.append(("image", "validation", step, nick, None))
            expected.append(("scores", step))
    assert timeline == expected

    images = [e["data"] for e in events if e["type"] == "image"]
    first = images[2]
    assert first["prompt"] == "an orange circle" and first["resolution"] == [64, 64]
    assert Path(first["path"]) == output / "validation" / "step_0" / "validation_64x64.png"
    assert all(d["image_base64"] for d in images)
    scores = [e["data"] for e in events if e["type"] == "scores"]
    for d in scores:
        assert {"clip_score/validation", "clip_score/Red_Square", "clip_score/mean", "eval/loss"} <= set(d["metrics"])
        assert all(f"eval/loss_sigma_{s}" in d["metrics"] for s in EVAL_SIGMAS)
        assert 0 <= d["metrics"]["clip_score/mean"] <= 100
    assert "train/loss" in scores[1]["metrics"] and "train/loss" not in scores[0]["metrics"]  # step 0: no loss yet


def test_trackers_hold_the_metrics(run):
    _, output, receiver, _ = run
    scores = {e["data"]["step"]: e["data"]["metrics"] for e in receiver.events() if e["type"] == "scores"}
    train = losses(output)
    logs = output / "logs"

    tb = tensorboard_scalars(logs / "tensorboard" / "e2e")
    assert tb["train/loss"] == pytest.approx(train)
    assert sorted(tb["train/lr"]) == list(range(1, STEPS + 1))
    for key in ("eval/loss", "eval/loss_sigma_0.5", "clip_score/mean", "clip_score/Red_Square"):
        assert tb[key] == pytest.approx({s: m[key] for s, m in scores.items()}), key
    assert {"validation/validation_64x64", "validation/Red_Square_64x64", "preview/validation_64x64",
            "preview/Red_Square_64x64"} <= tensorboard_image_tags(logs)

    runs = list((logs / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    wb = wandb_scalars(runs[0])
    assert wb["train/loss"] == pytest.approx(train)
    for key in ("eval/loss", "eval/loss_sigma_0.1", "clip_score/mean"):
        assert wb[key] == pytest.approx({s: m[key] for s, m in scores.items()}), key
    assert list((runs[0] / "files" / "media" / "images").rglob("*.png"))


def test_training_losses_are_identical_without_validation(run, tmp_path):
    _, output, _, _ = run
    config, plain = write_config(tmp_path)  # same data and seed; no validation, eval, previews or trackers
    simpletuner("train", "--config", str(config), env=SERIAL)
    assert losses(plain) == losses(output)  # bit for bit
    assert not (plain / "validation").exists() and not (plain / "logs").exists()


def test_previews_without_a_webhook_are_written_and_logged(tmp_path):
    """A CLI run with no server: previews land beside the validation images and reach the trackers as one strip per
    image (its previews side by side, in denoising order)."""
    config, output = write_config(tmp_path, max_train_steps=2, lr_warmup_steps=0, validation_steps=2,
                                  validation_prompt="a red square",
                                  validation_resolution="64", validation_num_inference_steps=2,
                                  validation_preview=True, validation_preview_steps=1, report_to="tensorboard",
                                  tracker_run_name="nohook")
    env = {k: v for k, v in SERIAL.items() if not k.startswith("SIMPLETUNER_WEBHOOK")}
    simpletuner("train", "--config", str(config), env=env)
    previews = output / "validation" / "step_2" / "previews"
    assert sorted(p.name for p in previews.glob("*.png")) == ["validation_64x64_1.png", "validation_64x64_2.png"]
    assert "preview/validation_64x64" in tensorboard_image_tags(output / "logs")
