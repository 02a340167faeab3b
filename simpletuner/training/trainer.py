"""The training recipe. Read top to bottom: set up, cache, build the model, loop, save.

One step: take a batch (one aspect bucket), read its latents and text embeddings from the cache (and, where the
dataset pairs them, its reference latents and loss masks), draw noise and timesteps, noise the latents, predict with
the family's adapter, take the loss against the objective's target (flow-matching velocity, epsilon or v; the base
model's own prediction for regularisation data: the LoRA switched off, or a frozen copy of the base model in a full
fine-tune), weighted by the mask, backward, clip, step, report, and every
``checkpointing_steps`` write a checkpoint. Where the run is (step, epoch, data position, RNG, losses) lives in one
``RunState``.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers.optimization import get_scheduler
from tqdm.auto import tqdm

from simpletuner.data.cache import (TensorCache, fill_latent_cache, fill_mask_cache, fill_text_cache, latent_key,
                                    mask_key, text_key)
from simpletuner.data.discovery import DatasetError, DatasetSamples, discover, with_pairs
from simpletuner.data.sampler import BucketBatchSampler
from simpletuner.models.base import TextEmbedding
from simpletuner.models.registry import create_adapter
from simpletuner.training import checkpoint as ckpt
from simpletuner.training import sharding
from simpletuner.training.evaluator import Evaluator
from simpletuner.training.guards import NanLossGuard, require_finite
from simpletuner.training.lora import (add_lora, add_lycoris, load_lora_state, load_lycoris_trainable, lora_state_dict,
                                       lycoris_network, lycoris_trainable_state, save_lycoris, seeded_initial_weights)
from simpletuner.training.optimizers import (OPTIMIZERS, build_optimizer, evaluation_weights, optimizer_class,
                                             optimizer_kwargs, param_groups)
from simpletuner.training.state import RunState
from simpletuner.training.paths import check_run_paths
from simpletuner.training.webhooks import WebhookReporter

log = logging.getLogger("simpletuner.trainer")


class TrainingInterrupted(RuntimeError):
    """SIGTERM/SIGINT arrived; the run stopped at a step boundary with nothing half-written."""


@dataclass
class TrainResult:
    output_dir: str
    global_step: int
    final_loss: float | None
    lora_path: str | None = None
    model_path: str | None = None
    ema_path: str | None = None
    losses: list[float] = field(default_factory=list)
    vae_forwards: int = 0
    text_encoder_forwards: int = 0
    latents_encoded: int = 0
    captions_encoded: int = 0
    skipped_files: dict[str, int] = field(default_factory=dict)


@dataclass
class TrainData:
    sampler: BucketBatchSampler
    vae_caches: dict[str, TensorCache]  # dataset id -> its cache (latents; references' latents; masks)
    text_cache: TensorCache
    vae_identity: str
    text_identity: str
    latents_encoded: int = 0
    captions_encoded: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # dataset id -> files skipped (unreadable, too short...)
    vae_scale_factor: int = 8  # mask cache keys
    reference_identity: str = ""  # reference latents' cache key ingredient (the adapter's reference_cache_identity)


class _StopFlag:
    """Turns SIGTERM/SIGINT into a flag the loop checks between steps."""

    def __init__(self):
        self.stop = False
        self._previous = {}

    def __enter__(self):
        if hasattr(signal, "SIGTERM") and _is_main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.stop = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# ---------------------------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------------------------
def weight_dtype_for(config, device: torch.device) -> torch.dtype:
    """Frozen base weights: fp32 unless mixed precision is on (then base_model_default_dtype)."""
    if config.mixed_precision == "no" or device.type == "cpu" and config.mixed_precision != "bf16":
        return torch.float32
    if config.mixed_precision == "fp16":
        return torch.float16
    return torch.bfloat16 if config.base_model_default_dtype == "bf16" else torch.float32


def preflight(config, adapter, device: torch.device | None = None, backends=None) -> None:
    """Checks that need the device, the optional packages, the model's weights, or its shape or schedule, done
    before anything is cached or written."""
    from simpletuner.config import ConfigError
    from simpletuner.config.requirements import device_errors, missing_packages

    errors = missing_packages(config.__dict__) + device_errors(config.__dict__, (device or adapter.device).type)
    if errors:
        raise ConfigError(errors)
    optimizer_kwargs(config, optimizer_class(config.optimizer))  # unknown optimizer_config keys fail here
    if config.model_type == "lora" and config.lora_type == "lycoris":
        from simpletuner.training.lora import lycoris_preset

        lycoris_preset(adapter, config.lycoris_config.apply_preset)
    adapter.check_weights(_evaluation_weights(config))  # every weight source reachable, or one clear error
    adapter.objective  # reads the model's scheduler config: a missing or bad one fails here, not mid-run
    if backends is not None:
        from simpletuner.config.data import reference_errors

        errors = reference_errors(backends, config)
        if errors:
            raise ConfigError(errors, backends.source)
    if config.tread_config is not None:
        from simpletuner.config import resolve_tread_routes

        resolve_tread_routes(config.tread_config.routes, adapter.transformer_depth())


def _evaluation_weights(config) -> list:
    """The CLIP model ``evaluation_type: clip`` loads at the first validation, checked with the model's weights."""
    if config.evaluation_type != "clip":
        return []
    from simpletuner.evaluation.clip_score import clip_model_path
    from simpletuner.models.weights import WeightSource

    return [WeightSource("pretrained_evaluation_model_name_or_path", clip_model_path(config), None,
                         what="CLIP model", alternative="evaluation_type: none")]


class StartupReport:
    """Start-up stages sent to the server as ``status: starting`` events (``stage``, ``done`` of ``total``), so a
    job page shows "caching VAE latents 40/120" rather than nothing; at most a few a second."""

    def __init__(self, reporter: WebhookReporter | None, enabled: bool = True, every_s: float = 0.5):
        self.reporter = reporter if enabled else None
        self.every_s = every_s
        self._last = 0.0
        self._stage = None

    def stage(self, stage: str, done: int | None = None, total: int | None = None) -> None:
        if self.reporter is None:
            return
        now = time.monotonic()
        if stage == self._stage and done is not None and total and done < total and now - self._last < self.every_s:
            return  # a new stage and the last count of one always go out
        self._last, self._stage = now, stage
        info = {"stage": stage, **({"done": done, "total": total} if total else {})}
        self.reporter.status("starting", **info)

    def counter(self, stage: str):
        """``on_progress(done, total)`` for a cache filler."""
        return lambda done, total: self.stage(stage, done, total)


def discover_datasets(config, backends, adapter) -> tuple[list, list[DatasetSamples]]:
    """(training backends, their samples): every usable file of each image/video dataset, with its paired
    reference image and loss mask; a dataset without one usable file is an error naming it."""
    training_backends = [b for b in backends.datasets if b.dataset_type in ("image", "video")]
    datasets = [discover(b, config, adapter.resolution_multiple, temporal_compression=adapter.temporal_compression)
                for b in training_backends]
    for backend, ds in zip(training_backends, datasets):
        _check_i2v(backend, adapter)
        if not ds.samples:
            raise DatasetError(
                f"datasets[{backend.id}]: no usable {'videos or images' if adapter.is_video else 'images'} in "
                f"{backend.instance_data_dir} ({len(ds.skipped)} skipped). Check instance_data_dir and "
                f"{'the video options' if adapter.is_video else 'minimum_image_size'}."
            )
        ds.samples = with_pairs(backends, backend, ds.samples)  # reference images and loss masks, by path
    return training_backends, datasets


def vae_caches_of(backends) -> dict[str, TensorCache]:
    """Each non-eval dataset's latent cache (training images, their references and masks), by dataset id."""
    return {b.id: TensorCache(b.cache_dir_vae) for b in backends.datasets if b.dataset_type != "eval"}


def cache_sets(samples, vae_caches: dict[str, TensorCache]) -> tuple[dict[str, list], dict[str, list],
                                                                     dict[str, list]]:
    """(latent samples, reference samples, mask samples) by cache folder: each sample in its dataset's folder, its
    reference image and mask in theirs."""
    latent_sets: dict[str, list] = {}
    reference_sets: dict[str, list] = {}
    mask_sets: dict[str, list] = {}
    for s in samples:
        latent_sets.setdefault(str(vae_caches[s.dataset_id].folder), []).append(s)
        if s.conditioning is not None:
            reference_sets.setdefault(str(vae_caches[s.conditioning.dataset_id].folder), []).append(s.conditioning)
        if s.mask is not None:
            mask_sets.setdefault(str(vae_caches[s.mask.dataset_id].folder), []).append(s.mask)
    return latent_sets, reference_sets, mask_sets


def prepare_data(config, backends, adapter, accelerator, evaluator: Evaluator | None = None,
                 startup: StartupReport | None = None) -> TrainData:
    """Discover samples (with their paired reference images and loss masks), fill the latent, mask and text caches
    (main process first), and build the bucket sampler from the samples that encoded (a file that cannot be decoded
    is skipped, named and counted, never fatal mid-run)."""
    training_backends, datasets = discover_datasets(config, backends, adapter)
    vae_caches = vae_caches_of(backends)
    latent_sets, reference_sets, mask_sets = cache_sets([s for ds in datasets for s in ds.samples], vae_caches)
    text_cache = TensorCache(backends.text_embeds.cache_dir)
    unreadable: list = []
    with accelerator.main_process_first():
        vae_identity = adapter.vae_cache_identity()
        text_identity = adapter.text_cache_identity()
        show = accelerator.is_local_main_process
        startup = startup or StartupReport(None)
        startup.stage("loading the VAE")
        latents_encoded = fill_latent_cache(latent_sets, adapter, config.vae_batch_size, show_progress=show,
                                            unreadable=unreadable, on_progress=startup.counter("caching VAE latents"))
        latents_encoded += fill_latent_cache(reference_sets, adapter, config.vae_batch_size, show_progress=show,
                                             unreadable=unreadable, references=True,
                                             on_progress=startup.counter("caching reference latents"))
        if mask_sets:  # the scale factor reads the VAE's config: only asked when there are masks
            fill_mask_cache(mask_sets, adapter.vae_scale_factor, show_progress=show)
        drop_unreadable(datasets, unreadable)
        captions, references = training_captions(config, datasets, adapter)
        if config.offload_during_startup:
            adapter.unload_vae()  # the text encoders load next; the VAE is reloaded if validation needs it
        startup.stage("loading the text encoders")
        captions_encoded = fill_text_cache(captions, adapter, text_cache, backends.text_embeds.write_batch_size,
                                           show_progress=show, references=references,
                                           on_progress=startup.counter("caching text embeds"))
        if evaluator is not None:  # eval-dataset latents and validation prompt embeddings
            eval_latents, eval_captions = evaluator.fill_caches(show_progress=show)
            latents_encoded, captions_encoded = latents_encoded + eval_latents, captions_encoded + eval_captions
    adapter.unload_encoders()  # training reads the caches only
    for backend, ds in zip(training_backends, datasets):
        kind = "clips" if adapter.is_video else "images"
        log.info("datasets[%s]: %d %s from %d files, repeats=%d, %d file(s) skipped", backend.id, len(ds.samples),
                 kind, len({s.path for s in ds.samples}), ds.repeats, len(ds.skipped))
        if not ds.samples:
            raise DatasetError(f"datasets[{backend.id}]: no file in {backend.instance_data_dir} could be decoded "
                               f"({len(ds.skipped)} skipped)")
    sampler = BucketBatchSampler(datasets, config.train_batch_size, config.seed or 0)
    data = TrainData(sampler, vae_caches, text_cache, vae_identity, text_identity, latents_encoded, captions_encoded,
                     vae_scale_factor=adapter.vae_scale_factor if mask_sets else 8,
                     reference_identity=adapter.reference_cache_identity() if reference_sets else "")
    data.skipped = {ds.dataset_id: len(ds.skipped) for ds in datasets}
    return data


def _check_i2v(backend, adapter) -> None:
    """A dataset's ``video.is_i2v`` must agree with the model flavour (first-frame conditioning or none)."""
    wanted = getattr(getattr(backend, "video", None), "is_i2v", None)
    model = bool(getattr(adapter, "is_i2v", False))
    if wanted is not None and bool(wanted) != model:
        flavour = adapter.config.model_flavour
        raise DatasetError(f"datasets[{backend.id}].video.is_i2v: {wanted} does not match model_flavour "
                           f"{flavour!r}, which {'is' if model else 'is not'} an image-to-video flavour")


def training_captions(config, datasets, adapter) -> tuple[list[str], list | None]:
    """Every caption training embeds (the samples' own, and the empty one when captions are dropped), and the
    reference image each is encoded with where the adapter's prompt embedding sees it (``prompt_takes_reference``;
    else None)."""
    samples = [s for ds in datasets for s in ds.samples]
    captions = [s.caption for s in samples]
    # an edit model whose text encoder sees the reference caches each caption with its sample's reference
    references = [s.conditioning for s in samples] if adapter.prompt_takes_reference else None
    if config.caption_dropout_probability:
        captions += [""] * (len(samples) if references is not None else 1)
        references = references + references if references is not None else None
    return captions, references


def drop_unreadable(datasets, unreadable) -> None:
    """Move samples whose file failed to decode (``unreadable``: (sample or its path, reason) pairs) from
    ``samples`` to ``skipped`` (warned once per file)."""
    if not unreadable:
        return
    bad = {}
    for sample, reason in unreadable:
        bad.setdefault(getattr(sample, "path", sample), reason)
    for ds in datasets:
        hit = {s.path for s in ds.samples if s.path in bad}
        for path in sorted(hit):
            log.warning("datasets[%s]: skipping %s: %s", ds.dataset_id, path, bad[path])
            ds.skipped.append((path, bad[path]))
        ds.samples = [s for s in ds.samples if s.path not in bad]


def build_transformer(config, adapter, accelerator, generator: torch.Generator):
    """Load the transformer and make it trainable. The order matters: quantize the frozen base, attach LoRA (or
    unfreeze for full training), pick attention, gradient checkpointing, group offload, TREAD, then compile."""
    from simpletuner.training.compile import (apply_gradient_checkpointing_interval, compile_transformer_blocks,
                                              set_attention_mechanism)

    device = accelerator.device
    transformer = adapter.load_transformer()
    if config.base_model_precision not in (None, "no_change"):
        from simpletuner.models.quantize import DEFAULT_EXCLUDE, check_quantized_training, quantize_model

        check_quantized_training(config.base_model_precision, model_type=config.model_type,
                                 init_lora_weights=config.lora_init_type)
        quantize_model(transformer, config.base_model_precision,
                       exclude=(*DEFAULT_EXCLUDE, *adapter.full_precision_modules),
                       device=device if config.quantize_via == "accelerator" else None)
    if config.model_type == "lora":
        with seeded_initial_weights(config.seed):  # the same seed, the same initial LoRA, whatever ran before
            if config.lora_type == "lycoris":
                add_lycoris(transformer, adapter, config)
            else:
                add_lora(transformer, adapter, config)
        for p in transformer.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # LoRA weights train in fp32 over a frozen base of any dtype
    else:
        transformer.requires_grad_(True)
    set_attention_mechanism(transformer, config.attention_mechanism or "sdpa")
    if config.gradient_checkpointing:
        apply_gradient_checkpointing_interval(transformer, config.gradient_checkpointing_interval or 1)
    if config.enable_group_offload:
        from simpletuner.training.offload import enable_group_offload

        enable_group_offload(
            transformer, onload_device=device, offload_type=config.group_offload_type,
            blocks_per_group=config.group_offload_blocks_per_group, use_stream=config.group_offload_use_stream,
            to_disk_path=config.group_offload_to_disk_path, training=True,
        )
    else:
        transformer.to(device)
    if config.tread_config is not None:
        from simpletuner.training.tread import apply_tread

        # the router draws from the trainer's generator, so a resumed run routes exactly as an uninterrupted one
        handle = apply_tread(transformer, config.tread_config.routes, adapter.tread_layout(transformer),
                             generator=generator)
        log.info("TREAD: %s", ", ".join(f"drop {r.selection_ratio:.0%} of image tokens in blocks "
                                        f"{r.start_layer_idx}..{r.end_layer_idx}" for r in handle.routes))
    if config.compile:
        compile_transformer_blocks(transformer, device=device)
    transformer.train()
    return transformer


def build_regularisation_base(config, adapter, backends, device: torch.device):
    """A full fine-tune with regularisation data: a frozen copy of the base denoiser, whose prediction is those
    samples' target (a LoRA run switches its adapter off instead); None for any other run. It costs one more copy of
    the denoiser's weights in ``weight_dtype``: in accelerator memory, or with ``regularisation_base_device: cpu`` in
    CPU memory, each block moved to the accelerator only while it runs (diffusers' group offload)."""
    if config.model_type != "full" or not any(d.is_regularisation_data for d in backends.image_datasets):
        return None
    from simpletuner.training.compile import set_attention_mechanism

    base = adapter.load_transformer().requires_grad_(False).eval()
    set_attention_mechanism(base, config.attention_mechanism or "sdpa")
    if config.regularisation_base_device == "cpu":
        from simpletuner.training.offload import enable_group_offload

        enable_group_offload(base, onload_device=device, offload_type="block_level", blocks_per_group=1,
                             training=False)
    else:
        base.to(device)
    log.info("regularisation data: their targets are a frozen copy of the base %s (%.2f GB, on %s)",
             adapter.denoiser_subfolder, sum(p.numel() * p.element_size() for p in base.parameters()) / 1e9,
             "the CPU, offloaded block by block" if config.regularisation_base_device == "cpu" else device)
    return base


def total_train_steps(config, batches_per_epoch: int, world_size: int) -> tuple[int, int]:
    """(max_train_steps, num_epochs) from whichever of the two the config sets."""
    micro_per_epoch = max(1, batches_per_epoch // world_size)
    steps_per_epoch = max(1, micro_per_epoch // config.gradient_accumulation_steps)
    if config.max_train_steps:
        return config.max_train_steps, math.ceil(config.max_train_steps / steps_per_epoch)
    return config.num_train_epochs * steps_per_epoch, config.num_train_epochs


# ---------------------------------------------------------------------------------------------------------------
# one batch
# ---------------------------------------------------------------------------------------------------------------
def load_batch(batch, data: TrainData, config, generator: torch.Generator, device, adapter):
    """(latents, conditioning, is_regularisation, mask) of a batch, from the caches: the conditioning holds the text
    embeddings, what the latent cache keeps beside the latents (Wan I2V's first frame), the family's per-sample
    conditioning and, where paired, ``reference_latents``; the mask (B, 1, h, w) is None unless a sample has one
    (samples without one weigh every latent fully)."""
    def cached(s, key):
        return data.vae_caches[s.dataset_id].load(key)

    entries = [cached(s, latent_key(s, data.vae_identity)) for s in batch]
    latents = torch.stack([e["latents"] for e in entries])
    captions = [s.caption for s in batch]
    if config.caption_dropout_probability:
        drop = torch.rand(len(batch), generator=generator) < config.caption_dropout_probability
        captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
    with_reference = adapter.prompt_takes_reference  # each caption was encoded with its sample's reference
    cond = TextEmbedding.collate([
        TextEmbedding(data.text_cache.load(text_key(c, data.text_identity, s.conditioning if with_reference else None)))
        for c, s in zip(captions, batch)])
    # conditioning cached beside the latents (e.g. Wan I2V's first frame) travels with the text embeddings
    cond.update({k: torch.stack([e[k] for e in entries]) for k in entries[0] if k != "latents"})
    cond.update(adapter.sample_conditioning(batch))
    if batch[0].conditioning is not None:  # every sample of a run with references has one (checked by the config)
        cond["reference_latents"] = torch.stack([
            cached(s.conditioning, latent_key(s.conditioning, data.reference_identity))["latents"] for s in batch])
    mask = None
    if any(s.mask is not None for s in batch):
        mask = torch.stack([cached(s.mask, mask_key(s.mask, data.vae_scale_factor))["mask"] if s.mask is not None
                            else torch.ones(1, *latents.shape[-2:]) for s in batch]).to(device)
    is_reg = torch.tensor([s.is_regularisation for s in batch])
    return latents.to(device), {k: v.to(device) for k, v in cond.items()}, is_reg, mask


def compute_loss(config, adapter, transformer, latents, text, is_reg, generator, *, mask=None, base_model=None):
    """The batch's training loss. ``text`` is the batch's conditioning (``load_batch``); ``mask`` weights the loss
    per latent (and TREAD keeps the tokens under it); regularisation samples are trained towards the base model's
    own prediction: the LoRA switched off, or in a full fine-tune ``base_model`` (``build_regularisation_base``)."""
    objective = adapter.objective
    noise = torch.randn(latents.shape, generator=generator).to(latents)
    t = objective.sample_timesteps(latents.shape[0], generator=generator,
                                   image_seq_len=adapter.image_seq_len(latents.shape)).to(latents.device)
    noisy = objective.add_noise(latents, noise, t)
    target = objective.target(latents, noise, t)
    if is_reg.any():
        # regularisation data: the target is the base model's own prediction on these samples
        if config.model_type == "lora":
            base = _unwrap(transformer)
            with torch.no_grad(), _adapter_off(base):
                base_pred = adapter.predict(base, noisy, t, text).float()
        elif base_model is None:
            raise ValueError("is_regularisation_data: a full fine-tune trains these samples towards a frozen copy of "
                             "the base model, and none was built (build_regularisation_base)")
        else:
            with torch.no_grad():
                base_pred = adapter.predict(base_model, noisy, t, text).float()
        selected = is_reg.to(latents.device).view(-1, *([1] * (latents.ndim - 1)))
        target = torch.where(selected, base_pred, target)
    handle = getattr(_unwrap(transformer), "_tread_handle", None)
    keep = adapter.image_token_mask(mask > 0, text) if mask is not None and handle is not None else None
    with handle.force_keep(keep) if keep is not None else nullcontext():
        pred = adapter.predict(transformer, noisy, t, text)
    return objective.loss(pred, target, t, weight=mask)


@contextmanager
def _adapter_off(model):
    network = lycoris_network(model)
    if network is not None:
        strength = network.multiplier
        network.set_multiplier(0.0)
    else:
        model.disable_adapters()
    try:
        yield
    finally:
        if network is not None:
            network.set_multiplier(strength)
        else:
            model.enable_adapters()


@contextmanager
def _closing(evaluator):
    """Close the trackers when the loop ends early (SIGTERM, an error); on_end closes them otherwise."""
    try:
        yield
    except BaseException:
        evaluator.close()
        raise


def _unwrap(model):
    return getattr(model, "module", model)


# ---------------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------------
def train(config, backends, *, reporter: WebhookReporter | None = None) -> TrainResult:
    """Train as ``config`` says; returns where the results are. Raises TrainingInterrupted on SIGTERM."""
    check_run_paths(config, backends)  # a server's job: every path still inside its allowed roots
    reporter = reporter or WebhookReporter.from_env(getattr(config, "webhook_config", None))
    output_dir = Path(config.output_dir)
    accelerator = Accelerator(
        mixed_precision=config.mixed_precision if config.mixed_precision != "no" else "no",
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        **sharding.accelerator_kwargs(config),  # FSDP / DeepSpeed plugins on GPUs
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.seed is not None:
        set_seed(config.seed)
    state = RunState.start(config.seed, accelerator.process_index)
    generator = state.generator
    log.info("process %d of %d on %s", accelerator.process_index, accelerator.num_processes, accelerator.device)
    if accelerator.is_main_process:
        reporter.status("running")
        ckpt.remove_incomplete(output_dir)

    # ---- data and caches ----
    adapter = create_adapter(config, device=accelerator.device,
                             weight_dtype=weight_dtype_for(config, accelerator.device),
                             references=backends.uses_references)
    preflight(config, adapter, accelerator.device, backends)
    shards = sharding.for_run(config, accelerator)  # fsdp_enable / deepspeed_config; None otherwise
    startup = StartupReport(reporter, enabled=accelerator.is_main_process)
    startup.stage("reading the datasets")
    if config.train_from_cache:  # split training's stage 2: every input from stage 1's manifest, no encoder loaded
        from simpletuner.training.split import load_cache

        cached = load_cache(config, backends, adapter)
        evaluator = Evaluator(config, backends, adapter, accelerator, reporter, generators=[generator],
                              samples=cached.samples)
        data = cached.train_data(config, backends, adapter, evaluator)
    else:
        evaluator = Evaluator(config, backends, adapter, accelerator, reporter, generators=[generator])
        data = prepare_data(config, backends, adapter, accelerator, evaluator, startup)
    max_steps, num_epochs = total_train_steps(config, data.sampler.batches_per_epoch, accelerator.num_processes)

    # ---- model, optimizer, schedule ----
    startup.stage("loading the model")
    transformer = build_transformer(config, adapter, accelerator, generator)
    base_model = build_regularisation_base(config, adapter, backends, accelerator.device)
    if shards is not None:
        transformer = shards.shard(transformer)  # FSDP on the CPU: its parameters become shards here
    optimizer = build_optimizer(config, param_groups(transformer, config, adapter_family(config).lr_scale))
    schedule = config.lr_scheduler
    if OPTIMIZERS[config.optimizer].schedule_free:
        optimizer.train()  # schedule-free optimizers step in train mode; eval mode holds the averaged weights
        if schedule != "constant":
            log.warning("optimizer %r keeps its own schedule (and warms up over lr_warmup_steps itself): "
                        "lr_scheduler %r is replaced by 'constant'", config.optimizer, schedule)
        schedule = "constant"
    lr_scheduler = get_scheduler(
        schedule, optimizer=optimizer,
        num_warmup_steps=config.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=max_steps * accelerator.num_processes,
    )
    if shards is not None:
        transformer, optimizer, lr_scheduler = shards.prepare(transformer, optimizer, lr_scheduler)
    else:
        # group-offloaded modules are placed by their hooks; accelerate must not move them with .to()
        placement = [not config.enable_group_offload, True, True]
        transformer, optimizer, lr_scheduler = accelerator.prepare(transformer, optimizer, lr_scheduler,
                                                                   device_placement=placement)
    # after prepare: accelerate's FSDP plugin replaces the parameters with their shards
    params = [p for p in _unwrap(transformer).parameters() if p.requires_grad]
    ema = None
    if config.use_ema:
        from simpletuner.training.ema import TrainedWeightsEMA

        ema = TrainedWeightsEMA(params, decay=config.ema_decay, update_interval=config.ema_update_interval,
                                device="cpu" if config.ema_device == "cpu" else accelerator.device)
    evaluator.attach(ema=ema, optimizer=optimizer)

    # ---- resume ----
    resumed = ckpt.resume(output_dir, config.resume_from_checkpoint, state, optimizer=optimizer,
                          lr_scheduler=lr_scheduler, rank=accelerator.process_index,
                          world_size=accelerator.num_processes, ema=ema, shards=shards)
    if resumed is not None:
        resume_path, trainable = resumed
        if trainable is not None:  # a sharded run's shards restored the weights themselves
            _load_trainable(_unwrap(transformer), trainable, config, str(resume_path))
        if ema is not None and not (resume_path / "ema.pt").is_file():
            log.warning("%s has no EMA (it was saved without use_ema): the EMA starts from the resumed weights",
                        resume_path)
            ema.reset_to_weights()
        log.info("resumed from %s at step %d (epoch %d, batch %d)", resume_path, state.global_step, state.epoch,
                 state.batch_in_epoch)
        if state.global_step >= max_steps:
            log.warning("%s is already at max_train_steps=%d: nothing left to train; raise max_train_steps "
                        "(or num_train_epochs) to continue, or set resume_from_checkpoint to null to start over",
                        resume_path, max_steps)

    # ---- loop ----
    loss_log = output_dir / "training_log.jsonl"
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
    evaluator.on_start(transformer, state.global_step)
    bar = tqdm(total=max_steps, initial=state.global_step, desc="Training",
               disable=not accelerator.is_local_main_process)
    started, start_step = time.time(), state.global_step
    accumulated = 0.0
    save = _checkpointer(config, accelerator, transformer, optimizer, lr_scheduler, reporter, ema, shards, adapter)
    nan_guard = NanLossGuard(config.max_nan_loss_steps)
    with _StopFlag() as stop, _closing(evaluator):
        while state.global_step < max_steps:
            batches = data.sampler.epoch_batches(state.epoch)
            mine = batches[accelerator.process_index::accelerator.num_processes]
            while state.batch_in_epoch < len(mine) and state.global_step < max_steps:
                if stop.stop:
                    raise TrainingInterrupted(f"stopped by signal at step {state.global_step}")
                latents, cond, is_reg, mask = load_batch(mine[state.batch_in_epoch], data, config, generator,
                                                         accelerator.device, adapter)
                state.batch_in_epoch += 1
                with accelerator.accumulate(transformer):
                    loss = compute_loss(config, adapter, transformer, latents, cond, is_reg, generator, mask=mask,
                                        base_model=base_model)
                    accelerator.backward(loss)
                    accumulated += (accelerator.gather(loss.detach()).mean().item()
                                    / config.gradient_accumulation_steps)
                    if accelerator.sync_gradients and not math.isfinite(accumulated):
                        optimizer.zero_grad(set_to_none=True)  # a NaN/inf loss never reaches the weights
                    if accelerator.sync_gradients and config.max_grad_norm:
                        accelerator.clip_grad_norm_(params, config.max_grad_norm)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                if not accelerator.sync_gradients:
                    continue

                # ---- one optimizer step done: EMA, report, checkpoint ----
                step_loss, accumulated = accumulated, 0.0
                state.record_step(step_loss)
                step = state.global_step
                if ema is not None:
                    ema.update(step)
                lr = lr_scheduler.get_last_lr()[0]
                elapsed = time.time() - started
                it_s = (step - start_step) / elapsed if elapsed > 0 else 0.0
                eta = (max_steps - step) / it_s if it_s > 0 else None
                bar.update(1)
                bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}")
                if accelerator.is_main_process:
                    with loss_log.open("a") as fh:
                        fh.write(json.dumps({"step": step, "loss": step_loss, "lr": lr, "epoch": state.epoch}) + "\n")
                    reporter.progress(step, max_steps, step_loss, lr, it_s, eta, epoch=state.epoch)
                nan_guard.check(step, step_loss)
                evaluator.on_step(step, transformer, loss=step_loss, lr=lr)
                if config.checkpointing_steps and step % config.checkpointing_steps == 0:
                    save(state)
            if state.batch_in_epoch >= len(mine):
                state.next_epoch()
    bar.close()
    step = state.global_step
    if (config.checkpointing_steps and step > 0 and step % config.checkpointing_steps
            and not (output_dir / f"checkpoint-{step}").exists()):
        # a finished run ends on a checkpoint, so raising max_train_steps later continues exactly from here
        save(state)
    evaluator.on_end(step, transformer)

    # ---- save ----
    accelerator.wait_for_everyone()
    final_loss = state.losses[-1] if state.losses else _last_logged_loss(loss_log)
    result = TrainResult(str(output_dir), step, final_loss, losses=state.losses,
                         vae_forwards=adapter.vae_forwards, text_encoder_forwards=adapter.text_encoder_forwards,
                         latents_encoded=data.latents_encoded, captions_encoded=data.captions_encoded,
                         skipped_files=data.skipped)
    if shards is not None:  # every process gathers; the main one writes
        shards.require_finite(step, "the final model")
        with evaluation_weights(optimizer):
            path = shards.export(adapter, output_dir)
    elif accelerator.is_main_process:
        model = accelerator.unwrap_model(transformer)
        require_finite(_trainable_state(model, config), step, "the final model")
        with evaluation_weights(optimizer):  # a schedule-free optimizer's averaged weights are the result
            path = export_weights(config, adapter, model, output_dir)
            if ema is not None:
                with ema.swapped_in():
                    result.ema_path = str(export_weights(config, adapter, model, output_dir / "ema"))
    if accelerator.is_main_process:
        if config.model_type == "lora":
            result.lora_path = str(path)
        else:
            result.model_path = str(path)
        summary = {k: v for k, v in result.__dict__.items() if k != "losses"}
        ckpt.write_json(output_dir / "run_summary.json", summary)
    accelerator.end_training()
    return result


def adapter_family(config):
    from simpletuner.config import get_family

    return get_family(config.model_family)


def export_weights(config, adapter, model, folder: Path) -> Path:
    """The trained weights as users load them: a diffusers-format LoRA (``pytorch_lora_weights.safetensors``), a
    LyCORIS file in lycoris' own format under the same name, or the full transformer (``transformer/``)."""
    if config.model_type == "lora":
        network = lycoris_network(model)
        if network is not None:
            return save_lycoris(network, folder)
        return adapter.save_lora(lora_state_dict(model), folder)
    model.save_pretrained(folder / "transformer", safe_serialization=True)
    return folder / "transformer"


def _last_logged_loss(loss_log: Path) -> float | None:
    """The newest loss in training_log.jsonl (a resumed run that had nothing left to train reports it)."""
    if not loss_log.is_file():
        return None
    for line in reversed(loss_log.read_text().strip().splitlines()):
        try:
            return json.loads(line)["loss"]
        except (ValueError, KeyError, TypeError):  # a line cut short by a crash
            continue
    return None


def _trainable_state(model, config) -> dict[str, torch.Tensor]:
    if config.model_type == "lora":
        network = lycoris_network(model)
        return lycoris_trainable_state(network) if network is not None else lora_state_dict(model)
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _load_trainable(model, state, config, source: str) -> None:
    if config.model_type == "lora":
        network = lycoris_network(model)
        if network is not None:
            load_lycoris_trainable(network, state, source)
        else:
            load_lora_state(model, state, source)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise ValueError(f"{source}: checkpoint does not match the model "
                         f"(missing {sorted(trainable & set(missing))[:3]}, unexpected {unexpected[:3]})")


def _checkpointer(config, accelerator, transformer, optimizer, lr_scheduler, reporter, ema=None, shards=None,
                  adapter=None):
    """``save(state)``: every rank writes its part of ``checkpoint-<step>`` (its RNG; in a sharded run its shard of
    the weights and optimizer); the main process adds the rest (and, for an unsharded LoRA, the LoRA file a pipeline
    loads, so every checkpoint can be downloaded and used; a sharded one gets it from `simpletuner consolidate`) and
    publishes the folder."""

    def save(state: RunState) -> None:
        main = accelerator.is_main_process
        trainable = None
        if shards is not None:
            shards.require_finite(state.global_step, "checkpoint")
        else:
            trainable = _trainable_state(accelerator.unwrap_model(transformer), config)
            require_finite(trainable, state.global_step, "checkpoint")  # on every rank, so they stop together
        path = ckpt.save_checkpoint(
            config.output_dir, state, trainable=trainable if main else None,
            optimizer=optimizer, lr_scheduler=lr_scheduler, total_limit=config.checkpoints_total_limit,
            rank=accelerator.process_index, world_size=accelerator.num_processes,
            barrier=accelerator.wait_for_everyone, shards=shards,
            ema_state=ema.state_dict() if ema is not None and main else None,
            extra=(lambda folder: export_weights(config, adapter, accelerator.unwrap_model(transformer), folder))
            if main and adapter is not None and shards is None and config.model_type == "lora" else None,
        )
        if main:
            log.info("saved %s", path)
            reporter.checkpoint(state.global_step, str(path))

    return save


def run(config, backends, recipe=None) -> int:
    """Train (with ``recipe``, default fine-tuning's ``train``; the distillation recipe passes its own) and report
    the outcome to the webhooks; returns a process exit code (0, 1, or 143 on SIGTERM)."""
    return run_reported(recipe or train, config, backends, lambda result: dict(
        final_loss=result.final_loss, lora_path=result.lora_path, model_path=result.model_path,
        output_dir=result.output_dir, steps=result.global_step))


def run_reported(recipe, config, backends, outcome) -> int:
    """``recipe(config, backends, reporter=...)`` with its end reported to the webhooks: succeeded (with
    ``outcome(result)``), failed (with the error and traceback, then re-raised) or cancelled by a signal (143)."""
    reporter = WebhookReporter.from_env(getattr(config, "webhook_config", None))
    try:
        result = recipe(config, backends, reporter=reporter)
    except TrainingInterrupted as exc:
        log.warning("%s", exc)
        reporter.status("cancelled", reason=str(exc))
        reporter.close()
        return 143
    except Exception as exc:
        reporter.error(str(exc), traceback.format_exc())
        reporter.status("failed", reason=str(exc))
        reporter.close()
        raise
    reporter.status("succeeded", **outcome(result))
    reporter.close()
    return 0

