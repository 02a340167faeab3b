"""Sharded training as a user runs it: ``simpletuner train --num_processes 2`` with ``fsdp_enable`` on this CPU
machine (two gloo processes, the tiny Flux, the shipped sample images), then ``simpletuner consolidate``.

- A full fine-tune writes FSDP checkpoints (one shard per process), is killed halfway through writing its last one,
  and started again: it resumes from the checkpoint before with the same losses bit for bit; its checkpoint
  consolidates into a transformer folder that ``FluxPipeline.from_pretrained(..., transformer=...)`` loads, and
  whose predictions (and generations) equal the trained model's.
- A LoRA run with FULL_STATE_DICT checkpoints consolidates into a LoRA file that ``load_lora_weights`` takes, giving
  the same generations as the LoRA the run wrote itself.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import REPO
from tests.e2e.test_train_cli import losses, simpletuner, write_run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
STEPS, INTERVAL = 4, 2
FSDP = {"fsdp_enable": True, "max_train_steps": STEPS, "checkpointing_steps": INTERVAL,
        "checkpoints_total_limit": None, "lr_warmup_steps": 0, "learning_rate": 1e-3, "resume_from_checkpoint": "latest"}
SAMPLE = REPO / "datasets" / "sample"


def _small(tmp_path) -> None:
    """64-pixel buckets: the sample images train fast."""
    backends = json.loads((tmp_path / "multidatabackend.json").read_text())
    backends[0].update(resolution=64)
    (tmp_path / "multidatabackend.json").write_text(json.dumps(backends))


def _generate(pipe, prompt="a red circle"):
    return pipe(prompt=prompt, height=32, width=32, num_inference_steps=2, output_type="latent",
                max_sequence_length=32, generator=torch.Generator().manual_seed(0)).images


def test_full_finetune_resumes_bit_identically_and_consolidates(tmp_path, tiny_flux_path):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    config, output = write_run(tmp_path, SAMPLE, model_type="full", **FSDP)
    _small(tmp_path)
    train = ("train", "--config", str(config), "--num_processes", "2")

    # 1. killed (SIGKILL, as by the OOM killer) halfway through writing checkpoint-4
    drill = {**os.environ, "SIMPLETUNER_FAILPOINT": f"checkpoint.save:{STEPS}",
             "SIMPLETUNER_FAILPOINT_ONCE": str(tmp_path / "fired")}
    killed = simpletuner(*train, check=False, env=drill)
    assert killed.returncode != 0 and (tmp_path / "fired").is_file()
    uninterrupted = losses(output)  # steps 1..4, all logged before the kill
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))
    assert (output / f".checkpoint-{STEPS}.tmp" / "sharded").is_dir()  # its shards, never published
    assert not (output / f"checkpoint-{STEPS}").exists()

    # 2. started again: the half-written checkpoint is removed, the run resumes from checkpoint-2, every process
    # restoring its own shard, and redoes steps 3 and 4 exactly
    resumed = simpletuner(*train)
    assert f"removed {output / f'.checkpoint-{STEPS}.tmp'}" in resumed.stderr
    assert f"resumed from {output / f'checkpoint-{INTERVAL}'} at step {INTERVAL}" in resumed.stderr
    assert losses(output) == uninterrupted  # bit for bit, for the two steps trained again
    rows = [json.loads(line) for line in (output / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 3, 4]
    checkpoint = output / f"checkpoint-{STEPS}"
    state = json.loads((checkpoint / "training_state.json").read_text())
    assert state["sharding"]["world_size"] == 2 and state["sharding"]["state_dict_type"] == "SHARDED_STATE_DICT"
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(state["sharding"]["files"])
    assert not (checkpoint / "trainable.safetensors").exists()  # no process ever held the whole model to save it

    # 3. consolidated by the command line into a diffusers transformer folder
    done = simpletuner("consolidate", str(checkpoint), "--out", str(tmp_path / "consolidated"))
    assert "consolidated/transformer" in done.stdout
    transformer = FluxTransformer2DModel.from_pretrained(tmp_path / "consolidated" / "transformer")
    pipe = FluxPipeline.from_pretrained(tiny_flux_path, transformer=transformer)
    trained = FluxTransformer2DModel.from_pretrained(output / "transformer")  # what the run itself exported
    base = FluxTransformer2DModel.from_pretrained(tiny_flux_path, subfolder="transformer")
    inputs = _transformer_inputs(trained.config)
    with torch.no_grad():
        consolidated, ours, before = (m(**inputs, return_dict=False)[0] for m in (pipe.transformer, trained, base))
    assert torch.equal(consolidated, ours)
    assert (ours - before).abs().max().item() > 1e-4  # four steps of training moved it
    assert torch.equal(_generate(pipe), _generate(FluxPipeline.from_pretrained(tiny_flux_path, transformer=trained)))


def test_lora_with_full_state_dict_checkpoints_consolidates_to_a_lora_file(tmp_path, tiny_flux_path):
    from diffusers import FluxPipeline

    settings = {**FSDP, "max_train_steps": INTERVAL, "fsdp_state_dict_type": "FULL_STATE_DICT"}
    config, output = write_run(tmp_path, SAMPLE, model_type="lora", lora_rank=4, lora_alpha=4, **settings)
    _small(tmp_path)
    simpletuner("train", "--config", str(config), "--num_processes", "2")
    checkpoint = output / f"checkpoint-{INTERVAL}"
    # FULL_STATE_DICT: the main process gathered and wrote whole tensors (the LoRA weights only, not the base)
    assert (checkpoint / "trainable.safetensors").is_file() and not (checkpoint / "sharded").exists()

    done = simpletuner("consolidate", str(checkpoint), "--out", str(tmp_path / "consolidated"))
    lora = tmp_path / "consolidated" / "pytorch_lora_weights.safetensors"
    assert str(lora) in done.stdout
    pipe = FluxPipeline.from_pretrained(tiny_flux_path)
    base = _generate(pipe)
    pipe.load_lora_weights(str(lora))
    consolidated = _generate(pipe)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(str(output / "pytorch_lora_weights.safetensors"))  # the run's own export
    assert torch.equal(consolidated, _generate(pipe))
    assert not torch.equal(consolidated, base)


def _transformer_inputs(cfg, tokens=16, text=8):
    g = torch.Generator().manual_seed(7)
    return dict(hidden_states=torch.randn(1, tokens, cfg.in_channels, generator=g),
                encoder_hidden_states=torch.randn(1, text, cfg.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g),
                timestep=torch.tensor([0.5]), img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3),
                guidance=torch.tensor([1.0]) if cfg.guidance_embeds else None)

