"""Every quickstart example (``config/examples/<name>/``: one per family, named after it, plus its edit flavours'
such as ``kontext``) trained by ``simpletuner train`` on each of its family's tiny flavours (Wan's T2V, I2V and 2.2
experts) in a real subprocess: the loss on a fixed batch of the training images falls, a run resumed from its
checkpoint continues bit for bit, and the exported LoRA changes what the family's pipeline generates (from the batch's
reference image, for an edit model; from the first frame, for an image-to-video model).

The examples are meant for real weights on a GPU; the only overrides are the ones the tiny flavour on a CPU needs:
``model_flavour=tiny`` (or ``tiny-<variant>``), fp32 (``mixed_precision=no``), a small dataset resolution and short
validation, a few steps; a video family's example (its row's ``modality``) trains on datasets/sample_video with short
clips and must also write a validation mp4 of the expected frame count.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from simpletuner.config import family_names, get_family
from tests.conftest import REPO

pytestmark = pytest.mark.e2e  # hang guard: tests/conftest.py (a tiny Qwen-Image-Edit case took 893 s on a slow machine)
STEPS, RESUME_AT = 6, 3


def simpletuner_train(config: Path, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    sets = [arg for item in overrides for arg in ("--set", item)]
    proc = subprocess.run([sys.executable, "-m", "simpletuner.cli", "train", "--config", str(config), *sets],
                          capture_output=True, text=True, cwd=cwd, timeout=1500,
                          # one intra-op thread: float reductions run in one order, so runs compare bit for bit
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def logged_losses(output: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, (output / "training_log.jsonl").read_text().splitlines())}


EXAMPLES = REPO / "config" / "examples"


def example_family(name: str) -> str:
    return json.loads((EXAMPLES / name / "config.json").read_text())["--model_family"]


def test_every_family_and_edit_flavour_has_an_example():
    from simpletuner.config import get_family

    examples = {p.name for p in EXAMPLES.iterdir() if p.is_dir()}
    assert set(family_names()) <= examples
    for name in examples:
        assert (EXAMPLES / name / "config.json").is_file() and (EXAMPLES / name / "multidatabackend.json").is_file()
    flavours = {json.loads((EXAMPLES / n / "config.json").read_text()).get("--model_flavour") for n in examples}
    assert all(f in flavours for name in family_names() for f in get_family(name).reference_flavours)


def example_in(work: Path, name: str, resolution: int, frames: int | None = None) -> Path:
    """A copy of the example and the datasets it reads, as a user would run it from a checkout (relative paths),
    at ``resolution`` (and clips of ``frames`` frames for a video family)."""
    target = work / "config" / "examples" / name
    shutil.copytree(EXAMPLES / name, target)
    backends = json.loads((target / "multidatabackend.json").read_text())
    for entry in backends:
        folder = entry.get("instance_data_dir")
        if folder:
            top = Path(*Path(folder).parts[:2])  # datasets/<name>
            if not (work / top).exists():
                shutil.copytree(REPO / top, work / top)
        if entry.get("dataset_type", "image") in ("image", "video", "eval"):
            entry.update(resolution=resolution, resolution_type="pixel", repeats=0)
        if frames is not None and entry.get("dataset_type", "image") != "text_embeds":
            assert entry.get("dataset_type") != "image" or entry.get("video"), \
                f"config/examples/{name}: a video family's example should train on a video dataset"
            entry["video"] = {**entry.get("video", {}), "num_frames": frames, "min_frames": frames, "frame_rate": 8}
    (target / "multidatabackend.json").write_text(json.dumps(backends, indent=2))
    return target / "config.json"


def example_cases(modality: str) -> list[tuple[str, str]]:
    """(example, tiny flavour): every example of a family of ``modality`` ("image" or "video") on each tiny flavour
    of its family (Wan has one per architecture: T2V, I2V, 2.2's high- and low-noise experts). The video cases run
    from tests/e2e/test_video_families_e2e.py: a file of their own, so the two test workers share the examples."""
    from simpletuner.config.families import tiny_flavours

    return [(name, flavour) for name in sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
            if get_family(example_family(name)).modality == modality
            for flavour in tiny_flavours(get_family(example_family(name)))]


def case_ids(cases: list[tuple[str, str]]) -> list[str]:
    return [n if f == "tiny" else f"{n}[{f}]" for n, f in cases]


def test_every_example_is_a_case():
    from simpletuner.config.families import tiny_flavours

    cases = example_cases("image") + example_cases("video")
    assert len(cases) == len(set(cases)) == sum(len(tiny_flavours(get_family(example_family(p.name))))
                                                for p in EXAMPLES.iterdir() if p.is_dir())


@pytest.mark.parametrize("example,flavour", example_cases("image"), ids=case_ids(example_cases("image")))
def test_example_trains_resumes_and_changes_the_pipeline(example, flavour, tmp_path, monkeypatch):
    check_example(example, flavour, tmp_path, monkeypatch)


def check_example(example: str, flavour: str, tmp_path: Path, monkeypatch) -> None:
    from simpletuner.config import load_train_config
    from simpletuner.models.base import TextEmbedding
    from simpletuner.models.registry import get_adapter_class

    family = example_family(example)
    adapter_cls = get_adapter_class(family)
    size = 4 * adapter_cls.resolution_multiple
    video = get_family(family).modality == "video"
    frames = adapter_cls.temporal_compression + 1 if video else None  # two latent frames
    config = example_in(tmp_path, example, size, frames)
    common = [f"model_flavour={flavour}", "mixed_precision=no", "lr_warmup_steps=0", "learning_rate=5e-3",
              f"max_train_steps={STEPS}", f"checkpointing_steps={RESUME_AT}", "checkpoints_total_limit=",
              "resume_from_checkpoint=", f"validation_resolution={size}", "validation_num_inference_steps=2",
              "lora_dropout=0", "seed=7"]
    if video:
        common += [f"validation_num_video_frames={frames}"]
    out = tmp_path / "output" / family
    first = simpletuner_train(config, tmp_path, *common, f"output_dir={out}")
    assert "Training" in first.stderr
    full = logged_losses(out)
    assert sorted(full) == list(range(1, STEPS + 1))
    if video:  # the final validation wrote an mp4 that decodes to the frames asked for, and its poster frame
        import av

        mp4s = sorted((out / "validation" / f"step_{STEPS}").glob("*.mp4"))
        assert mp4s and mp4s[0].with_suffix(".png").is_file(), list((out / "validation").rglob("*"))
        with av.open(str(mp4s[0])) as container:
            decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(decoded) == frames and decoded[0].shape == (size, size, 3)

    # resume: training again from checkpoint-3 continues exactly as the first run went on (in this process, on
    # one thread like the subprocess, to keep the suite fast; tests/e2e/test_train_cli.py resumes through the CLI)
    from simpletuner.config import load_data_backends
    from simpletuner.training.trainer import train

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / f"checkpoint-{RESUME_AT}", resumed / f"checkpoint-{RESUME_AT}")
    monkeypatch.chdir(tmp_path)  # the example's paths are relative to where it runs
    overrides = dict(item.split("=", 1) for item in common)
    overrides.update(output_dir=str(resumed), resume_from_checkpoint="latest")
    cfg = load_train_config(config, overrides=overrides).config
    backends = load_data_backends(cfg.data_backend_config, config=cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train(cfg, backends)
    finally:
        torch.set_num_threads(threads)
    assert result.losses == [full[s] for s in range(RESUME_AT + 1, STEPS + 1)]
    assert result.latents_encoded == 0 and result.captions_encoded == 0  # the caches were warm

    # the exported LoRA, loaded into the family's pipeline (its edit pipeline for an edit model) as users load it
    adapter = adapter_cls(cfg, references=backends.uses_references)
    pipe = adapter.load_pipeline(adapter.ensure_tiny_checkpoint())
    pipe.set_progress_bar_config(disable=True)
    denoiser = getattr(pipe, adapter.denoiser_subfolder).eval()

    # a fixed batch of the training images (with their references), fixed noise, fixed timesteps
    from simpletuner.data.discovery import discover, load_pixels, with_pairs

    dataset = backends.image_datasets[0]
    samples = with_pairs(backends, dataset, discover(dataset, cfg, adapter.resolution_multiple,
                                                     temporal_compression=adapter.temporal_compression).samples)
    by_size: dict = {}
    for s in samples:
        by_size.setdefault(s.target_size, []).append(s)
    batch = max(by_size.values(), key=len)[:4]

    # what the latent cache holds: the latents, and what a family conditions on from the same pixels (Wan I2V)
    entries = adapter.latent_cache_entries(torch.stack([load_pixels(s) for s in batch]))
    latents = torch.stack([e["latents"] for e in entries])
    references = [load_pixels(s.conditioning) for s in batch] if adapter.references else None
    # an edit model whose text encoder sees the reference encodes each caption with it
    text = TextEmbedding.collate(adapter.encode_text([s.caption for s in batch],
                                                     references if adapter.prompt_takes_reference else None))
    text.update({k: torch.stack([e[k] for e in entries]) for k in entries[0] if k != "latents"})
    text.update(adapter.sample_conditioning(batch))
    if references is not None:
        text.update(reference_latents=adapter.encode_references(torch.stack(references)),
                    reference_pixels=torch.stack(references))
    objective = adapter.objective
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(1))
    levels = objective.eval_timesteps()
    covered = levels[[objective.covers(level.reshape(1)) for level in levels]]  # a 2.2 expert trains part of them
    t = (levels[torch.linspace(1, len(levels) - 2, len(batch)).round().long()] if len(covered) == len(levels)
         else covered[torch.arange(len(batch)) % len(covered)])

    def fixed_batch_loss() -> float:
        with torch.no_grad():
            pred = adapter.predict(denoiser, objective.add_noise(latents, noise, t), t, text)
        return objective.loss(pred, objective.target(latents, noise, t), t).item()

    def generate():
        one = {k: v[:1] for k, v in text.items()}
        kwargs = adapter.validation_pipeline_kwargs(one, None, guidance=1.0, guidance_real=1.0)
        kwargs.update(adapter.validation_conditioning(one, size, size))  # I2V: the first frame to animate
        out = pipe(**adapter.pipeline_call_kwargs(height=size, width=size, num_frames=frames), num_inference_steps=2,
                   generator=torch.Generator().manual_seed(0), output_type="np", **kwargs)
        return torch.as_tensor(out.frames if video else out.images)

    before, image_before = fixed_batch_loss(), generate()
    adapter.load_lora(pipe, out)
    after, image_after = fixed_batch_loss(), generate()
    assert after < before, (before, after)
    assert (image_after - image_before).abs().max().item() > 1e-3
