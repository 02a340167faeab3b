"""`simpletuner train` end to end, in real subprocesses, on the tiny Flux and the shipped sample dataset."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

STEPS = 30


def write_run(tmp: Path, dataset: Path, **overrides) -> tuple[Path, Path]:
    """A copy of the shipped config pointed at tmp (output, caches) with ``overrides`` applied."""
    config = json.loads((REPO / "config" / "config.json").read_text())
    config.update({
        "--output_dir": str(tmp / "output"), "--data_backend_config": str(tmp / "multidatabackend.json"),
        "--max_train_steps": STEPS, "--checkpointing_steps": 15, "--checkpoints_total_limit": 1,
    })
    config.update({f"--{k}": v for k, v in overrides.items()})
    backends = json.loads((REPO / "config" / "multidatabackend.json").read_text())
    backends[0].update(instance_data_dir=str(dataset), cache_dir_vae=str(tmp / "cache" / "vae"))
    backends[1].update(cache_dir=str(tmp / "cache" / "text"))
    (tmp / "config.json").write_text(json.dumps(config))
    (tmp / "multidatabackend.json").write_text(json.dumps(backends))
    return tmp / "config.json", tmp / "output"


# one intra-op thread: float reductions then run in one order, so two runs can be compared bit for bit
SERIAL = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def simpletuner(*args, check=True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "simpletuner.cli", *args], capture_output=True, text=True,
                          cwd=kwargs.pop("cwd", REPO), timeout=1500, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def losses(output: Path) -> dict[int, float]:
    lines = (output / "training_log.jsonl").read_text().splitlines()
    return {row["step"]: row["loss"] for row in map(json.loads, lines)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One uninterrupted run shared by the tests below."""
    tmp = tmp_path_factory.mktemp("run")
    dataset = tmp / "sample"
    import shutil

    shutil.copytree(REPO / "datasets" / "sample", dataset)
    config, output = write_run(tmp, dataset)
    proc = simpletuner("train", "--config", str(config))
    return tmp, config, output, proc


def test_run_writes_progress_checkpoint_and_lora(trained):
    _, _, output, proc = trained
    assert "Training" in proc.stderr  # the tqdm progress bar
    assert sorted(losses(output)) == list(range(1, STEPS + 1))
    # checkpoints_total_limit=1: only the newest survives, and no temp folders are left
    assert [p.name for p in output.iterdir() if "checkpoint" in p.name] == [f"checkpoint-{STEPS}"]
    summary = json.loads((output / "run_summary.json").read_text())
    assert summary["global_step"] == STEPS
    assert Path(summary["lora_path"]).name == "pytorch_lora_weights.safetensors"
    assert summary["latents_encoded"] == 12 and summary["captions_encoded"] == 12


def _fixed_batch_loss(pipe, adapter, latents, text, noise, sigmas):
    objective = adapter.objective
    with torch.no_grad():
        pred = adapter.predict(pipe.transformer, objective.add_noise(latents, noise, sigmas), sigmas, text)
    return torch.nn.functional.mse_loss(pred, objective.target(latents, noise, sigmas)).item()


def _fixed_batch(adapter, dataset: Path, count=4):
    from PIL import Image
    import numpy as np

    from simpletuner.models.base import TextEmbedding

    files = sorted(dataset.glob("*.png"))[:count]
    pix = []
    for f in files:
        im = Image.open(f).convert("RGB").resize((128, 128))
        pix.append(torch.from_numpy(np.asarray(im, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1)
    latents = adapter.encode_images(torch.stack(pix))
    captions = [f.with_suffix(".txt").read_text().strip() for f in files]
    text = TextEmbedding.collate(adapter.encode_prompts(captions))
    g = torch.Generator().manual_seed(123)
    return latents, text, torch.randn(latents.shape, generator=g), torch.linspace(0.2, 0.8, len(files))


def test_lora_loads_into_fluxpipeline_lowers_loss_and_matches_trained_model(trained):
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    from simpletuner.models.flux import FluxAdapter
    from simpletuner.training.lora import add_lora, load_lora_state
    from tests.helpers import flux_config

    tmp, _, output, _ = trained
    config = flux_config(lora_rank=8, lora_alpha=8, lora_dropout=0.0)
    adapter = FluxAdapter(config)
    pipe = FluxPipeline.from_pretrained(adapter.model_path())
    latents, text, noise, sigmas = _fixed_batch(adapter, tmp / "sample")
    before = _fixed_batch_loss(pipe, adapter, latents, text, noise, sigmas)

    # 1. diffusers' own loader takes the file as written, without conversion
    pipe.load_lora_weights(str(output / "pytorch_lora_weights.safetensors"))
    after = _fixed_batch_loss(pipe, adapter, latents, text, noise, sigmas)
    assert after < before * 0.95, (before, after)

    # 2. the trained model (base + LoRA weights from the final checkpoint) predicts what the pipeline now does
    trained_model = adapter.load_transformer().eval()
    add_lora(trained_model, adapter, config)
    load_lora_state(trained_model, load_file(output / f"checkpoint-{STEPS}" / "trainable.safetensors"), "ckpt")
    sigma = torch.tensor([0.5])
    noisy = latents[:1] * 0.5 + noise[:1] * 0.5
    one = {k: v[:1] for k, v in text.items()}
    with torch.no_grad():
        ours = adapter.predict(trained_model, noisy, sigma, one)
        theirs = adapter.predict(pipe.transformer, noisy, sigma, one)
        pipe.unload_lora_weights()
        base = adapter.predict(pipe.transformer, noisy, sigma, one)
    assert (ours - theirs).abs().max().item() < 1e-5
    assert (ours - base).abs().max().item() > 1e-3  # the LoRA really changes the output

    # 3. and whole-pipeline generation with the LoRA equals generation with the trained transformer
    pipe.load_lora_weights(str(output / "pytorch_lora_weights.safetensors"))
    kwargs = dict(prompt="a red circle", height=64, width=64, num_inference_steps=2, output_type="np",
                  max_sequence_length=adapter.t5_max_length)
    with_lora = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    pipe_trained = FluxPipeline.from_pretrained(adapter.model_path(), transformer=trained_model)
    from_trained = pipe_trained(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert abs(with_lora - from_trained).max() < 1e-4


def test_resume_continues_with_identical_losses(trained, tmp_path):
    """Stop a run at its step-15 checkpoint (copied, as an interrupted run would leave it) and resume."""
    import shutil

    tmp, _, output, _ = trained
    config, resumed = write_run(tmp_path, tmp / "sample", checkpoints_total_limit=2)
    simpletuner("train", "--config", str(config), env=SERIAL)  # the uninterrupted reference
    reference = losses(resumed)
    assert reference[1] == losses(output)[1]  # same seed, data and init as the module's run (threads differ later)
    shutil.move(str(resumed), str(tmp_path / "reference"))
    resumed.mkdir()
    shutil.copytree(tmp_path / "reference" / "checkpoint-15", resumed / "checkpoint-15")
    proc = simpletuner("train", "--config", str(config), env=SERIAL)
    assert "resumed from" in proc.stderr
    after = losses(resumed)
    assert sorted(after) == list(range(16, STEPS + 1))
    assert all(after[s] == reference[s] for s in after), (after, reference)


def test_sigterm_stops_cleanly_and_latest_resumes(tmp_path, sample_dataset):
    config, output = write_run(tmp_path, sample_dataset, max_train_steps=100000, checkpointing_steps=5,
                               checkpoints_total_limit=None)
    proc = subprocess.Popen([sys.executable, "-m", "simpletuner.cli", "train", "--config", str(config)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = output / "training_log.jsonl"
    deadline = time.time() + 600  # a hang guard: the wait ends at the 12th logged step
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 12):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-2000:]
    names = [p.name for p in output.iterdir()]
    assert not [n for n in names if n.startswith(".")], names  # no half-written temp checkpoint
    assert "pytorch_lora_weights.safetensors" not in names  # an interrupted run writes no final LoRA
    last = max(int(n.split("-")[1]) for n in names if n.startswith("checkpoint-"))
    cfg = json.loads(config.read_text())
    cfg["--max_train_steps"] = last + 3
    config.write_text(json.dumps(cfg))
    simpletuner("train", "--config", str(config))
    summary = json.loads((output / "run_summary.json").read_text())
    assert summary["global_step"] == last + 3
    # run again: nothing is left to train, and the run says so instead of silently doing nothing
    proc = simpletuner("train", "--config", str(config))
    assert "nothing left to train" in proc.stderr
    assert json.loads((output / "run_summary.json").read_text())["final_loss"] == summary["final_loss"]


def test_second_run_encodes_nothing_and_a_changed_image_only_itself(trained, tmp_path):
    from PIL import Image

    tmp, config, _, _ = trained
    cfg = json.loads(config.read_text())
    cfg.update({"--output_dir": str(tmp_path / "again"), "--max_train_steps": 2, "--lr_warmup_steps": 0,
                "--resume_from_checkpoint": None})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    simpletuner("train", "--config", str(tmp_path / "config.json"))
    summary = json.loads((tmp_path / "again" / "run_summary.json").read_text())
    assert summary["vae_forwards"] == 0 and summary["text_encoder_forwards"] == 0
    assert summary["latents_encoded"] == 0 and summary["captions_encoded"] == 0

    changed = sorted((tmp / "sample").glob("*.png"))[0]
    Image.open(changed).rotate(90).save(changed)
    (tmp_path / "again").rename(tmp_path / "again-1")
    simpletuner("train", "--config", str(tmp_path / "config.json"))
    summary = json.loads((tmp_path / "again" / "run_summary.json").read_text())
    assert summary["latents_encoded"] == 1 and summary["captions_encoded"] == 0
    assert summary["text_encoder_forwards"] == 0


def test_invalid_config_is_refused_and_nothing_is_written(tmp_path, sample_dataset):
    config, output = write_run(tmp_path, sample_dataset, learning_rate="fast", lr_scheduler="cosin")
    proc = simpletuner("train", "--config", str(config), check=False)
    assert proc.returncode == 1
    assert "learning_rate" in proc.stderr and "lr_scheduler" in proc.stderr and "cosine" in proc.stderr
    assert not output.exists() and not (tmp_path / "cache").exists()


def test_dataset_too_small_for_the_batch_says_how_to_fix_it(tmp_path, sample_dataset):
    for f in sorted(sample_dataset.glob("*.png"))[1:]:
        f.unlink()
    config, _ = write_run(tmp_path, sample_dataset, train_batch_size=4)
    backends = json.loads((tmp_path / "multidatabackend.json").read_text())
    backends[0]["repeats"] = 0
    (tmp_path / "multidatabackend.json").write_text(json.dumps(backends))
    proc = simpletuner("train", "--config", str(config), check=False)
    assert proc.returncode == 1
    assert "No images detected" in proc.stderr and "repeats" in proc.stderr


def test_help_does_not_import_torch_and_lists_the_families():
    from simpletuner.config.families import FAMILIES

    code = ("import sys; from simpletuner import cli; "
            "sys.argv=['simpletuner','--help']\ntry:\n  cli.main(['--help'])\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          env={**os.environ})
    for name, family in FAMILIES.items():  # the choices come from the family table
        assert f"  {name}: {family.default_flavour}, " in proc.stdout


@pytest.mark.parametrize("features", [
    {"base_model_precision": "int8-quanto", "gradient_checkpointing": True,
     "tread_config": {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}},
    {"enable_group_offload": True, "group_offload_type": "block_level", "gradient_checkpointing": True,
     "gradient_checkpointing_interval": 2},
], ids=["int8-quanto+tread+checkpointing", "group-offload+checkpointing-interval"])
def test_memory_features_train_and_give_a_plain_diffusers_lora(tmp_path, sample_dataset, features):
    from diffusers import FluxPipeline

    config, output = write_run(tmp_path, sample_dataset, max_train_steps=6, lr_warmup_steps=0, **features)
    proc = simpletuner("train", "--config", str(config))
    if "tread_config" in features:
        assert "TREAD: drop 50% of image tokens in blocks 1..4" in proc.stderr
    if "base_model_precision" in features:
        assert "quantized" in proc.stderr
    assert json.loads((output / "run_summary.json").read_text())["global_step"] == 6
    # the LoRA trained over a quantized / offloaded / routed base loads on the plain unquantized pipeline
    from simpletuner.models.tiny import tiny_root

    pipe = FluxPipeline.from_pretrained(next(tiny_root().glob("flux-v*")))
    kwargs = dict(prompt="a red circle", height=64, width=64, num_inference_steps=2, output_type="np",
                  max_sequence_length=64)
    base = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    pipe.load_lora_weights(str(output / "pytorch_lora_weights.safetensors"))
    tuned = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert abs(base - tuned).max() > 1e-4


def test_tread_route_past_the_model_depth_is_refused(tmp_path, sample_dataset):
    routes = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 40}]}
    config, output = write_run(tmp_path, sample_dataset, tread_config=routes)
    proc = simpletuner("train", "--config", str(config), check=False)
    assert proc.returncode == 1
    assert "end_layer_idx" in proc.stderr and "40" in proc.stderr
    assert not output.exists() and not (tmp_path / "cache").exists()  # refused before caching anything


def test_two_processes_train_as_two_ranks(tmp_path, sample_dataset):
    config, output = write_run(tmp_path, sample_dataset, max_train_steps=4, lr_warmup_steps=0,
                               checkpointing_steps=2, checkpoints_total_limit=None)
    proc = simpletuner("train", "--config", str(config), "--num_processes", "2")
    assert "process 0 of 2" in proc.stderr and "process 1 of 2" in proc.stderr
    assert sorted(losses(output)) == [1, 2, 3, 4]
    assert (output / "checkpoint-4" / "trainable.safetensors").is_file()
    assert (output / "checkpoint-4" / "rng-rank1.pt").is_file()  # each rank resumes with its own RNG
    assert (output / "pytorch_lora_weights.safetensors").is_file()
    assert not [p for p in output.iterdir() if p.name.startswith(".")]
    # resume both ranks from step 2: the same losses as the uninterrupted two-process run
    reference = losses(output)
    for p in output.iterdir():
        if p.name != "checkpoint-2":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    proc = simpletuner("train", "--config", str(config), "--num_processes", "2")
    assert "resumed from" in proc.stderr
    assert losses(output) == pytest.approx({s: reference[s] for s in (3, 4)}, rel=1e-5)


def test_full_finetune_saves_a_transformer_that_diffusers_loads(tmp_path, sample_dataset):
    from diffusers import FluxTransformer2DModel

    from simpletuner.models.tiny import tiny_root

    config, output = write_run(tmp_path, sample_dataset, model_type="full", max_train_steps=3,
                               lr_warmup_steps=0, learning_rate=1e-4, checkpointing_steps=2)
    simpletuner("train", "--config", str(config))
    summary = json.loads((output / "run_summary.json").read_text())
    assert summary["lora_path"] is None and summary["model_path"].endswith("transformer")
    trained = FluxTransformer2DModel.from_pretrained(output / "transformer")
    base = FluxTransformer2DModel.from_pretrained(next(tiny_root().glob("flux-v*")), subfolder="transformer")
    changed = [n for (n, a), (_, b) in zip(trained.named_parameters(), base.named_parameters()) if not torch.equal(a, b)]
    assert len(changed) > len(list(base.parameters())) // 2
    # the checkpoint holds every weight, so a resumed full run continues
    cfg = json.loads(config.read_text())
    cfg["--max_train_steps"] = 4
    config.write_text(json.dumps(cfg))
    proc = simpletuner("train", "--config", str(config))
    assert "resumed from" in proc.stderr and sorted(losses(output)) == [1, 2, 3, 4]
