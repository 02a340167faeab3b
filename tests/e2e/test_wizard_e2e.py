"""`simpletuner configure` driven as a user drives it, by flags and interactively in a terminal (pexpect): both
configs validate, and `simpletuner train` trains them to a LoRA."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simpletuner.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def trains(project: Path) -> None:
    validated = run("validate", cwd=project)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert validated.stdout.splitlines()[-1] == "OK"
    trained = run("train", "--config", "config/config.json", cwd=project)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-4000:]
    summary = json.loads((project / "out" / "run_summary.json").read_text())
    assert summary["global_step"] == 2 and (project / summary["lora_path"]).is_file()  # relative: from cwd


@pytest.fixture
def project(tmp_path):
    shutil.copytree(REPO / "datasets" / "sample", tmp_path / "pics")
    return tmp_path


def test_flags_answer_every_question(project):
    result = run("configure", "--family", "flux", "--flavour", "tiny", "--model-type", "lora", "--lora-rank", "4",
                 "--steps", "2", "--learning-rate", "1e-3", "--mixed-precision", "no", "--data", "pics",
                 "--caption-strategy", "textfile", "--resolution", "64", "--output-dir", "out", cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "found 12 images, 12 with a .txt caption" in result.stdout
    assert any(line.startswith("datasets[pics] (image): 12 images") for line in result.stdout.splitlines())
    trains(project)


def test_interactive_in_a_terminal(project):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "simpletuner.cli", "configure"], cwd=str(project),
                          encoding="utf-8", timeout=300, dimensions=(40, 200))
    answers = [
        (r"Model family \(.*\) \[flux\]: ", ""),
        (r"Flavour \(.*\) \[krea\]: ", "tiny"),
        (r"Model type \(lora, full\) \[lora\]: ", ""),
        (r"LoRA rank \[16\]: ", "4"),
        (r"Training steps \[1000\]: ", "2"),
        (r"Learning rate \[1e-4\]: ", "1e-3"),
        (r"Mixed precision \(no, bf16, fp16\) \[no\]: ", ""),
        (r"Dataset folder \(images\) \[datasets/my-images\]: ", "nowhere"),
        (r"invalid: folder 'nowhere' does not exist", None),
        (r"Dataset folder \(images\) \[datasets/my-images\]: ", "pics"),
        (r"found 12 images, 12 with a \.txt caption", None),
        (r"Caption strategy \(filename, textfile, instanceprompt\) \[textfile\]: ", ""),
        (r"Resolution \(pixels\) \[64\]: ", ""),
        (r"Output folder \[output/models\]: ", "out"),
    ]
    for prompt, answer in answers:
        child.expect(prompt)
        if answer is not None:
            child.sendline(answer)
    child.expect(r"datasets\[pics\] \(image\): 12 images")
    child.expect("OK")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    trains(project)
