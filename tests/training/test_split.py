"""Split training's recipe in-process: stage 1 on a tiny Flux whose transformer cannot be built, the manifest it
writes, stage 2's checks of what validation needs, and the refusal of a split whose preprocessing trains."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from tests.helpers import CpuAccelerator, RecordingReporter, sample_run


def _setup(tmp: Path, **overrides):
    """A run with validation (a negative prompt too), eval loss and caption dropout; the sample dataset repeated."""
    values = {"validation_steps": 2, "validation_prompt": "a red circle", "validation_guidance_real": 2.0,
              "validation_negative_prompt": "blurry", "caption_dropout_probability": 0.1, **overrides}
    return sample_run(tmp, dataset={"repeats": 2}, **values)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory, tiny_flux_path):
    """Stage 1 in this process, on a copy of the tiny Flux whose transformer weights are garbage and whose
    transformer class counts its constructions."""
    from diffusers import FluxTransformer2DModel

    from simpletuner.training.split import cache

    tmp = tmp_path_factory.mktemp("stage1")
    model = tmp / "tiny" / tiny_flux_path.name
    shutil.copytree(tiny_flux_path, model)
    weights = sorted((model / "transformer").glob("*.safetensors"))
    for path in weights:
        path.write_bytes(b"not a safetensors file")
    (model / "transformer" / "config.json").write_text("{ not json")
    constructed = []
    original = FluxTransformer2DModel.__init__

    def counting(self, *args, **kwargs):
        constructed.append(type(self).__name__)
        original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SIMPLETUNER_TINY_DIR", str(tmp / "tiny"))
        mp.setattr(FluxTransformer2DModel, "__init__", counting)
        config, backends = _setup(tmp)
        result = cache(config, backends)
    return {"tmp": tmp, "model": model, "result": result, "constructed": constructed, "weights": weights,
            "manifest": json.loads(Path(result.manifest_path).read_text())}


def test_stage1_never_constructs_the_transformer(stage1):
    assert stage1["weights"] and stage1["constructed"] == []
    assert stage1["result"].vae_forwards > 0 and stage1["result"].text_encoder_forwards > 0


def test_stage1_caches_every_input_of_training_validation_and_eval(stage1):
    manifest, tmp = stage1["manifest"], stage1["tmp"]
    assert stage1["result"].manifest_path == str(tmp / "cache" / "text" / "cache_manifest.json")
    counts = manifest["counts"]
    # every file once (repeats: 2 are the sampler's business), the two eval images, both prompts
    assert counts["samples"] == counts["latents"] == 12 and counts["eval_samples"] == 2
    assert manifest["datasets"]["sample"].get("repeats") is None
    assert "" in manifest["captions"]  # caption dropout trains on the empty caption
    assert manifest["validation"] == {"prompts": ["a red circle"], "negative_prompts": ["blurry"], "references": []}
    summary = json.loads((tmp / "output" / "cache_summary.json").read_text())
    assert summary["cache_manifest"] == stage1["result"].manifest_path and summary["counts"] == counts


def _stage2(stage1, monkeypatch, **overrides):
    from simpletuner.models.flux import FluxAdapter
    from simpletuner.training.evaluator import Evaluator
    from simpletuner.training.split import load_cache

    monkeypatch.setenv("SIMPLETUNER_TINY_DIR", str(stage1["tmp"] / "tiny"))
    config, backends = _setup(stage1["tmp"], train_from_cache=True, **overrides)
    adapter = FluxAdapter(config)
    run = load_cache(config, backends, adapter)
    evaluator = Evaluator(config, backends, adapter, CpuAccelerator(), RecordingReporter(enabled=False),
                          trackers=None, samples=run.samples)
    return run, evaluator, config, backends, adapter


def test_stage2_reads_eval_samples_and_prompts_from_the_cache(stage1, monkeypatch):
    run, evaluator, config, backends, adapter = _stage2(stage1, monkeypatch)
    data = run.train_data(config, backends, adapter, evaluator)
    assert data.sampler.batches_per_epoch and data.text_identity == stage1["manifest"]["encoders"]["text"]["identity"]
    assert run.samples["sample"].repeats == 2  # repeats come from this config, the samples from the manifest
    items = evaluator.eval_items()  # eval latents and captions, from the cache alone
    assert len(items) == 2 and adapter.vae_forwards == adapter.text_encoder_forwards == 0
    assert evaluator.negative_embedding("blurry")["prompt_embeds"].shape[-1] == 32
    from simpletuner.models.base import EncoderNotLoaded

    with pytest.raises(EncoderNotLoaded, match="train_from_cache: the text encoders are never loaded"):
        evaluator.prompt_embedding("a prompt nobody cached")


def test_stage2_refuses_a_validation_prompt_stage1_did_not_cache(stage1, monkeypatch):
    from simpletuner.data.manifest import CacheManifestError

    run, evaluator, config, backends, adapter = _stage2(stage1, monkeypatch, validation_prompt="a green triangle")
    with pytest.raises(CacheManifestError, match="validation prompt 'a green triangle' \\(validation\\) was not cached"):
        run.train_data(config, backends, adapter, evaluator)


def test_stage2_without_the_vae_skips_validation_images_with_a_note(stage1, monkeypatch, caplog):
    vae = stage1["model"] / "vae"
    aside = stage1["tmp"] / "vae-aside"
    vae.rename(aside)
    try:
        run, evaluator, config, backends, adapter = _stage2(stage1, monkeypatch)
        with caplog.at_level(logging.WARNING, logger="simpletuner.evaluation"):
            run.train_data(config, backends, adapter, evaluator)
    finally:
        aside.rename(vae)
    assert not evaluator.validating and evaluator.evaluating  # eval loss needs no decoder
    assert "validation images are skipped: train_from_cache: the VAE decodes them" in caplog.text


def test_a_split_whose_preprocessing_trains_is_refused(stage1, monkeypatch):
    """No family here trains its text encoders (the config refuses it); one that did would list the part."""
    from simpletuner.config import ConfigError
    from simpletuner.models.flux import FluxAdapter
    from simpletuner.training.split import cache, load_cache

    monkeypatch.setenv("SIMPLETUNER_TINY_DIR", str(stage1["tmp"] / "tiny"))
    monkeypatch.setattr(FluxAdapter, "trainable_preprocessing",
                        lambda self: ["text encoder 2 (train_text_encoder)"])
    config, backends = _setup(stage1["tmp"], train_from_cache=True)
    with pytest.raises(ConfigError, match=r"train_from_cache: split training encodes the inputs once, before "
                                          r"training, and in this run text encoder 2 \(train_text_encoder\) trains"):
        load_cache(config, backends, FluxAdapter(config))
    with pytest.raises(ConfigError, match="model_family: .*text encoder 2 .* trains"):
        cache(config, backends)


def test_identity_differences_name_the_part_and_forgive_deleted_folders():
    from simpletuner.data.manifest import identity_differences

    cached = [json.dumps(["flux", "/m", "text_encoder", "", "abc"]), "t5_len=512", "precision=['no_change']"]
    gone = [json.dumps(["flux", "/m", "text_encoder", "", ""]), "t5_len=512", "precision=['no_change']"]
    assert identity_differences("text encoders", cached, gone) == []  # the folder was deleted after stage 1
    other = [json.dumps(["flux", "/n", "text_encoder", "", "abd"]), "t5_len=256", "precision=['int8-quanto']"]
    assert identity_differences("text encoders", cached, other) == [
        "text encoders: text_encoder: path '/n' (cached: '/m'), config 'abd' (cached: 'abc')",
        "text encoders: 't5_len=256' in this config, 't5_len=512' when cached",
        "text encoders: \"precision=['int8-quanto']\" in this config, \"precision=['no_change']\" when cached",
    ]


def test_sample_records_round_trip_with_their_pairs():
    from simpletuner.data.discovery import Sample
    from simpletuner.data.manifest import sample_from_record, sample_record

    mask = Sample("masks", "/d/m/a.png", "", (32, 32), (40, 32), (4, 0, 36, 32), file_size=3, mtime_ns=4)
    sample = Sample("pics", "/d/a.png", "a cat", (32, 32), (40, 32), (4, 0, 36, 32), file_size=1, mtime_ns=2,
                    frame_indices=(0, 1, 2), original_size=(50, 40), mask=mask)
    assert sample_from_record(json.loads(json.dumps(sample_record(sample)))) == sample


def test_stage2_refuses_eval_loss_on_eval_samples_stage1_did_not_cache(stage1, monkeypatch, tmp_path):
    from simpletuner.data.manifest import CacheManifestError, write_manifest
    from simpletuner.models.flux import FluxAdapter
    from simpletuner.training.split import load_cache

    manifest = {k: v for k, v in stage1["manifest"].items() if k not in ("format", "written_at")}
    manifest["eval_samples"] = []  # as stage 1 writes it when eval loss is off
    path = tmp_path / "no-eval.json"
    write_manifest(path, manifest)
    monkeypatch.setenv("SIMPLETUNER_TINY_DIR", str(stage1["tmp"] / "tiny"))
    config, backends = _setup(stage1["tmp"], train_from_cache=True, cache_manifest=str(path))
    with pytest.raises(CacheManifestError, match=r"datasets\[held-out\]: its eval samples were not cached"):
        load_cache(config, backends, FluxAdapter(config))
