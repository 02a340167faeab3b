"""Split training end to end: `simpletuner cache` (stage 1, two gloo ranks), then `simpletuner train` with
train_from_cache (stage 2) on a copy of the tiny Flux whose text encoders and tokenizers were deleted, against a
one-stage run of the same config. Real subprocesses, real accelerate launch, real files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_cli import SERIAL, losses, simpletuner

STEPS = 4


def write_split_run(tmp: Path, name: str, dataset: Path, **overrides) -> Path:
    """A config of the shipped example (tiny Flux, 12 sample images at 32 px) with its own output and caches, and a
    validation image at the end (cached prompt embedding, VAE decode)."""
    config = json.loads((REPO / "config" / "config.json").read_text())
    config.update({
        "--output_dir": str(tmp / name / "output"), "--data_backend_config": str(tmp / name / "multidatabackend.json"),
        "--max_train_steps": STEPS, "--lr_warmup_steps": 1, "--checkpointing_steps": 100,
        "--resume_from_checkpoint": None, "--validation_steps": STEPS, "--validation_prompt": "a red circle",
        "--validation_resolution": "32", "--validation_num_inference_steps": 2,
    })
    config.update({f"--{k}": v for k, v in overrides.items()})
    backends = json.loads((REPO / "config" / "multidatabackend.json").read_text())
    backends[0].update(instance_data_dir=str(dataset), resolution=32, cache_dir_vae=str(tmp / name / "cache" / "vae"))
    backends[1].update(cache_dir=str(tmp / name / "cache" / "text"))
    (tmp / name).mkdir(parents=True, exist_ok=True)
    (tmp / name / "multidatabackend.json").write_text(json.dumps(backends))
    (tmp / name / "config.json").write_text(json.dumps(config))
    return tmp / name / "config.json"


def private_tiny(tmp: Path, tiny_flux_path: Path) -> tuple[Path, dict]:
    """A copy of the tiny Flux in its own tiny root, and the environment that makes runs use it."""
    root = tmp / "tiny"
    shutil.copytree(tiny_flux_path, root / tiny_flux_path.name)
    return root / tiny_flux_path.name, {**SERIAL, "SIMPLETUNER_TINY_DIR": str(root)}


def manifest_of(config: Path) -> dict:
    return json.loads((config.parent / "cache" / "text" / "cache_manifest.json").read_text())


@pytest.fixture(scope="module")
def split(tmp_path_factory, tiny_flux_path):
    """A one-stage run; stage 1 on two ranks; the text encoders and tokenizers deleted; stage 2."""
    tmp = tmp_path_factory.mktemp("split")
    dataset = tmp / "sample"
    shutil.copytree(REPO / "datasets" / "sample", dataset)
    one = write_split_run(tmp, "one-stage", dataset)
    simpletuner("train", "--config", str(one), env=SERIAL)
    model, env = private_tiny(tmp, tiny_flux_path)
    two = write_split_run(tmp, "split", dataset)
    stage1 = simpletuner("cache", "--config", str(two), "--num_processes", "2", env=env)
    deleted = sorted(p.name for p in model.iterdir() if p.name.startswith(("text_encoder", "tokenizer")))
    for name in deleted:
        shutil.rmtree(model / name)
    stage2 = simpletuner("train", "--config", str(two), "--train_from_cache", env=env)
    return {"tmp": tmp, "dataset": dataset, "one": one, "two": two, "model": model, "env": env, "deleted": deleted,
            "stage1": stage1, "stage2": stage2}


def test_stage2_trains_without_text_encoders_to_the_one_stage_losses(split):
    assert split["deleted"] == ["text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"]
    one = losses(split["one"].parent / "output")
    two = losses(split["two"].parent / "output")
    assert sorted(two) == list(range(1, STEPS + 1))
    assert two == one  # bit for bit: the same latents, embeddings, LoRA init and noise
    summary = json.loads((split["two"].parent / "output" / "run_summary.json").read_text())
    assert summary["text_encoder_forwards"] == 0 and summary["vae_forwards"] == 0
    assert summary["latents_encoded"] == 0 and summary["captions_encoded"] == 0
    # validation used the cached prompt embedding and the VAE's decoder
    assert (split["two"].parent / "output" / "validation" / f"step_{STEPS}" / "validation_32x32.png").is_file()
    assert "12 samples from the cache manifest" in split["stage2"].stderr


def test_two_ranks_encode_every_file_exactly_once(split):
    manifest = manifest_of(split["two"])
    assert manifest["complete"] and manifest["world_size"] == 2
    samples = manifest["samples"]
    files = sorted(p.resolve() for p in split["dataset"].glob("*.png"))
    assert sorted(Path(s["path"]) for s in samples) == files  # none lost, none twice
    assert len({s["key"] for s in samples}) == len(files) == manifest["counts"]["latents"] == 12
    encoded = manifest["encoded"]
    by_rank = encoded["latents_by_rank"]
    assert set(by_rank) == {"0", "1"} and all(n > 0 for n in by_rank.values())
    assert sum(by_rank.values()) == len(files) and encoded["latents_encoded_twice"] == []
    assert sorted(s["encoded_by"] for s in samples) == [0] * by_rank["0"] + [1] * by_rank["1"]
    # every distinct caption and the validation prompt, each embedded by one rank
    captions = {p.with_suffix(".txt").read_text().strip() for p in files}
    assert set(manifest["captions"]) == captions | {"a red circle"}
    assert sum(encoded["captions_by_rank"].values()) == len(manifest["captions"])
    assert manifest["validation"]["prompts"] == ["a red circle"]
    # what the manifest proves against: encoder identities part by part, the data settings, per-file fingerprints
    assert any('"text_encoder_2"' in part for part in manifest["encoders"]["text"]["parts"])
    assert manifest["datasets"]["sample"]["resolution"] == 32 and "repeats" not in manifest["datasets"]["sample"]
    assert all(s["file_size"] > 0 and s["mtime_ns"] > 0 and s["caption"] for s in samples)


def test_stage2_refuses_a_cache_made_for_other_settings(split):
    env, two = split["env"], split["two"]
    proc = simpletuner("train", "--config", str(two), "--train_from_cache", "--tokenizer_max_length", "32",
                       env=env, check=False)
    assert proc.returncode == 1
    assert "does not match this config" in proc.stderr and "text encoders: 't5_len=32' in this config, 't5_len=" \
        in proc.stderr
    backends = json.loads((two.parent / "multidatabackend.json").read_text())
    backends[0]["resolution"] = 64
    other = two.parent / "other-resolution.json"
    other.write_text(json.dumps(backends))
    proc = simpletuner("train", "--config", str(two), "--train_from_cache", "--data_backend_config", str(other),
                       env=env, check=False)
    assert proc.returncode == 1 and "datasets[sample].resolution: 64 in this config, 32 when cached" in proc.stderr
    assert not (two.parent / "output" / "checkpoint-1").exists()


def test_stage2_refuses_a_stale_cache_naming_the_file(split, monkeypatch):
    """A caption edited after caching: an error naming the file and both captions, never training on the old one."""
    from simpletuner.config import load_data_backends, load_train_config
    from simpletuner.data.manifest import CacheManifestError
    from simpletuner.models.flux import FluxAdapter
    from simpletuner.training.split import load_cache

    monkeypatch.setenv("SIMPLETUNER_TINY_DIR", split["env"]["SIMPLETUNER_TINY_DIR"])
    loaded = load_train_config(str(split["two"]), overrides={"train_from_cache": True})
    backends = load_data_backends(loaded.config.data_backend_config, config=loaded.config)
    caption = split["dataset"] / "01_red_square.txt"
    before, stat = caption.read_text(), caption.stat()
    try:
        caption.write_text("a blue square")
        with pytest.raises(CacheManifestError) as info:
            load_cache(loaded.config, backends, FluxAdapter(loaded.config))
    finally:
        caption.write_text(before)
        os.utime(caption, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    message = str(info.value)
    assert "the cache is stale" in message and "01_red_square.png changed: caption 'a blue square' (cached:" in message
    # restored, the same cache is accepted again: every sample, from the manifest
    run = load_cache(loaded.config, backends, FluxAdapter(loaded.config))
    assert len(run.samples["sample"].samples) == 12


def test_stage2_needs_a_finished_manifest(split, monkeypatch, tmp_path):
    from simpletuner.config import load_data_backends, load_train_config
    from simpletuner.data.manifest import CacheManifestError, write_manifest
    from simpletuner.models.flux import FluxAdapter
    from simpletuner.training.split import load_cache

    monkeypatch.setenv("SIMPLETUNER_TINY_DIR", split["env"]["SIMPLETUNER_TINY_DIR"])
    manifest = tmp_path / "elsewhere.json"
    loaded = load_train_config(str(split["two"]), overrides={"train_from_cache": True, "cache_manifest": str(manifest)})
    backends = load_data_backends(loaded.config.data_backend_config, config=loaded.config)
    with pytest.raises(CacheManifestError, match=f"cache_manifest: {manifest} does not exist; run `simpletuner cache`"):
        load_cache(loaded.config, backends, FluxAdapter(loaded.config))
    write_manifest(manifest, {"complete": False})
    with pytest.raises(CacheManifestError, match="caching did not finish .*it resumes where it stopped"):
        load_cache(loaded.config, backends, FluxAdapter(loaded.config))
    manifest.write_text('{"format": 1, "complete": tr')
    with pytest.raises(CacheManifestError, match=f"{manifest} is damaged"):
        load_cache(loaded.config, backends, FluxAdapter(loaded.config))


def test_interrupted_caching_resumes_where_it_stopped(tmp_path, tiny_flux_path):
    """Stage 1 killed (SIGKILL) after its 5th latent: a stage 2 is refused meanwhile; the rerun encodes only the
    other 7, and the manifest says which run encoded what."""
    dataset = tmp_path / "sample"
    shutil.copytree(REPO / "datasets" / "sample", dataset)
    _, env = private_tiny(tmp_path, tiny_flux_path)
    config = write_split_run(tmp_path, "resume", dataset, vae_batch_size=2)
    killed = simpletuner("cache", "--config", str(config), env={**env, "SIMPLETUNER_FAILPOINT": "cache.latent:5"},
                         check=False)
    assert killed.returncode != 0
    assert json.loads((config.parent / "cache" / "text" / "cache_manifest.json").read_text())["complete"] is False
    proc = simpletuner("train", "--config", str(config), "--train_from_cache", env=env, check=False)
    assert proc.returncode == 1 and "caching did not finish" in proc.stderr
    simpletuner("cache", "--config", str(config), env=env)
    manifest = manifest_of(config)
    assert manifest["complete"] and manifest["encoded"]["latents_by_rank"] == {"0": 7}
    assert sorted(s["encoded_by"] is None for s in manifest["samples"]) == [False] * 7 + [True] * 5
