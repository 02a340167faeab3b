"""SimpleTuner's Flux quickstart, word for word, as docs/quickstart-flux.md walks through it.

The quickstart's ``config/multidatabackend.json`` is shipped verbatim in tests/fixtures/quickstart_flux, with the
``config/config.json`` its steps build (krea flavour, int8-quanto base, bf16, gradient checkpointing, TREAD,
validation at 1024x1024 and 1280x768 with previews, a prompt library; the regularisation set, repeats 1000) and
the first entry of its example ``config/user_prompt_library.json`` (each entry costs two 20-step generations, with
a preview per step, at a megapixel on the CPU: the example's second entry would test nothing the first does not).
The config's step counts (``--max_train_steps: 2``, intervals of 2) are the only values a user would not have: the
run stops after two steps, and its validation denoises in ``STEPS`` steps instead of the quickstart's 20 (set on the
command line: a megapixel step on the CPU costs seconds, and 20 of them per image made this the suite's slowest test).
The test makes the image folders they name, and the only overrides are the ones the tiny flavour needs:
``model_flavour=tiny`` and null model paths. No webhook and no server: previews are written beside the images.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import REPO

pytestmark = pytest.mark.e2e
FIXTURE = REPO / "tests" / "fixtures" / "quickstart_flux" / "config"
TINY = ("model_flavour=tiny", "pretrained_model_name_or_path=null", "pretrained_vae_model_name_or_path=null")
STEPS = 3  # validation_num_inference_steps for the walkthrough's train step


def run(project: Path, *args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simpletuner.cli", *args], capture_output=True, text=True,
                          cwd=project, input=stdin, timeout=1500, env={**os.environ, **(env or {})})


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def make_images(folder: Path, count: int, size: tuple[int, int], names: list[str] | None = None) -> None:
    """Photos as a user would have them: RGB JPEGs of the size asked (a gradient, so the VAE sees structure)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        image = Image.linear_gradient("L").resize(size).convert("RGB")
        image.paste((40 * i % 256, 90, 160), (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
        image.save(folder / f"{(names or [])[i] if names else f'photo_{i}'}.jpg", quality=90)


@pytest.fixture
def project(tmp_path, tiny_flux_path) -> Path:
    """A folder laid out as the quickstart leaves it: config/ with its three files, and the image folders."""
    shutil.copytree(FIXTURE, tmp_path / "config")
    make_images(tmp_path / "datasets" / "pseudo-camera-10k", 2, (512, 512), ["a mountain lake", "a city street"])
    make_images(tmp_path / "datasets" / "dreambooth-subject", 2, (1024, 1024))
    return tmp_path


def test_the_walkthrough_configure_validate_train(project, tmp_path_factory):
    # step 1 of the walk-through: the wizard writes a config of its own (answers piped, as docs/quickstart-flux.md
    # shows); it refuses to overwrite the quickstart's files, so it is run in a fresh folder
    wizard_dir = tmp_path_factory.mktemp("wizard")
    shutil.copytree(project / "datasets" / "dreambooth-subject", wizard_dir / "datasets" / "dreambooth-subject")
    answers = "\n".join(["flux", "krea", "lora", "16", "1000", "1e-4", "bf16", "datasets/dreambooth-subject",
                         "instanceprompt", "the name of your subject goes here", "1024", "output/models"]) + "\n"
    configured = run(wizard_dir, "configure", stdin=answers)
    assert configured.returncode == 0, configured.stderr
    written = json.loads((wizard_dir / "config" / "config.json").read_text())
    assert written["model_flavour"] == "krea" and written["lora_rank"] == 16
    assert run(project, "configure").returncode == 1  # never overwrites the quickstart's own files

    # step 2: validate the quickstart's files; multidatabackend.json is found beside config.json, and every key
    # the quickstart uses is understood (nothing is reported as unknown)
    checked = run(project, "validate", *sets(*TINY))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[0] == ("data_backend_config: not set; using config/multidatabackend.json, "
                                              "found beside config/config.json")
    assert "unknown key" not in checked.stdout

    # step 3: train (2 steps, validation with previews at step 2, LoRA written)
    trained = run(project, "train", "--config", "config/config.json",
                  *sets(*TINY, f"validation_num_inference_steps={STEPS}"),
                  env={"OMP_NUM_THREADS": "2"})
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-6000:]
    assert ("data_backend_config: not set; using config/multidatabackend.json, found beside config/config.json"
            in trained.stderr)
    assert "unknown key" not in trained.stderr
    output = project / "output" / "models"
    rows = [json.loads(line) for line in (output / "training_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert (output / "pytorch_lora_weights.safetensors").is_file()

    step = output / "validation" / "step_2"
    # the library's nicknames become file names: "anime_<token>" is written as "anime__token"
    assert set(json.loads((FIXTURE / "user_prompt_library.json").read_text())) == {"anime_<token>"}
    nicknames = {"validation", "anime__token"}
    sizes = {(1024, 1024), (1280, 768)}
    images = {p.name for p in step.glob("*.png")}
    assert images == {f"{n}_{w}x{h}.png" for n in nicknames for (w, h) in sizes}
    with Image.open(step / "validation_1280x768.png") as image:
        assert image.size == (1280, 768)
    previews = {p.name for p in (step / "previews").glob("*.png")}  # validation_preview_steps 1: every step
    assert previews == {f"{n}_{w}x{h}_{i}.png" for n in nicknames for (w, h) in sizes for i in range(1, STEPS + 1)}

    # the regularisation set and the subject sets all trained (caches hold their latents)
    for cache in ("pseudo-camera-10k", "dreambooth-subject", "dreambooth-subject-512"):
        assert list((project / "cache" / "vae" / "flux" / cache).rglob("*.safetensors")), cache


def test_hub_ids_without_network_end_in_one_clear_error_before_anything_is_written(project):
    """The quickstart as written (real FLUX.1-dev weights) on a machine that cannot reach the Hub."""
    proc = run(project, "train", "--config", "config/config.json",
               env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(project / "hf-home"), "HF_HUB_OFFLINE": "0"})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert ("pretrained_model_name_or_path: cannot reach the Hugging Face Hub to fetch 'black-forest-labs/FLUX.1-dev'"
            in proc.stderr)
    assert "HF_HUB_OFFLINE=1" in proc.stderr and "a local folder" in proc.stderr
    assert not (project / "output").exists() and not (project / "cache").exists()

    offline = run(project, "train", "--config", "config/config.json",
                  env={"HF_HOME": str(project / "hf-home"), "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 1 and "Traceback" not in offline.stderr
    assert "is not in the local Hugging Face cache" in offline.stderr and "HF_HUB_OFFLINE is set" in offline.stderr
    assert not (project / "output").exists() and not (project / "cache").exists()


def test_tiny_flavour_with_a_hub_vae_is_a_contradiction(project):
    proc = run(project, "train", "--config", "config/config.json",
               *sets("model_flavour=tiny", "pretrained_model_name_or_path=null"),
               env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "pretrained_vae_model_name_or_path: model_flavour 'tiny' is a small model generated on this machine" \
        in proc.stderr
    assert "set pretrained_vae_model_name_or_path to null" in proc.stderr
    assert not (project / "output").exists()
