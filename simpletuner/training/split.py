"""Split training: stage 1 encodes everything once and writes a manifest; stage 2 trains from it alone.

DiffSynth-Studio's ``--task sft:data_process`` then ``--task sft:train``; SimpleTuner itself has no split (it caches
inside the training run, as our one-stage ``simpletuner train`` does).

Stage 1, ``simpletuner cache --config F`` (``cache`` below): loads only the VAE and the text encoders (a family's
frozen conditioning encoder, such as Wan I2V's CLIP image encoder, runs inside its latent encoding), never the
denoiser; encodes every sample once (repeats ignored), its reference image and loss mask, the eval datasets, the
validation prompts, the negative prompt and the validation reference images; then writes the cache manifest
(``simpletuner.data.manifest``). Under ``accelerate launch`` each rank encodes its share of every distinct entry;
an interrupted run resumes, since each entry is written atomically and a rerun skips what is cached.

Stage 2, ``simpletuner train`` with ``train_from_cache: true`` (``load_cache`` below, in place of the trainer's
caching step): reads the manifest, proves it was made for this config (encoder identities, data settings, the
files' fingerprints where they are on this machine, every cache entry present), and trains from it. No text
encoder or VAE encoder is loaded, and their files need not be on disk; validation decodes with the VAE, loaded at
the first validation (or, when its weights are not here, skips the images with a warning).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed

from simpletuner.config import ConfigError
from simpletuner.config.files import write_json
from simpletuner.config.split import cache_manifest_path
from simpletuner.data import manifest as mf
from simpletuner.data.cache import (TensorCache, fill_latent_cache, fill_mask_cache, fill_text_cache, latent_key,
                                    mask_key, negative_identity, text_key)
from simpletuner.data.discovery import DatasetSamples, discover, with_pairs
from simpletuner.evaluation.trackers import Trackers
from simpletuner.models.registry import create_adapter
from simpletuner.models.weights import WeightLoadError, check_weight_sources
from simpletuner.training import failpoints
from simpletuner.training.evaluator import Evaluator
from simpletuner.training.paths import check_run_paths
from simpletuner.training.trainer import (TrainData, cache_sets, discover_datasets, drop_unreadable, training_captions,
                                          run_reported, vae_caches_of, weight_dtype_for)
from simpletuner.training.webhooks import WebhookReporter

log = logging.getLogger("simpletuner.split")
SUMMARY = "cache_summary.json"


def refuse_trainable_preprocessing(adapter, field: str) -> None:
    """Split training caches the preprocessing before training starts; a part of it that trains cannot be."""
    parts = adapter.trainable_preprocessing()
    if parts:
        raise ConfigError([(field, f"split training encodes the inputs once, before training, and in this run "
                                   f"{', '.join(parts)} {'trains' if len(parts) == 1 else 'train'}, so its outputs "
                                   "change as training runs; train in one stage (train_from_cache: false, no "
                                   "`simpletuner cache`)")])
    if adapter.prompt_takes_reference:
        raise ConfigError([(field, f"model_flavour {adapter.config.model_flavour!r} of {adapter.config.model_family} "
                                   "encodes each caption together with its reference image, which split training "
                                   "does not cache yet; train in one stage (train_from_cache: false, no "
                                   "`simpletuner cache`)")])


def _settings(config, backends) -> dict:
    """The data settings the cache was made with: each dataset's (with the defaults it falls back on filled in) and
    the text-embeds cache folder."""
    datasets = {}
    for b in backends.datasets:
        values = mf.dataset_settings(b)
        values["resolution"] = b.resolution or config.resolution
        values["resolution_type"] = b.resolution_type or config.resolution_type
        datasets[b.id] = values
    return {"datasets": datasets, "text_embeds": {"cache_dir": backends.text_embeds.cache_dir}}


def manifest_path(config, backends) -> str:
    """Where this config's cache manifest lives (``cache_manifest``, or beside the text embeddings)."""
    return cache_manifest_path(config.cache_manifest, backends.text_embeds.cache_dir)


def _model(config) -> dict:
    return {"model_family": config.model_family, "model_flavour": config.model_flavour}


# ---------------------------------------------------------------------------------------------------------------
# stage 1
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class CacheResult:
    manifest_path: str
    counts: dict[str, int]
    latents_encoded: int = 0  # by this process (masks and references included)
    captions_encoded: int = 0
    vae_forwards: int = 0
    text_encoder_forwards: int = 0


def preflight_cache(config, adapter, device: torch.device) -> None:
    """What stage 1 needs, checked before anything is encoded: the encoders' packages, their device settings and
    their weights (the denoiser's side is stage 2's business, possibly on another machine)."""
    from simpletuner.config.requirements import device_errors, missing_packages

    errors = [e for e in missing_packages(config.__dict__) + device_errors(config.__dict__, device.type)
              if e.path.startswith(("text_encoder_", "enable_model_cpu_offload"))]
    if errors:
        raise ConfigError(errors)
    adapter.check_weights(encoders_only=True)


def cache(config, backends, *, reporter: WebhookReporter | None = None) -> CacheResult:
    """Stage 1: encode what ``config`` trains and validates on, and write the cache manifest; returns where it is
    and what this process encoded."""
    check_run_paths(config, backends)
    reporter = reporter or WebhookReporter.from_env(getattr(config, "webhook_config", None))
    accelerator = Accelerator()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.seed is not None:
        set_seed(config.seed)
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    shard = (rank, world)
    show = accelerator.is_local_main_process
    adapter = create_adapter(config, device=accelerator.device,
                             weight_dtype=weight_dtype_for(config, accelerator.device),
                             references=backends.uses_references)
    refuse_trainable_preprocessing(adapter, "model_family")
    preflight_cache(config, adapter, accelerator.device)
    path = manifest_path(config, backends)
    started = time.time()
    if main:
        reporter.status("running")
        log.info("caching with %d process(es); manifest %s", world, path)

    _, datasets = discover_datasets(config, backends, adapter)
    no_trackers = Trackers(config.model_copy(update={"report_to": "none"}))
    evaluator = Evaluator(config, backends, adapter, accelerator, reporter, trackers=no_trackers)
    if main:  # a stage 2 started before this run finishes (or after it was killed) is told so
        mf.write_manifest(path, {"complete": False, "started_at": started, "model": _model(config),
                                 "world_size": world})
    accelerator.wait_for_everyone()

    vae_caches = vae_caches_of(backends)
    latent_sets, reference_sets, mask_sets = cache_sets([s for ds in datasets for s in ds.samples], vae_caches)
    eval_caches = {**vae_caches, **{b.id: TensorCache(b.cache_dir_vae) for b in backends.eval_datasets}}
    eval_sets, eval_references, eval_masks = cache_sets(evaluator.eval_samples(), eval_caches)
    for folder, items in eval_masks.items():
        mask_sets.setdefault(folder, []).extend(items)
    for folder, items in eval_references.items():
        reference_sets.setdefault(folder, []).extend(items)
    encoded: list[str] = []

    def saved(key: str) -> None:
        encoded.append(key)
        failpoints.hit("cache.latent", len(encoded))  # crash drills: an interrupted run resumes

    unreadable: list = []
    latents = fill_latent_cache(latent_sets, adapter, config.vae_batch_size, show_progress=show,
                                unreadable=unreadable, shard=shard, on_saved=saved)
    latents += fill_latent_cache(eval_sets, adapter, config.vae_batch_size, show_progress=show, shard=shard,
                                 on_saved=saved)
    latents += fill_latent_cache(reference_sets, adapter, config.vae_batch_size, show_progress=show,
                                 unreadable=unreadable, references=True, shard=shard, on_saved=saved)
    if mask_sets:
        latents += fill_mask_cache(mask_sets, adapter.vae_scale_factor, show_progress=show, shard=shard)
    references = evaluator.reference_samples()
    for item in evaluator.prompts if main and references else []:  # a few images: the main process encodes them
        for width, height in evaluator.resolutions:
            evaluator.reference_latents(item, width, height)
    vae_scale_factor = adapter.vae_scale_factor
    if config.offload_during_startup:
        adapter.unload_vae()  # the text encoders load next

    text_cache = TensorCache(backends.text_embeds.cache_dir)
    batch = backends.text_embeds.write_batch_size
    outcome = {"rank": rank, "unreadable": [(s.path, reason) for s, reason in unreadable]}
    gathered = gather_object([outcome])  # every rank drops the same unreadable files before embedding captions
    drop_unreadable(datasets, [pair for o in gathered for pair in o["unreadable"]])
    captions = training_captions(config, datasets, adapter)[0] + evaluator.captions()
    text = fill_text_cache(captions, adapter, text_cache, batch, show_progress=show, shard=shard)
    text += fill_text_cache(evaluator.negative_prompts(), adapter, text_cache, batch, show_progress=show,
                            negative=True, shard=shard)
    adapter.unload_encoders()

    outcome = {"rank": rank, "latents": encoded, "latent_entries": latents, "captions": text,
               "vae_forwards": adapter.vae_forwards, "text_encoder_forwards": adapter.text_encoder_forwards}
    gathered = gather_object([outcome])
    accelerator.wait_for_everyone()  # every entry is written
    counts: dict[str, int] = {}
    if main:
        manifest = _manifest(config, backends, adapter, evaluator, datasets, captions, references, vae_scale_factor,
                             gathered, started, world)
        counts = manifest["counts"]
        mf.write_manifest(path, manifest)
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(config.output_dir) / SUMMARY, {"cache_manifest": path, "counts": counts,
                                                      "encoded": manifest["encoded"]})
        log.info("cache manifest %s: %s", path, ", ".join(f"{v} {k}" for k, v in counts.items()))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return CacheResult(path, counts, latents, text, adapter.vae_forwards, adapter.text_encoder_forwards)


def _manifest(config, backends, adapter, evaluator, datasets, captions, references, vae_scale_factor, gathered,
              started, world) -> dict:
    """The finished manifest; raises if an entry it lists is not in the cache (it never says more than is there)."""
    encoded_by = {key: o["rank"] for o in gathered for key in o["latents"]}
    times = Counter(key for o in gathered for key in o["latents"])
    vae_identity, text_identity = adapter.vae_cache_identity(), adapter.text_cache_identity()
    reference_identity = adapter.reference_cache_identity()
    caches = vae_caches_of(backends)
    text_cache = TensorCache(backends.text_embeds.cache_dir)
    missing: list[str] = []

    def record(sample, cache: TensorCache) -> dict:
        key = latent_key(sample, vae_identity)
        if not cache.has(key):
            missing.append(f"{sample.path} ({cache.path(key)})")
        out = mf.sample_record(sample)
        out["key"], out["encoded_by"] = key, encoded_by.get(key)
        for name in ("conditioning", "mask"):
            pair = getattr(sample, name)
            if pair is not None:
                pair_cache = caches[pair.dataset_id]
                pair_key = (latent_key(pair, reference_identity) if name == "conditioning"
                            else mask_key(pair, vae_scale_factor))
                if not pair_cache.has(pair_key):
                    missing.append(f"{pair.path} ({pair_cache.path(pair_key)})")
                out[name]["key"] = pair_key
        return out

    samples = [record(s, caches[s.dataset_id]) for ds in datasets for s in ds.samples]
    eval_samples = [record(s, TensorCache(b.cache_dir_vae)) for b, ds in evaluator.eval_datasets
                    for s in ds.samples] if evaluator.evaluating else []
    prompts = [p.prompt for p in evaluator.prompts] if evaluator.validating else []
    negatives = evaluator.negative_prompts()
    texts = [(c, text_identity) for c in sorted(set(captions))]
    texts += [(c, negative_identity(text_identity)) for c in negatives]
    missing += [f"caption {c!r} ({text_cache.path(text_key(c, i))})" for c, i in texts
                if not text_cache.has(text_key(c, i))]
    reference_records = []
    for sample in references:
        key = latent_key(sample, reference_identity)
        if not text_cache.has(key):
            missing.append(f"{sample.path} ({text_cache.path(key)})")
        reference_records.append({**mf.sample_record(sample), "key": key})
    if missing:
        raise RuntimeError(f"caching finished but {len(missing)} entries are not in the cache: {missing[:5]}")
    skipped = {ds.dataset_id: [list(item) for item in ds.skipped] for ds in datasets}
    counts = {
        "samples": len(samples), "files": len({s["path"] for s in samples}),
        "latents": len({s["key"] for s in samples}),
        "references": sum(s["conditioning"] is not None for s in samples),
        "masks": sum(s["mask"] is not None for s in samples),
        "captions": len(set(captions)), "validation_prompts": len(prompts), "negative_prompts": len(negatives),
        "validation_references": len(reference_records), "eval_samples": len(eval_samples),
        "skipped": sum(len(v) for v in skipped.values()),
    }
    return {
        "complete": True, "started_at": started, "finished_at": time.time(), "world_size": world,
        "model": _model(config),
        "encoders": {"vae": {"identity": vae_identity, "parts": adapter.vae_identity_parts(),
                             "scale_factor": vae_scale_factor, "reference_identity": reference_identity},
                     "text": {"identity": text_identity, "parts": adapter.text_identity_parts()}},
        **_settings(config, backends),
        "samples": samples, "skipped": skipped, "captions": sorted(set(captions)),
        "validation": {"prompts": prompts, "negative_prompts": negatives, "references": reference_records},
        "eval_samples": eval_samples, "counts": counts,
        "encoded": {"latents_by_rank": {str(o["rank"]): len(o["latents"]) for o in gathered},
                    "latents_encoded_twice": sorted(key for key, n in times.items() if n > 1),
                    "entries_by_rank": {str(o["rank"]): o["latent_entries"] for o in gathered},
                    "captions_by_rank": {str(o["rank"]): o["captions"] for o in gathered},
                    "vae_forwards_by_rank": {str(o["rank"]): o["vae_forwards"] for o in gathered},
                    "text_encoder_forwards_by_rank": {str(o["rank"]): o["text_encoder_forwards"] for o in gathered}},
    }


def run_cache(config, backends) -> int:
    """Stage 1 with its outcome reported to the webhooks; returns a process exit code."""
    return run_reported(cache, config, backends, lambda result: dict(
        cache_manifest=result.manifest_path, output_dir=config.output_dir,
        **{f"cached_{k}": v for k, v in result.counts.items()}))


# ---------------------------------------------------------------------------------------------------------------
# stage 2
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class CachedRun:
    """A manifest checked against the run's config: its samples by dataset id (training and eval), ready to train."""

    path: str
    manifest: dict
    samples: dict[str, DatasetSamples] = field(default_factory=dict)

    def train_data(self, config, backends, adapter, evaluator: Evaluator) -> TrainData:
        """The run's TrainData from the cache; checks that what ``evaluator`` needs (validation prompts, the
        negative prompt, reference images) was cached, and that the VAE is here to decode validation images."""
        from simpletuner.data.sampler import BucketBatchSampler

        self._check_validation(evaluator, adapter, backends)
        datasets = [self.samples[b.id] for b in backends.image_datasets]
        for backend, ds in zip(backends.image_datasets, datasets):
            log.info("datasets[%s]: %d samples from the cache manifest (repeats=%d)", backend.id, len(ds.samples),
                     ds.repeats)
        encoders = self.manifest["encoders"]
        return TrainData(BucketBatchSampler(datasets, config.train_batch_size, config.seed or 0),
                         vae_caches_of(backends), TensorCache(backends.text_embeds.cache_dir),
                         encoders["vae"]["identity"], encoders["text"]["identity"],
                         skipped={ds.dataset_id: len(ds.skipped) for ds in datasets},
                         vae_scale_factor=int(encoders["vae"]["scale_factor"]),
                         reference_identity=encoders["vae"].get("reference_identity", encoders["vae"]["identity"]))

    def _check_validation(self, evaluator: Evaluator, adapter, backends) -> None:
        where = f"cache_manifest {self.path}"
        cached = self.manifest["validation"]
        problems = []
        if evaluator.validating:
            problems += [f"validation prompt {p.prompt!r} ({p.nickname}) was not cached" for p in evaluator.prompts
                         if p.prompt not in cached["prompts"]]
        problems += [f"the negative prompt {p!r} was not cached" for p in evaluator.negative_prompts()
                     if p not in cached["negative_prompts"]]
        keys = {r["key"] for r in cached["references"]}
        identity = self.manifest["encoders"]["vae"].get("reference_identity", adapter.vae_cache_identity())
        problems += [f"validation reference image {s.path} at {s.target_size[0]}x{s.target_size[1]} was not cached"
                     for s in evaluator.reference_samples() if latent_key(s, identity) not in keys]
        if problems:
            raise mf.CacheManifestError(f"{where}: " + "; ".join(problems) + "; run `simpletuner cache` with this "
                                        "config again")
        if evaluator.validating:
            try:
                check_weight_sources([adapter.vae_weights()])
            except WeightLoadError as exc:
                evaluator.disable_images(f"train_from_cache: the VAE decodes them, and {exc}")


def load_cache(config, backends, adapter) -> CachedRun:
    """Stage 2: the manifest of ``config``, checked against it; CacheManifestError naming the file and every
    difference (encoders, data settings, changed files, missing entries) when the cache was made for something
    else. Sets ``adapter`` to the cached identities."""
    refuse_trainable_preprocessing(adapter, "train_from_cache")
    path = manifest_path(config, backends)
    manifest = mf.read_manifest(path)
    where = f"cache_manifest {path}"
    again = "run `simpletuner cache` with this config again (it encodes only what changed)"
    problems = mf.setting_differences("model", manifest["model"], _model(config))
    encoders = manifest["encoders"]
    problems += mf.identity_differences("VAE", encoders["vae"]["parts"], adapter.vae_identity_parts())
    problems += mf.identity_differences("text encoders", encoders["text"]["parts"], adapter.text_identity_parts())
    settings = _settings(config, backends)
    problems += mf.setting_differences("text_embeds", manifest["text_embeds"], settings["text_embeds"])
    for dataset_id, values in settings["datasets"].items():
        if dataset_id not in manifest["datasets"]:
            problems.append(f"datasets[{dataset_id}]: not in the cache (added after caching)")
        else:
            problems += mf.setting_differences(f"datasets[{dataset_id}]", manifest["datasets"][dataset_id], values)
    for dataset_id in set(manifest["datasets"]) - set(settings["datasets"]):
        log.warning("%s: datasets[%s] was cached and is not in this config: it is left out", where, dataset_id)
    if config.caption_dropout_probability and "" not in manifest["captions"]:
        problems.append("caption_dropout_probability: the empty caption was not cached (caption dropout was off "
                        "when caching)")
    cached_eval = {r["dataset_id"] for r in manifest["eval_samples"]}
    if config.eval_steps_interval or config.validation_steps:  # the run measures eval loss on its eval datasets
        problems += [f"datasets[{b.id}]: its eval samples were not cached (eval loss was off when caching: "
                     "eval_steps_interval and validation_steps were empty)"
                     for b in backends.eval_datasets if b.id not in cached_eval]
    if problems:
        raise mf.CacheManifestError(f"{where} does not match this config; {again}:\n  " + "\n  ".join(problems))

    adapter.use_cached_identities(encoders["vae"]["identity"], encoders["text"]["identity"],
                                  encoders["vae"]["scale_factor"])
    run = CachedRun(path, manifest)
    by_dataset: dict[str, list] = {}
    for record in manifest["samples"] + manifest["eval_samples"]:
        by_dataset.setdefault(record["dataset_id"], []).append(record)
    for backend in backends.image_datasets + backends.eval_datasets:
        records = by_dataset.get(backend.id, [])
        skipped = [tuple(item) for item in manifest["skipped"].get(backend.id, [])]
        run.samples[backend.id] = DatasetSamples(backend.id, [mf.sample_from_record(r) for r in records], skipped,
                                                 repeats=backend.repeats, probability=backend.probability)
    problems = _stale(config, backends, adapter, run) + _missing_entries(config, backends, run)
    if problems:
        raise mf.CacheManifestError(f"{where}: the cache is stale; {again}:\n  " + "\n  ".join(problems))
    return run


def _stale(config, backends, adapter, run: CachedRun) -> list[str]:
    """Files that changed since caching (added, gone, edited, another caption), for every dataset whose folders
    are on this machine (on another machine the manifest's fingerprints stand)."""
    problems = []
    skipped = {path for items in run.manifest["skipped"].values() for path, _ in items}
    for backend in backends.image_datasets + backends.eval_datasets:
        folders = [backend] + [backends.paired(backend, kind) for kind in ("conditioning", "mask")]
        if not all(Path(b.instance_data_dir).expanduser().is_dir() for b in folders if b is not None):
            log.info("datasets[%s]: %s is not on this machine; training from the manifest's %d samples as cached",
                     backend.id, backend.instance_data_dir, len(run.samples[backend.id].samples))
            continue
        found = discover(backend, config, adapter.resolution_multiple, temporal_compression=adapter.temporal_compression)
        now = {(s.path, s.frame_indices): mf.sample_record(s) for s in with_pairs(backends, backend, found.samples)
               if s.path not in skipped}
        then = {(s.path, s.frame_indices): mf.sample_record(s) for s in run.samples[backend.id].samples}
        changes = [f"{key[0]} is new" for key in sorted(set(now) - set(then), key=str)]
        changes += [f"{key[0]} is gone" for key in sorted(set(then) - set(now), key=str)]
        for key in sorted(set(now) & set(then), key=str):
            fields = [name for name in now[key] if now[key][name] != then[key][name]]
            if fields:
                shown = ", ".join(f"caption {now[key]['caption']!r} (cached: {then[key]['caption']!r})"
                                  if name == "caption" else name for name in fields)
                changes.append(f"{key[0]} changed: {shown}")
        if changes:
            more = f" (and {len(changes) - 5} more)" if len(changes) > 5 else ""
            problems.append(f"datasets[{backend.id}]: {'; '.join(changes[:5])}{more}")
    return problems


def _missing_entries(config, backends, run: CachedRun) -> list[str]:
    """Cache entries the manifest lists that are not in the cache (deleted, or damaged and removed)."""
    caches = vae_caches_of(backends)
    caches.update({b.id: TensorCache(b.cache_dir_vae) for b in backends.eval_datasets})
    text_cache = TensorCache(backends.text_embeds.cache_dir)
    identity = run.manifest["encoders"]["text"]["identity"]
    scale = int(run.manifest["encoders"]["vae"]["scale_factor"])
    vae_identity = run.manifest["encoders"]["vae"]["identity"]
    reference_identity = run.manifest["encoders"]["vae"].get("reference_identity", vae_identity)
    missing = []
    for ds in run.samples.values():
        for s in ds.samples:
            wanted = [(caches[s.dataset_id], latent_key(s, vae_identity), s.path)]
            if s.conditioning is not None:
                wanted.append((caches[s.conditioning.dataset_id], latent_key(s.conditioning, reference_identity),
                               s.conditioning.path))
            if s.mask is not None:
                wanted.append((caches[s.mask.dataset_id], mask_key(s.mask, scale), s.mask.path))
            wanted.append((text_cache, text_key(s.caption, identity), f"caption {s.caption!r}"))
            missing += [f"{what}: {cache.path(key)}" for cache, key, what in wanted if not cache.has(key)]
    validation = run.manifest["validation"]
    texts = [(c, identity) for c in run.manifest["captions"] + validation["prompts"]]
    texts += [(c, negative_identity(identity)) for c in validation["negative_prompts"]]
    missing += [f"caption {c!r}: {text_cache.path(text_key(c, i))}" for c, i in texts
                if not text_cache.has(text_key(c, i))]
    missing += [f"{r['path']}: {text_cache.path(r['key'])}" for r in validation["references"]
                if not text_cache.has(r["key"])]
    missing = list(dict.fromkeys(missing))
    if not missing:
        return []
    more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
    return [f"{len(missing)} cache entries are missing: {'; '.join(missing[:5])}{more}"]

