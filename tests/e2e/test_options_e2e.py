"""Every optimizer that runs here and every LyCORIS algorithm trains the tiny Flux example a few steps through the
real trainer, checkpoints, resumes bit for bit, and exports weights users load; EMA validation differs from the
trained weights' and resume restores the EMA exactly.

Runs are in-process (``train()``, the same code ``simpletuner train`` runs; tests/e2e/test_train_cli.py covers the
subprocess) on one intra-op thread, so float reductions run in one order and a resumed run can be compared bit for
bit. On the CPU every optimizer here is deterministic; bitsandbytes' optimizers (CUDA only) are refused on the CPU
before anything is cached (tests/training/test_options.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from simpletuner.config import load_data_backends
from tests.conftest import REPO
from tests.helpers import flux_config

pytestmark = pytest.mark.e2e
STEPS, RESUME_AT = 4, 2
CPU_OPTIMIZERS = ["adamw", "adamw_bf16", "optimi-adamw", "optimi-stableadamw", "optimi-lion", "prodigy",
                  "adamw_schedulefree", "ademamix"]
LYCORIS = [{"algo": "lokr", "factor": 4}, {"algo": "loha", "linear_dim": 4, "linear_alpha": 4},
           {"algo": "locon", "linear_dim": 4, "linear_alpha": 4, "apply_preset": "attn-mlp"},
           {"algo": "full", "apply_preset": {"target_module": ["Attention"]}}]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The sample dataset and caches shared by every run of this module (warm after the first)."""
    tmp = tmp_path_factory.mktemp("options")
    shutil.copytree(REPO / "datasets" / "sample", tmp / "sample")
    return tmp


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(workspace: Path, output: Path, **overrides):
    from simpletuner.training.trainer import train

    values = dict(output_dir=str(output), max_train_steps=STEPS, checkpointing_steps=RESUME_AT, learning_rate=1e-3,
                  lora_dropout=0.0, seed=5)
    values.update(overrides)
    config = flux_config(**values)
    backends = [{"id": "sample", "instance_data_dir": str(workspace / "sample"), "caption_strategy": "textfile",
                 "resolution": 32, "resolution_type": "pixel", "cache_dir_vae": str(workspace / "cache" / "vae")},
                {"id": "text", "dataset_type": "text_embeds", "cache_dir": str(workspace / "cache" / "text")}]
    return config, train(config, load_data_backends(backends, config=config))


def trains_and_resumes(workspace: Path, name: str, **overrides):
    """Train STEPS steps, then resume a copy of checkpoint-RESUME_AT: the resumed steps' losses and the final
    weights must equal the uninterrupted run's exactly."""
    full = workspace / name / "full"
    config, first = run(workspace, full, **overrides)
    assert len(first.losses) == STEPS and all(torch.isfinite(torch.tensor(first.losses)))
    resumed = workspace / name / "resumed"
    resumed.mkdir(parents=True)
    shutil.copytree(full / f"checkpoint-{RESUME_AT}", resumed / f"checkpoint-{RESUME_AT}")
    _, second = run(workspace, resumed, resume_from_checkpoint="latest", **overrides)
    assert second.losses == first.losses[RESUME_AT:]
    a, b = load_file(first.lora_path), load_file(second.lora_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return config, first


def _probe(adapter):
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 4, 4, generator=g)
    text = {"prompt_embeds": torch.randn(1, adapter.t5_max_length, 32, generator=g),
            "pooled_prompt_embeds": torch.randn(1, 32, generator=g)}
    return latents, torch.tensor([0.5]), text


@pytest.mark.parametrize("optimizer", CPU_OPTIMIZERS)
def test_optimizer_trains_checkpoints_resumes_and_exports(workspace, optimizer):
    from diffusers import FluxPipeline

    from simpletuner.models.flux import FluxAdapter

    extra = {"base_model_default_dtype": "bf16"} if optimizer == "adamw_bf16" else {}
    if optimizer == "prodigy":
        extra["learning_rate"] = 1.0  # Prodigy estimates the step size itself; lr is its multiplier
    config, result = trains_and_resumes(workspace, optimizer, optimizer=optimizer, **extra)
    # the export is a diffusers LoRA that FluxPipeline loads and that changes the transformer's output
    adapter = FluxAdapter(config)
    pipe = FluxPipeline.from_pretrained(adapter.model_path())
    latents, t, text = _probe(adapter)
    with torch.no_grad():
        before = adapter.predict(pipe.transformer, latents, t, text)
        pipe.load_lora_weights(result.lora_path)
        after = adapter.predict(pipe.transformer, latents, t, text)
    assert (after - before).abs().max().item() > 1e-6


@pytest.mark.parametrize("lycoris", LYCORIS, ids=[c["algo"] for c in LYCORIS])
def test_lycoris_trains_checkpoints_resumes_and_exports(workspace, lycoris):
    """The exported file is lycoris' own format (``lycoris_<module path>.<weight>``, what ComfyUI maps onto Flux);
    lycoris' ``create_lycoris_from_weights`` applies it to the pipeline's transformer, which then predicts exactly
    what the trained model did."""
    from diffusers import FluxPipeline
    from lycoris import create_lycoris_from_weights

    from simpletuner.models.flux import FluxAdapter
    from simpletuner.training.lora import add_lycoris, load_lycoris_trainable

    config, result = trains_and_resumes(workspace, f"lycoris-{lycoris['algo']}", lora_type="lycoris",
                                        lycoris_config=lycoris)
    weights = load_file(result.lora_path)
    assert weights and all(k.startswith("lycoris_") for k in weights)
    assert any(k.startswith("lycoris_transformer_blocks_0_attn_to_q.") for k in weights)

    adapter = FluxAdapter(config)
    trained = adapter.load_transformer().eval()
    network = add_lycoris(trained, adapter, config)
    load_lycoris_trainable(network, load_file(Path(result.output_dir) / f"checkpoint-{STEPS}" / "trainable.safetensors"),
                       "checkpoint")
    pipe = FluxPipeline.from_pretrained(adapter.model_path())
    latents, t, text = _probe(adapter)
    with torch.no_grad():
        base = adapter.predict(pipe.transformer, latents, t, text)
        loaded, _ = create_lycoris_from_weights(1.0, result.lora_path, pipe.transformer)
        loaded.apply_to()
        theirs = adapter.predict(pipe.transformer, latents, t, text)
        ours = adapter.predict(trained, latents, t, text)
    assert (ours - theirs).abs().max().item() < 1e-5
    assert (theirs - base).abs().max().item() > 1e-6


def test_ema_validates_differently_resumes_exactly_and_is_exported(workspace):
    from simpletuner.training.ema import TrainedWeightsEMA  # noqa: F401  (the module under test)

    common = dict(use_ema=True, ema_decay=0.9, ema_validation="comparison", validation_steps=STEPS,
                  validation_prompt="a red circle", validation_resolution="32", validation_num_inference_steps=2,
                  learning_rate=5e-3)
    config, result = trains_and_resumes(workspace, "ema", **common)
    step = Path(result.output_dir) / "validation" / f"step_{STEPS}"
    trained_png, ema_png = step / "validation_32x32.png", step / "validation_ema_32x32.png"
    assert trained_png.is_file() and ema_png.is_file()
    import numpy as np
    from PIL import Image

    assert np.abs(np.asarray(Image.open(trained_png), dtype=float)
                  - np.asarray(Image.open(ema_png), dtype=float)).max() > 0  # EMA weights make another image

    # the EMA is saved in every checkpoint and the resumed run ends on exactly the same average
    full_ema = torch.load(Path(result.output_dir) / f"checkpoint-{STEPS}" / "ema.pt", weights_only=True)
    resumed_ema = torch.load(workspace / "ema" / "resumed" / f"checkpoint-{STEPS}" / "ema.pt", weights_only=True)
    assert full_ema["optimization_step"] == resumed_ema["optimization_step"] == STEPS
    assert all(torch.equal(a, b) for a, b in zip(full_ema["shadow_params"], resumed_ema["shadow_params"]))
    # exported beside the final weights, and different from them
    assert result.ema_path == str(Path(result.output_dir) / "ema" / "pytorch_lora_weights.safetensors")
    trained, averaged = load_file(result.lora_path), load_file(result.ema_path)
    assert trained.keys() == averaged.keys()
    assert any(not torch.equal(trained[k], averaged[k]) for k in trained)
