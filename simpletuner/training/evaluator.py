"""The one object the training loop talks to about validation, evaluation and reporting.

    evaluator = Evaluator(config, backends, adapter, accelerator, reporter)   # checks settings (fails fast)
    ... evaluator.fill_caches() while the encoders are loaded (eval latents, prompt embeddings) ...
    evaluator.on_start(transformer, global_step)      # validation_on_startup
    evaluator.on_step(global_step, transformer, loss=..., lr=...)   # after every optimizer step
    evaluator.on_end(global_step, transformer)        # final validation, trackers closed

Every ``validation_steps`` it generates the validation images (with previews, written beside them, logged to the
trackers and sent over webhooks when there are any, and CLIP scores); every
``eval_steps_interval`` it measures the eval loss. Train loss and lr go to the trackers every step; each step with
validation or evaluation also sends one ``scores`` event holding all of that step's metrics. Images, trackers and
webhook events come from the main process only; the other processes wait.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from simpletuner.data.cache import (TensorCache, fill_latent_cache, fill_mask_cache, fill_text_cache, latent_key,
                                    mask_key, negative_identity, text_key)
from simpletuner.data.discovery import (DatasetError, DatasetSamples, Sample, discover, load_pixels, reference_sample,
                                          with_pairs)
from simpletuner.evaluation.eval_loss import EvalItem, evaluation_loss
from simpletuner.evaluation.prompts import ValidationPrompt, validation_prompts
from simpletuner.evaluation.trackers import Trackers
from simpletuner.evaluation.validation import (
    PreviewImage,
    ValidationImage,
    ValidationRunner,
    inference_mode,
    preserve_rng_state,
    preview_strips,
)

log = logging.getLogger("simpletuner.evaluation")


class Evaluator:
    def __init__(self, config, backends, adapter, accelerator, reporter, *, trackers: Trackers | None = None,
                 generators: list[torch.Generator] | tuple = (), samples: dict[str, DatasetSamples] | None = None):
        """Checks the validation settings (raising on contradictions) and finds the eval images; loads nothing.

        ``generators``: the trainer's own RNGs, restored after each validation/evaluation with the global ones.
        ``samples``: every dataset's samples by dataset id, as a split run's cache manifest lists them (its images
        need not be on this machine); without it the eval datasets are discovered from their folders.
        """
        self.config = config
        self.backends = backends
        self.adapter = adapter
        self.accelerator = accelerator
        self.reporter = reporter
        self.is_main = accelerator.is_main_process
        self.generators = [g for g in generators if g is not None]

        # ---- validation images ----
        self.prompts = validation_prompts(config)
        self.resolutions = config.validation_resolutions
        multiple = adapter.resolution_multiple
        for w, h in self.resolutions:
            if w % multiple or h % multiple:
                raise ValueError(f"validation_resolution: {w}x{h} is not a multiple of {multiple} "
                                 f"(required by model_family {config.model_family!r})")
        wants_validation = bool(config.validation_steps or config.validation_on_startup)
        self.validating = wants_validation and bool(self.prompts)
        self._check_references(wants_validation)
        if wants_validation and not self.prompts:
            log.warning("validation_steps is set but there is no validation_prompt or user_prompt_library: "
                        "no validation images will be made")
        # previews are written beside the validation images and logged to the trackers; webhooks get them too
        if config.validation_preview and not self.validating:
            raise ValueError("validation_preview: needs validation images (validation_steps or "
                             "validation_on_startup, and a validation_prompt or user_prompt_library)")
        self.clip = config.evaluation_type == "clip"
        if self.clip and not self.validating:
            log.warning("evaluation_type 'clip' scores validation images, and validation is off: no CLIP scores")

        # ---- eval loss ----
        self.samples = samples
        self.eval_datasets = []
        for backend in backends.eval_datasets:
            ds = samples[backend.id] if samples is not None else discover(
                backend, config, adapter.resolution_multiple, temporal_compression=adapter.temporal_compression)
            if not ds.samples:
                raise DatasetError(f"datasets[{backend.id}]: no usable images in {backend.instance_data_dir} "
                                   f"(dataset_type eval, {len(ds.skipped)} skipped)")
            if samples is None:
                ds.samples = with_pairs(backends, backend, ds.samples)
            self.eval_datasets.append((backend, ds))
        self.eval_every = config.eval_steps_interval or (config.validation_steps if self.eval_datasets else None)
        if config.eval_steps_interval and not self.eval_datasets:
            log.warning("eval_steps_interval is set but no dataset has dataset_type 'eval': no eval loss")
        self.evaluating = bool(self.eval_datasets and self.eval_every)

        self.text_cache = TensorCache(backends.text_embeds.cache_dir)
        self._identities: tuple[str, str] | None = None
        self._eval_items: list[EvalItem] | None = None
        self._embeddings: dict[str, dict[str, torch.Tensor]] = {}
        self._references: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}
        self._runner: ValidationRunner | None = None
        self._scorer = None
        self._last_validated: int | None = None
        self.ema = None  # set by attach(): the EMA of the trained weights (use_ema)
        self.optimizer = None
        self._previews: list[PreviewImage] = []
        self._last_evaluated: int | None = None
        if trackers is None and self.is_main:
            with preserve_rng_state():  # a tracker library drawing random ids must not shift the training RNG
                trackers = Trackers(config)
        self.trackers = trackers

    def attach(self, *, ema=None, optimizer=None) -> None:
        """The run's EMA (validated per ``ema_validation``) and optimizer (a schedule-free one validates its averaged
        weights)."""
        self.ema = ema
        self.optimizer = optimizer

    def _check_references(self, wants_validation: bool) -> None:
        """An edit model validates by editing a reference image per prompt: each must name an existing one."""
        if not wants_validation:
            return
        for item in self.prompts:
            field = ("validation_reference_image" if item.nickname == "validation"
                     else f"user_prompt_library[{item.nickname!r}].reference_image")
            if self.adapter.references and not item.reference_image:
                raise ValueError(f"{field}: model_flavour {self.config.model_flavour!r} edits a reference image; "
                                 f"name the image prompt {item.prompt!r} edits")
            if self.adapter.references and not Path(item.reference_image).expanduser().is_file():
                raise ValueError(f"{field}: file {item.reference_image!r} does not exist")
            if item.reference_image and not self.adapter.references:
                log.warning("%s: model_family %s flavour %r takes no reference image; ignored", field,
                            self.config.model_family, self.config.model_flavour)

    # ---- caches -----------------------------------------------------------------------------------------
    def captions(self) -> list[str]:
        """Every prompt the evaluator needs embedded: validation prompts and eval captions."""
        return [caption for caption, _ in self._text_items()]

    def _text_items(self) -> list[tuple[str, Sample | None]]:
        """(prompt, the reference it is encoded with) of every prompt the evaluator needs embedded; the reference is
        None unless the adapter's prompt embedding sees the reference image (then one per validation size)."""
        with_reference = self.adapter.prompt_takes_reference
        items: list[tuple[str, Sample | None]] = []
        if self.validating:
            for p in self.prompts:
                if with_reference:
                    items += [(p.prompt, self.reference_sample(p, w, h)) for w, h in self.resolutions]
                else:
                    items.append((p.prompt, None))
        if self.evaluating:
            items += [(s.caption, s.conditioning if with_reference else None)
                      for _, ds in self.eval_datasets for s in ds.samples]
        return items

    def _negative_items(self) -> list[tuple[str, Sample | None]]:
        if not self.negative_prompts():
            return []
        negative = self.negative_prompts()[0]
        if not self.adapter.prompt_takes_reference:
            return [(negative, None)]
        return [(negative, self.reference_sample(p, w, h)) for p in self.prompts for w, h in self.resolutions]

    def negative_prompts(self) -> list[str]:
        """The negative prompt, when validation's guidance uses one (embedded as the pipeline embeds negatives)."""
        if self.validating and self.adapter.uses_negative_prompt(self.config.validation_guidance,
                                                                 self.config.validation_guidance_real):
            return [self.config.validation_negative_prompt or ""]
        return []

    def eval_samples(self) -> list[Sample]:
        return [s for _, ds in self.eval_datasets for s in ds.samples] if self.evaluating else []

    def _cache_of(self, dataset_id: str) -> TensorCache:
        return TensorCache(next(b.cache_dir_vae for b in self.backends.datasets if b.id == dataset_id))

    def fill_caches(self, show_progress: bool = True) -> tuple[int, int]:
        """Encode what is not cached yet (eval latents and their references and masks, prompt embeddings, the
        validation reference images); returns (latents, captions) encoded."""
        latents = 0
        if self.evaluating:
            by_cache: dict[str, list[Sample]] = {}
            references: dict[str, list[Sample]] = {}
            masks: dict[str, list[Sample]] = {}
            for backend, ds in self.eval_datasets:
                by_cache.setdefault(backend.cache_dir_vae, []).extend(ds.samples)
                for s in ds.samples:
                    if s.conditioning is not None:
                        references.setdefault(str(self._cache_of(s.conditioning.dataset_id).folder), []).append(
                            s.conditioning)
                    if s.mask is not None:
                        masks.setdefault(str(self._cache_of(s.mask.dataset_id).folder), []).append(s.mask)
            latents = fill_latent_cache(by_cache, self.adapter, self.config.vae_batch_size, show_progress=show_progress)
            latents += fill_latent_cache(references, self.adapter, self.config.vae_batch_size,
                                         show_progress=show_progress, references=True)
            if masks:  # the scale factor reads the VAE's config: only asked when there are masks
                fill_mask_cache(masks, self.adapter.vae_scale_factor, show_progress=show_progress)
        batch = self.backends.text_embeds.write_batch_size
        captions = 0
        with_reference = self.adapter.prompt_takes_reference
        for items, negative in ((self._text_items(), False), (self._negative_items(), True)):
            captions += fill_text_cache([c for c, _ in items], self.adapter, self.text_cache, batch,
                                        show_progress=show_progress, negative=negative,
                                        references=[r for _, r in items] if with_reference else None)
        if self.validating and self.adapter.references:
            for item in self.prompts:
                for width, height in self.resolutions:
                    self.reference_latents(item, width, height)
        return latents, captions

    def reference_samples(self) -> list[Sample]:
        """The validation reference images an edit model edits, each prepared at each validation size."""
        if not (self.validating and self.adapter.references):
            return []
        return [self.reference_sample(item, width, height)
                for item in self.prompts if item.reference_image for width, height in self.resolutions]

    def reference_sample(self, item, width: int, height: int) -> Sample | None:
        """The reference image ``item`` edits, cropped to width x height as training crops its references."""
        if not self.adapter.references or not item.reference_image:
            return None
        return reference_sample(Path(item.reference_image).expanduser(), width, height)

    def reference_latents(self, item, width: int, height: int) -> dict[str, torch.Tensor] | None:
        """The reference image ``item`` edits at width x height: ``reference_latents`` (C, h, w) as training encodes
        its references, and its ``reference_pixels`` (3, H, W) in [-1, 1] for a pipeline that takes the image
        itself (its latents cached beside the prompt embeddings, encoded while the VAE is loaded, so a split run's
        stage 2 reads them without the VAE encoder)."""
        sample = self.reference_sample(item, width, height)
        if sample is None:
            return None
        key = (item.reference_image, width, height)
        if key not in self._references:
            pixels = load_pixels(sample)
            cache_key = latent_key(sample, self.adapter.reference_cache_identity())
            if not self.text_cache.has(cache_key):
                self.text_cache.save(cache_key, {"latents": self.adapter.encode_references(pixels.unsqueeze(0))[0]})
            self._references[key] = {"reference_latents": self.text_cache.load(cache_key)["latents"],
                                     "reference_pixels": pixels}
        return self._references[key]

    def disable_images(self, reason: str) -> None:
        """No validation images (nor previews, nor CLIP scores) in this run, with a warning saying why."""
        if self.validating:
            log.warning("validation images are skipped: %s", reason)
        self.validating = False

    def _identity(self) -> tuple[str, str]:
        if self._identities is None:
            self._identities = (self.adapter.vae_cache_identity(), self.adapter.text_cache_identity())
        return self._identities

    def prompt_embedding(self, prompt: str, *, negative: bool = False,
                         reference: Sample | None = None) -> dict[str, torch.Tensor]:
        """The cached text embedding of ``prompt`` (as a negative prompt with ``negative``; encoded with the
        ``reference`` image where the adapter's prompt embedding sees it), encoded now if the cache lacks it."""
        identity = negative_identity(self._identity()[1]) if negative else self._identity()[1]
        reference = reference if self.adapter.prompt_takes_reference else None
        key = text_key(prompt, identity, reference)
        if key not in self._embeddings:
            if not self.text_cache.has(key):
                fill_text_cache([prompt], self.adapter, self.text_cache, 1, show_progress=False, negative=negative,
                                references=[reference] if reference is not None else None)
            self._embeddings[key] = self.text_cache.load(key)
        return self._embeddings[key]

    def negative_embedding(self, prompt: str, reference: Sample | None = None) -> dict[str, torch.Tensor]:
        return self.prompt_embedding(prompt, negative=True, reference=reference)

    def eval_items(self) -> list[EvalItem]:
        if self._eval_items is None:
            vae_identity, text_identity = self._identity()
            if any(not TensorCache(b.cache_dir_vae).has(latent_key(s, vae_identity))
                   for b, ds in self.eval_datasets for s in ds.samples):
                self.fill_caches(show_progress=False)
            items = []
            for backend, ds in self.eval_datasets:
                cache = TensorCache(backend.cache_dir_vae)
                for s in ds.samples:
                    key = latent_key(s, vae_identity)
                    entry = cache.load(key)
                    cond = dict(self.prompt_embedding(s.caption, reference=s.conditioning))
                    cond.update({k: v for k, v in entry.items() if k != "latents"})  # e.g. Wan I2V's first frame
                    cond.update({k: v[0] for k, v in self.adapter.sample_conditioning([s]).items()})
                    mask = None
                    if s.conditioning is not None:
                        ref = self._cache_of(s.conditioning.dataset_id)
                        cond["reference_latents"] = ref.load(latent_key(s.conditioning, self.adapter
                                                                        .reference_cache_identity()))["latents"]
                    if s.mask is not None:
                        mask = self._cache_of(s.mask.dataset_id).load(
                            mask_key(s.mask, self.adapter.vae_scale_factor))["mask"]
                    items.append(EvalItem(key, entry["latents"], cond, mask))
            self._eval_items = items
        return self._eval_items

    # ---- hooks for the training loop ----------------------------------------------------------------------
    def on_start(self, transformer, step: int = 0) -> dict[str, float]:
        """``validation_on_startup``: validate (and evaluate) before the first step."""
        if not self.config.validation_on_startup:
            return {}
        return self._run(step, transformer, {}, validate=self.validating, evaluate=self.evaluating)

    def on_step(self, step: int, transformer, *, loss: float | None = None, lr: float | None = None) -> dict:
        """After optimizer step ``step``: log train metrics; validate / evaluate when the step is due."""
        metrics = {k: v for k, v in (("train/loss", loss), ("train/lr", lr)) if v is not None}
        validate = self.validating and bool(self.config.validation_steps) and step % self.config.validation_steps == 0
        evaluate = self.evaluating and step % self.eval_every == 0
        return self._run(step, transformer, metrics, validate=validate, evaluate=evaluate)

    def on_end(self, step: int, transformer) -> dict[str, float]:
        """Final validation / evaluation (unless this step already had one); closes the trackers."""
        try:
            return self._run(step, transformer, {}, validate=self.validating and self._last_validated != step,
                             evaluate=self.evaluating and self._last_evaluated != step)
        finally:
            self.close()

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()

    # ---- the work ---------------------------------------------------------------------------------------
    def _run(self, step: int, transformer, metrics: dict, *, validate: bool, evaluate: bool) -> dict[str, float]:
        if validate or evaluate:
            if self.is_main:
                with preserve_rng_state(*self.generators):
                    self._work(step, transformer, metrics, validate, evaluate)
            # every rank records the step, so all of them agree on on_end's barrier
            self._last_validated = step if validate else self._last_validated
            self._last_evaluated = step if evaluate else self._last_evaluated
            self.accelerator.wait_for_everyone()
        if self.is_main and metrics:
            if self.trackers is not None:
                self.trackers.log(metrics, step)
                if validate or evaluate:
                    self.trackers.flush()
            if validate or evaluate:
                self.reporter.scores(step, metrics)
        return metrics

    def _work(self, step, transformer, metrics, validate, evaluate):
        from simpletuner.training.optimizers import evaluation_weights

        model = self.accelerator.unwrap_model(transformer)
        with evaluation_weights(self.optimizer):
            if validate:
                metrics.update(self.validate(step, model))
            if evaluate:
                metrics.update(self.evaluate(model))

    def evaluate(self, model) -> dict[str, float]:
        """Eval loss of ``model`` (the unwrapped transformer) on the eval datasets."""
        items = self.eval_items()
        with preserve_rng_state(), inference_mode(model), self.accelerator.autocast():
            metrics = evaluation_loss(self.adapter, model, items, batch_size=self.config.train_batch_size,
                                      device=self.accelerator.device)
        log.info("eval loss %.5f over %d image(s)", metrics["eval/loss"], len(items))
        return metrics

    def validate(self, step: int, model) -> dict[str, float]:
        """Generate, save and send the validation images of ``step`` (with the trained weights, the EMA weights or
        both, as ``ema_validation`` says); returns their CLIP scores (if on). Previews go to the trackers as one
        strip per image."""
        self._previews = []
        mode = self.config.ema_validation if self.ema is not None else "none"
        images = [] if mode == "ema_only" else self.runner().run(model, self.prompts, self.resolutions, step)
        if mode in ("ema_only", "comparison"):
            ema_prompts = [ValidationPrompt(f"{p.nickname}_ema", p.prompt, p.reference_image) for p in self.prompts]
            with self.ema.swapped_in():
                images += self.runner().run(model, ema_prompts, self.resolutions, step)
        kind = "video(s)" if self.adapter.is_video else "image(s)"
        log.info("validation: %d %s in %s", len(images), kind, images[0].path.parent if images else "-")
        if self.trackers is not None:
            self.trackers.log_images({f"validation/{im.name}": im.image for im in images}, step,
                                     captions={f"validation/{im.name}": im.prompt for im in images})
            strips = preview_strips(self._previews)
            if strips:
                self.trackers.log_images({f"preview/{name}": strip for name, (strip, _) in strips.items()}, step,
                                         captions={f"preview/{name}": caption for name, (_, caption) in strips.items()})
        self._previews = []
        return self.clip_scores(images) if self.clip and images else {}

    def validation_conditioning(self) -> dict[str, torch.Tensor]:
        """What an image-to-video flavour animates in validation: the conditioning cached beside the first clip of
        the first training dataset (its first frame, condition latents, image embedding)."""
        if getattr(self, "_conditioning", None) is None:
            backend = self.backends.image_datasets[0]
            ds = self.samples[backend.id] if self.samples is not None else discover(
                backend, self.config, self.adapter.resolution_multiple,
                temporal_compression=self.adapter.temporal_compression)
            cache = TensorCache(backend.cache_dir_vae)
            keys = [latent_key(s, self._identity()[0]) for s in ds.samples]
            key = next((k for k in keys if cache.has(k)), None)
            if key is None:
                raise DatasetError(f"datasets[{backend.id}]: no cached clip to take the validation's first frame from")
            self._conditioning = {k: v for k, v in cache.load(key).items() if k != "latents"}
        return self._conditioning

    def _validation_embedding(self, prompt: str, reference: Sample | None = None) -> dict[str, torch.Tensor]:
        text = self.prompt_embedding(prompt, reference=reference)
        return {**text, **self.validation_conditioning()} if getattr(self.adapter, "is_i2v", False) else text

    def runner(self) -> ValidationRunner:
        if self._runner is None:
            decoder = self.adapter.load_preview_decoder() if self.config.validation_preview else None
            self._runner = ValidationRunner(self.config, self.adapter, self._validation_embedding,
                                            negative_embeddings=self.negative_embedding, preview_decoder=decoder,
                                            on_preview=self._send_preview, on_image=self._send_image,
                                            autocast=self.accelerator.autocast, references=self.reference_latents,
                                            reference_samples=self.reference_sample)
        return self._runner

    def _send_image(self, image: ValidationImage, step: int) -> None:
        self.reporter.image("validation", step, image.path, prompt=image.prompt, nickname=image.nickname,
                            resolution=image.resolution, video_path=image.video_path, seed=image.seed)

    def _send_preview(self, preview: PreviewImage, step: int) -> None:
        self._previews.append(preview)
        self.reporter.image("preview", step, preview.path, prompt=preview.prompt, nickname=preview.nickname,
                            resolution=preview.resolution, inference_step=preview.inference_step)

    def clip_scores(self, images: list[ValidationImage]) -> dict[str, float]:
        """``clip_score/<nickname>`` (mean over resolutions) and ``clip_score/mean`` (over every image)."""
        if self._scorer is None:
            from simpletuner.evaluation.clip_score import ClipScorer, clip_model_path

            self._scorer = ClipScorer(clip_model_path(self.config), self.accelerator.device)
        with preserve_rng_state():
            scores = self._scorer.score([im.image for im in images], [im.prompt for im in images])
        per_prompt: dict[str, list[float]] = {}
        for im, score in zip(images, scores):
            per_prompt.setdefault(im.nickname, []).append(score)
        metrics = {f"clip_score/{name}": sum(v) / len(v) for name, v in per_prompt.items()}
        metrics["clip_score/mean"] = sum(scores) / len(scores)
        return metrics
