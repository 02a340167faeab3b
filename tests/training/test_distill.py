"""The distillation recipe on the tiny Flux: every network, optimizer, EMA and RNG resumes bit-identically; an ODE
regression LoRA run validates against the teacher and exports what the pipeline loads; the exported scheduler steps
as the student samples; settings the model cannot do are refused by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from simpletuner.config import load_data_backends, load_train_config
from tests.helpers import RecordingReporter

PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> Path:
    """Text embeddings and teacher trajectories shared by the module's runs (both caches are keyed by identity)."""
    return tmp_path_factory.mktemp("distill-caches")


def setup(tmp: Path, caches: Path, objective: str, *, distillation: dict | None = None, **values):
    d = {"objective": objective, "prompts": PROMPTS, "pairs_cache_dir": str(caches / "pairs"),
         "validation_num_samples": 1, **(distillation or {})}
    if "gan" in objective or objective == "ode_regression":
        d.setdefault("teacher_num_inference_steps", 4)
    config = load_train_config({
        "model_family": "flux", "model_flavour": "tiny", "mixed_precision": "no", "seed": 0, "max_train_steps": 3,
        "resolution": 32, "resolution_type": "pixel", "output_dir": str(tmp / "output"), "learning_rate": 1e-3,
        "checkpointing_steps": 2, "data_backend_config": "unused.json", "distillation": d, **values}).config
    backends = load_data_backends([{"id": "text", "dataset_type": "text_embeds", "cache_dir": str(caches / "text")}],
                                  config=config)
    return config, backends


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, by file and key (optimizer and EMA states flattened)."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)
        elif isinstance(value, (int, float)):
            out[prefix] = torch.tensor(value)

    for file in sorted(folder.iterdir()):
        if file.suffix == ".safetensors":
            walk(file.name, load_file(file))
        elif file.suffix == ".pt":
            walk(file.name, torch.load(file, weights_only=True))
    return out


def test_a_resumed_run_is_bit_identical_in_every_network_optimizer_ema_and_rng(tmp_path, caches):
    """dmd+gan with EMA trains the student, the critic and its GAN head with two optimizers: 3 steps straight and
    2 steps + resume to 3 end in the same checkpoint, tensor for tensor, and log the same losses."""
    from simpletuner.training.distill import distill

    common = dict(distillation={"generator_update_ratio": 2, "generator_learning_rate": 2e-3,
                                "critic_learning_rate": 5e-4}, model_type="full", use_ema=True, ema_decay=0.9)
    config, backends = setup(tmp_path / "straight", caches, "dmd+gan", **common)
    straight = distill(config, backends)
    config, backends = setup(tmp_path / "split", caches, "dmd+gan", **{**common, "max_train_steps": 2})
    distill(config, backends)
    config, backends = setup(tmp_path / "split", caches, "dmd+gan", resume_from_checkpoint="latest", **common)
    resumed = distill(config, backends)
    assert straight.global_step == resumed.global_step == 3

    a = checkpoint_tensors(Path(straight.output_dir) / "checkpoint-3")
    b = checkpoint_tensors(Path(resumed.output_dir) / "checkpoint-3")
    assert a.keys() == b.keys()
    for part in ("trainable.safetensors", "trainable-critic.safetensors.gan_head", "optimizer.pt",
                 "critic_optimizer.pt", "critic_scheduler.pt", "ema.pt", "rng.pt"):
        assert any(k.startswith(part) for k in a), part
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]
    folder = Path(straight.output_dir) / "checkpoint-3"
    lrs = {name: {g["lr"] for g in torch.load(folder / name, weights_only=True)["param_groups"]}
           for name in ("optimizer.pt", "critic_optimizer.pt")}
    assert lrs == {"optimizer.pt": {2e-3}, "critic_optimizer.pt": {5e-4}}  # one optimizer per network, its own lr

    def logged(run):
        lines = (Path(run.output_dir) / "training_log.jsonl").read_text().splitlines()
        return {json.loads(line)["step"]: json.loads(line) for line in lines}

    assert logged(straight)[3] == logged(resumed)[3]
    assert logged(straight)[3]["generator_loss"] is not None  # step 3 trained the student (ratio 2)
    assert logged(straight)[2]["generator_loss"] is None and logged(straight)[2]["critic_loss"] is not None


def test_ode_regression_lora_validates_against_the_teacher_and_exports_for_the_pipeline(tmp_path, caches):
    from diffusers import FluxPipeline

    from simpletuner.models.flux import FluxAdapter
    from simpletuner.training.distill import distill

    config, backends = setup(tmp_path, caches, "ode_regression", validation_steps=3, lora_rank=4,
                             validation_num_inference_steps=4)
    reporter = RecordingReporter()
    reporter.status = reporter.progress = reporter.checkpoint = lambda *a, **k: None
    result = distill(config, backends, reporter=reporter)

    scores = [e for e in reporter.events if e[0] == "scores"]
    assert len(scores) == 1 and scores[0][1] == 3
    assert set(scores[0][2]) == {"distill/teacher_mse_1step", "distill/teacher_mse_2step",
                                 "distill/teacher_mse_4step"}
    images = [e for e in reporter.events if e[0] == "image"]
    assert images and images[0][3].is_file() and images[0][4] == "distill"
    log = [json.loads(line) for line in (tmp_path / "output/training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(r["generator_loss"] is not None for r in log)

    out = tmp_path / "output"
    assert result.lora_path == str(out / "pytorch_lora_weights.safetensors")
    info = json.loads((out / "distillation.json").read_text())
    assert info["timesteps"] == [1000.0, 750.0, 500.0, 250.0] and info["sampler"] == "ode"
    assert info["sigmas"] == [1.0, 0.75, 0.5, 0.25]
    pipe = FluxPipeline.from_pretrained(FluxAdapter(config).model_path())
    before = {n: p.clone() for n, p in pipe.transformer.named_parameters()}
    pipe.load_lora_weights(str(out))  # the family's own loader takes the student
    assert pipe.transformer.peft_config  # adapters attached
    assert before.keys() <= {n.replace(".base_layer", "") for n, _ in pipe.transformer.named_parameters()}


def test_the_exported_scheduler_steps_as_the_student_samples(tmp_path, caches):
    """FluxPipeline with the exported transformer and scheduler, called with the exported sigmas, makes the ODE
    sampler's sample from the same noise."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from simpletuner.models.flux import FluxAdapter
    from simpletuner.training.distill import export_student
    from simpletuner.training.distill_sampling import Denoiser, rollout

    config, _ = setup(tmp_path, caches, "ode_regression", model_type="full")
    adapter = FluxAdapter(config)
    model = adapter.load_transformer().eval()
    steps = [1000.0, 750.0, 500.0, 250.0]
    export_student(config, adapter, model, tmp_path / "student", steps)
    info = json.loads((tmp_path / "student/distillation.json").read_text())

    pipe = FluxPipeline.from_pretrained(
        adapter.model_path(), transformer=FluxTransformer2DModel.from_pretrained(tmp_path / "student/transformer"),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "student/scheduler"))
    text = {k: v.unsqueeze(0) for k, v in adapter.encode_prompts(["a red circle"])[0].tensors.items()}
    noise = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = rollout(lambda x, t: Denoiser(adapter, model)(x, t, text), noise, steps, adapter.objective,
                       sampler="ode").sample
        theirs = pipe(**adapter.validation_pipeline_kwargs(text, None, guidance=config.guidance_value,
                                                           guidance_real=1.0),
                      latents=adapter.pipeline_latents(noise), sigmas=info["sigmas"],
                      num_inference_steps=len(steps), height=32, width=32, output_type="latent").images
    torch.testing.assert_close(theirs, adapter.pipeline_latents(ours), rtol=1e-4, atol=1e-4)


def test_ts_schedule_bounds_the_score_timesteps_by_the_rollout(tmp_path, caches):
    """Timesteps of the score networks: anywhere in 20..980 by default; not below the rollout's next step with
    ts_schedule; not above the step it denoised from with ts_schedule_max (both on the unshifted schedule)."""
    from simpletuner.config.distill import shifted_timestep
    from simpletuner.training.distill import DistillSteps
    from simpletuner.training.distill_sampling import Rollout

    rollout = Rollout(torch.zeros(1), t_from=750.0, t_to=500.0, exit_index=1)

    def drawn(**distillation):
        config, _ = setup(tmp_path, caches, "dmd", train_batch_size=4096,
                          distillation={"timestep_shift": 3.0, **distillation})
        steps = DistillSteps(config, None, None, None, None, None, None, None, None, [], (1,), [],
                             torch.Generator().manual_seed(0), "cpu")
        return steps.score_timesteps(rollout)

    free = drawn()
    assert free.min() < 100 and free.max() > 900
    low = drawn(ts_schedule=True)
    # the next step, 500 on the shifted schedule (250 unshifted), and up
    assert low.min() >= shifted_timestep(250.0, 3.0) - 1e-6 == 500.0 - 1e-6 and low.max() > 900
    both = drawn(ts_schedule=True, ts_schedule_max=True)
    assert both.min() >= 500.0 and both.max() < 750.0


def test_what_the_model_cannot_do_is_refused_by_field(tmp_path, caches):
    from simpletuner.models.registry import create_adapter
    from simpletuner.training.distill import DistillationError, check_model, load_prompts, sample_size

    config, _ = setup(tmp_path, caches, "dmd", distillation={"prompts": None,
                                                             "prompt_file": str(tmp_path / "missing.txt")})
    with pytest.raises(DistillationError, match=r"distillation.prompt_file: .*missing.txt.* cannot be read"):
        load_prompts(config)
    (tmp_path / "prompts.txt").write_text("a cat\n\n  a dog  \n")
    config, _ = setup(tmp_path, caches, "dmd", distillation={"prompt_file": str(tmp_path / "prompts.txt")})
    assert load_prompts(config) == [*PROMPTS, "a cat", "a dog"]

    config, _ = setup(tmp_path, caches, "dmd", distillation={"num_frames": 9})
    with pytest.raises(DistillationError, match="distillation.num_frames: model_family 'flux' makes images"):
        sample_size(config, create_adapter(config))
    wan = load_train_config({"model_family": "wan", "model_flavour": "tiny-i2v", "data_backend_config": "x",
                             "max_train_steps": 1, "distillation": {"prompts": ["x"]}}).config
    with pytest.raises(DistillationError, match="model_flavour: 'tiny-i2v' animates a first frame"):
        check_model(wan, create_adapter(wan, references=False))
    wan = load_train_config({"model_family": "wan", "model_flavour": "tiny", "data_backend_config": "x",
                             "max_train_steps": 1, "distillation": {"prompts": ["x"], "num_frames": 8}}).config
    with pytest.raises(DistillationError, match="distillation.num_frames: 8 is not 4k \\+ 1 frames"):
        sample_size(wan, create_adapter(wan))


def test_several_processes_are_refused_by_the_cli_before_any_rank_starts(tmp_path, caches, monkeypatch, capsys):
    """Multi-process distillation is not supported: ``simpletuner train --num_processes 2`` of a distillation
    config exits 1 naming num_processes, without launching accelerate; fine-tuning configs still launch."""
    import subprocess

    from simpletuner import cli

    (tmp_path / "backends.json").write_text(json.dumps([{"id": "text", "dataset_type": "text_embeds",
                                                         "cache_dir": str(caches / "text")}]))
    raw = {"model_family": "flux", "model_flavour": "tiny", "mixed_precision": "no", "max_train_steps": 3,
           "resolution": 32, "resolution_type": "pixel", "output_dir": str(tmp_path / "output"),
           "data_backend_config": str(tmp_path / "backends.json"),
           "distillation": {"objective": "ode_regression", "prompts": PROMPTS}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    launched = []
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: launched.append(a) or 0)
    code = cli.main(["train", "--config", str(tmp_path / "config.json"), "--num_processes", "2"])
    assert code == 1 and not launched
    err = capsys.readouterr().err
    assert "error: num_processes: 2: a distillation run trains on one process" in err
    assert "distill-pairs --num_processes" in err


def test_a_distillation_run_under_several_processes_is_refused_by_field(tmp_path, caches, monkeypatch):
    """A run started on several ranks some other way (accelerate launch, a server job) stops before it loads or
    trains anything, with the same error."""
    from simpletuner.config.errors import ConfigError
    from simpletuner.training import distill as recipe

    class TwoRanks:
        num_processes, process_index, is_main_process = 2, 0, True

        def __init__(self, **kwargs):
            pass

    monkeypatch.setattr(recipe, "Accelerator", TwoRanks)
    config, backends = setup(tmp_path, caches, "ode_regression")
    with pytest.raises(ConfigError) as raised:
        recipe.distill(config, backends, reporter=RecordingReporter())
    assert [e.path for e in raised.value.errors] == ["num_processes"]
    assert not (tmp_path / "output" / "transformer").exists()
