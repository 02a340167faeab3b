"""Self-Forcing on the tiny Wan: a causal student trains by ODE regression on per-block timesteps, resumes
bit-identically and its loss falls; a DMD step rolls the causal student out block by block with its KV cache; the
exported student streams a video through ``simpletuner stream-video``, decoded block by block exactly as one decode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from simpletuner.config import load_data_backends, load_train_config
from tests.training.test_distill import checkpoint_tensors

PROMPTS = ["a red ball rolls", "a blue cube spins"]
CAUSAL = {"causal": True, "num_frame_per_block": 2, "num_frames": 13}  # 4 latent frames: 2 blocks
SHAPE = (16, 4, 2, 2)  # the tiny Wan's latents of 13 frames at 16x16


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("self-forcing-caches")


def setup(tmp: Path, caches: Path, objective: str, *, distillation: dict | None = None, **values):
    d = {"objective": objective, "prompts": PROMPTS, "pairs_cache_dir": str(caches / "pairs"),
         "validation_num_samples": 1, **CAUSAL, **(distillation or {})}
    if "gan" in objective or objective == "ode_regression":
        d.setdefault("teacher_num_inference_steps", 4)
    config = load_train_config({
        "model_family": "wan", "model_flavour": "tiny", "model_type": "full", "mixed_precision": "no", "seed": 0,
        "max_train_steps": 6, "resolution": 16, "resolution_type": "pixel", "output_dir": str(tmp / "output"),
        "learning_rate": 2e-3, "checkpointing_steps": 3, "train_batch_size": 2, "data_backend_config": "x",
        "distillation": d, **values}).config
    backends = load_data_backends([{"id": "text", "dataset_type": "text_embeds", "cache_dir": str(caches / "text")}],
                                  config=config)
    return config, backends


@torch.no_grad()
def ode_regression_loss_over_every_point(config, transformer) -> float:
    """The causal student's x0 error against the teacher's endpoint at every stored point of every trajectory (all
    blocks at the same step), averaged: a deterministic measure of what ODE regression minimises."""
    from simpletuner.config.distill import warped_step_list
    from simpletuner.data.cache import TensorCache, text_key
    from simpletuner.models.causal_wan import CausalLayout
    from simpletuner.training.distill_pairs import pair_identity, pair_specs
    from simpletuner.models.wan import WanAdapter
    from simpletuner.training.distill_sampling import CausalDenoiser

    d = config.distillation
    adapter = WanAdapter(config)
    student = CausalDenoiser(adapter, transformer.eval(), CausalLayout(d.num_frame_per_block))
    text_cache, identity = TensorCache(Path(d.pairs_cache_dir).parent / "text"), adapter.text_cache_identity()
    steps = [t for t in warped_step_list(d) if t > 0]
    pairs = TensorCache(d.pairs_cache_dir)
    errors = []
    for spec in pair_specs(PROMPTS, 1, pair_identity(config, adapter, SHAPE, steps)):
        entry = pairs.load(spec.key)
        trajectory, stamps = entry["trajectory"], entry["timesteps"]
        text = {k: v.unsqueeze(0) for k, v in text_cache.load(text_key(spec.prompt, identity)).items()}
        for i in range(len(stamps) - 1):
            x0 = student(trajectory[i:i + 1], stamps[i:i + 1], text)
            errors.append((x0 - trajectory[-1:]).pow(2).mean().item())
    return sum(errors) / len(errors)


def test_a_causal_wan_student_trains_resumes_bit_identically_and_its_loss_falls(tmp_path, caches):
    from diffusers import WanTransformer3DModel

    from simpletuner.models.wan import WanAdapter
    from simpletuner.training.distill import distill

    config, backends = setup(tmp_path / "straight", caches, "ode_regression")
    straight = distill(config, backends)
    config, backends = setup(tmp_path / "split", caches, "ode_regression", max_train_steps=3)
    distill(config, backends)
    config, backends = setup(tmp_path / "split", caches, "ode_regression", resume_from_checkpoint="latest")
    resumed = distill(config, backends)

    a = checkpoint_tensors(Path(straight.output_dir) / "checkpoint-6")
    b = checkpoint_tensors(Path(resumed.output_dir) / "checkpoint-6")
    assert a.keys() == b.keys() and not [k for k in a if not torch.equal(a[k], b[k])]

    before = ode_regression_loss_over_every_point(config, WanAdapter(config).load_transformer())
    after = ode_regression_loss_over_every_point(
        config, WanTransformer3DModel.from_pretrained(Path(straight.output_dir) / "transformer"))
    assert after < 0.8 * before, (before, after)  # measured: 0.0067 -> 0.0043 in 6 steps
    info = json.loads((Path(straight.output_dir) / "distillation.json").read_text())
    assert info["causal"] == {"num_frame_per_block": 2, "local_attn_size": -1, "independent_first_frame": False,
                              "context_noise": 0}
    assert info["num_frames"] == 13


def test_a_self_forcing_dmd_step_rolls_the_causal_student_out_block_by_block(tmp_path, caches, monkeypatch):
    from simpletuner.models import causal_wan
    from simpletuner.training.distill import distill

    calls = []
    original = causal_wan.generate_blocks

    def recording(*args, **kwargs):
        calls.append((kwargs["exit_indices"], torch.is_grad_enabled()))
        return original(*args, **kwargs)

    monkeypatch.setattr(causal_wan, "generate_blocks", recording)
    config, backends = setup(tmp_path, caches, "dmd", max_train_steps=1, checkpointing_steps=None,
                             gradient_checkpointing=True,
                             distillation={"same_step_across_blocks": False, "context_noise": 100})
    result = distill(config, backends)
    log = json.loads((Path(result.output_dir) / "training_log.jsonl").read_text().splitlines()[0])
    assert log["generator_loss"] is not None and log["critic_loss"] is not None
    student_call, critic_call = calls  # the student's rollout (with autograd) and the critic's (without)
    assert len(student_call[0]) == 2 and student_call[1] and not critic_call[1]


def test_the_exported_causal_student_streams_a_video(tmp_path, caches):
    from simpletuner.models.causal_wan import StreamingDecoder
    from simpletuner.models.wan import WanAdapter
    from simpletuner.training.distill import distill

    config, backends = setup(tmp_path, caches, "ode_regression", max_train_steps=1, checkpointing_steps=None)
    result = distill(config, backends)
    # block-by-block decoding equals one decode of the whole latent
    adapter = WanAdapter(config)
    latents = torch.randn(1, 16, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    decoder = StreamingDecoder(adapter)
    streamed = torch.cat([decoder(latents[:, :, :2]), decoder(latents[:, :, 2:])], dim=2)
    torch.testing.assert_close(streamed, adapter.decode_latents(latents).clamp(-1, 1), rtol=1e-5, atol=1e-5)

    env = {k: v for k, v in os.environ.items() if not k.startswith("SIMPLETUNER_") or k == "SIMPLETUNER_TINY_DIR"}
    out = subprocess.run([sys.executable, "-m", "simpletuner.cli", "stream-video", "--student", result.output_dir,
                          "--prompt", PROMPTS[0], "--out", str(tmp_path / "stream")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    blocks = [line for line in out.stdout.splitlines() if line.startswith("block ")]
    assert len(blocks) == 2  # two blocks of 2 latent frames, each written as it finished
    assert len(list((tmp_path / "stream").glob("frame_*.png"))) == 13 and (tmp_path / "stream/video.mp4").is_file()
