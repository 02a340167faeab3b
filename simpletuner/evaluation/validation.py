"""Validation images and live previews from the family's diffusers pipeline, built around the training model.

The pipeline wraps the training transformer itself (LoRA active, no second copy of the weights). While it runs,
the transformer is in eval mode (dropout off) with TREAD routing off and no autograd; afterwards every module's
train/eval flag and every RNG (python, numpy, torch, CUDA) is put back, so a run with validation trains exactly as
one without.

Images are written to ``<output_dir>/validation/step_<N>/<nickname>_<W>x<H>.png``; previews (the Tiny
AutoEncoder's decode of the latents every ``validation_preview_steps`` denoising steps) to
``.../step_<N>/previews/<nickname>_<W>x<H>_<inference step>.png``. A video family writes
``<nickname>_<W>x<H>.mp4`` (H.264, ``framerate`` fps) and its first frame as the ``.png`` poster; its previews
decode the first latent frame (the poster frame) with the family's own VAE, since diffusers has no tiny video
autoencoder. Previews are decoded in float32 on the CPU, where bfloat16 convolutions are many times slower.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from simpletuner.evaluation.prompts import ValidationPrompt

log = logging.getLogger("simpletuner.evaluation")


@contextlib.contextmanager
def preserve_rng_state(*generators: torch.Generator) -> Iterator[None]:
    """Restore python's, numpy's, torch's (CPU and every CUDA device's) and ``generators``' RNG states on exit."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    own = [(g, g.get_state()) for g in generators if g is not None]
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        for g, state in own:
            g.set_state(state)


@contextlib.contextmanager
def inference_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Eval mode, TREAD routing off and no autograd for the duration; each module's own flags restored after."""
    flags = [(m, m.training) for m in model.modules()]
    handle = getattr(model, "_tread_handle", None)
    tread_enabled = handle.enabled if handle is not None else None
    model.eval()
    if handle is not None:
        handle.enabled = False
    try:
        with torch.no_grad():
            yield model
    finally:
        for module, training in flags:
            module.training = training
        if handle is not None:
            handle.enabled = tread_enabled


def to_pil(pixels: torch.Tensor):
    """(3, H, W) in [-1, 1] -> PIL image."""
    from PIL import Image

    arr = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(arr)


@dataclass
class ValidationImage:
    nickname: str
    prompt: str
    resolution: tuple[int, int]  # (width, height)
    path: Path  # the image, or a video's poster frame
    image: object  # PIL image (a video's first frame)
    video_path: Path | None = None  # the mp4 of a video family
    num_frames: int | None = None
    seed: int | None = None  # the generator seed it was made with

    @property
    def name(self) -> str:
        return f"{self.nickname}_{self.resolution[0]}x{self.resolution[1]}"


@dataclass
class PreviewImage:
    nickname: str
    prompt: str
    resolution: tuple[int, int]
    inference_step: int
    path: Path
    image: object = None  # PIL image

    @property
    def name(self) -> str:
        return f"{self.nickname}_{self.resolution[0]}x{self.resolution[1]}"


def preview_strips(previews: list[PreviewImage]) -> dict[str, tuple[object, str]]:
    """One image per validation image: its previews side by side in denoising order, with a caption naming the
    steps, as ``{"<nickname>_<W>x<H>": (strip, caption)}`` for the trackers."""
    from PIL import Image

    grouped: dict[str, list[PreviewImage]] = {}
    for preview in previews:
        if preview.image is not None:
            grouped.setdefault(preview.name, []).append(preview)
    strips = {}
    for name, items in grouped.items():
        items.sort(key=lambda p: p.inference_step)
        width, height = items[0].image.size
        strip = Image.new("RGB", (width * len(items), height))
        for i, item in enumerate(items):
            strip.paste(item.image.convert("RGB"), (i * width, 0))
        steps = ", ".join(str(p.inference_step) for p in items)
        strips[name] = (strip, f"{items[0].prompt} (denoising steps {steps})")
    return strips


def write_frames(folder: Path, name: str, frames: list, adapter) -> tuple[Path, Path | None]:
    """A validation image ``<name>.png`` (a video's poster frame) and, for a video family, ``<name>.mp4`` at the
    family's validation frame rate; returns (image path, video path or None)."""
    path = folder / f"{name}.png"
    frames[0].save(path)
    if not adapter.is_video:
        return path, None
    from simpletuner.evaluation.video import write_mp4

    video_path = path.with_suffix(".mp4")
    write_mp4(video_path, frames, adapter.validation_fps())
    return path, video_path


def step_folder(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "validation" / f"step_{step}"


class ValidationRunner:
    """Generates one step's validation images (and previews) for a list of prompts and resolutions.

    ``embeddings(prompt) -> {name: tensor}`` returns a prompt's cached text embedding (no batch dimension), and
    ``negative_embeddings`` the negative prompt's (as the pipeline encodes negatives; ``embeddings`` if not given);
    ``references(prompt, width, height)`` the reference image an edit model edits for that prompt at that size: its
    latents (C, h, w), or a dict of tensors without a batch dimension (``reference_latents``, ``reference_pixels``),
    None without references. Where the adapter's prompt embedding sees the reference (``prompt_takes_reference``),
    ``reference_samples(prompt, width, height)`` gives that image's Sample and the embeddings are asked for as
    ``embeddings(prompt, sample)``. ``preview_decoder`` is an AutoencoderTiny (or None for no previews);
    ``on_preview(preview, step)`` and ``on_image(image, step)`` are called as each preview / image is written.
    """

    def __init__(self, config, adapter, embeddings: Callable[[str], dict], *,
                 negative_embeddings: Callable[[str], dict] | None = None, preview_decoder=None,
                 on_preview: Callable[[PreviewImage, int], None] | None = None,
                 on_image: Callable[[ValidationImage, int], None] | None = None, autocast=None,
                 references: Callable[[ValidationPrompt, int, int], torch.Tensor | dict | None] | None = None,
                 reference_samples: Callable[[ValidationPrompt, int, int], object] | None = None):
        self.config = config
        self.adapter = adapter
        self.embeddings = embeddings
        self.negative_embeddings = negative_embeddings or embeddings
        self.references = references
        self.reference_samples = reference_samples
        self.preview_decoder = preview_decoder
        self.on_preview = on_preview
        self.on_image = on_image
        self.autocast = autocast or contextlib.nullcontext
        self.seed = config.validation_seed if config.validation_seed is not None else (config.seed or 0)
        self.negative_prompt = config.validation_negative_prompt or ""

    def negative_needed(self) -> bool:
        return self.adapter.uses_negative_prompt(self.config.validation_guidance, self.config.validation_guidance_real)

    def run(self, transformer, prompts: list[ValidationPrompt], resolutions: list[tuple[int, int]],
            step: int) -> list[ValidationImage]:
        folder = step_folder(self.config.output_dir, step)
        folder.mkdir(parents=True, exist_ok=True)
        results = []
        with preserve_rng_state(), inference_mode(transformer), contextlib.ExitStack() as scope:
            pipeline = self.adapter.build_validation_pipeline(transformer)
            pipeline.set_progress_bar_config(disable=True)
            if self.adapter.device.type == "cpu" and getattr(pipeline, "vae", None) is not None:
                scope.enter_context(_float32_decode(pipeline.vae))
            per_reference = self.adapter.prompt_takes_reference  # embeddings differ per reference image
            shared_negative = None
            if self.negative_needed() and not per_reference:
                shared_negative = self._embeddings(self.negative_prompt, negative=True)
            for item in prompts:
                shared = None if per_reference else self._embeddings(item.prompt)
                for width, height in resolutions:
                    text, negative = shared, shared_negative
                    if per_reference:
                        sample = self.reference_samples(item, width, height)
                        text = self._embeddings(item.prompt, reference=sample)
                        if self.negative_needed():
                            negative = self._embeddings(self.negative_prompt, negative=True, reference=sample)
                    reference = self.references(item, width, height) if self.references is not None else None
                    if reference is not None:
                        if not isinstance(reference, dict):
                            reference = {"reference_latents": reference}
                        text = {**text, **{k: v.unsqueeze(0).to(self.adapter.device) for k, v in reference.items()}}
                    frames = self._generate(pipeline, item, text, negative, width, height, step, folder)
                    path, video_path = write_frames(folder, f"{item.nickname}_{width}x{height}", frames,
                                                    self.adapter)
                    result = ValidationImage(item.nickname, item.prompt, (width, height), path, frames[0],
                                             video_path, len(frames) if video_path else None, self.seed)
                    results.append(result)
                    if self.on_image is not None:
                        self.on_image(result, step)
        return results

    def _embeddings(self, prompt: str, *, negative: bool = False, reference=None) -> dict[str, torch.Tensor]:
        device = self.adapter.device
        embed = self.negative_embeddings if negative else self.embeddings
        embedding = embed(prompt) if reference is None else embed(prompt, reference)
        # float32: under mixed precision autocast casts for the transformer while the VAE decodes in fp32
        return {k: v.unsqueeze(0).to(device, torch.float32) for k, v in embedding.items()}

    def _generate(self, pipeline, item, text, negative, width, height, step, folder):
        kwargs = self.adapter.validation_pipeline_kwargs(
            text, negative, guidance=self.config.validation_guidance,
            guidance_real=self.config.validation_guidance_real,
        )
        kwargs.update(self.adapter.validation_attention_kwargs(text, negative, width, height))
        every = self.config.validation_preview_steps
        if self.preview_decoder is not None:
            kwargs.update(self.adapter.preview_callback_kwargs(
                self._preview_callback(item, width, height, step, folder, every)))
        generator = torch.Generator("cpu").manual_seed(self.seed)
        size = self.adapter.pipeline_call_kwargs(height=height, width=width)
        if self.adapter.is_video:
            kwargs.update(self.adapter.validation_conditioning(text, height, width))
            with self.autocast():
                out = pipeline(**size, num_inference_steps=self.config.validation_num_inference_steps,
                               generator=generator, output_type="np", **kwargs)
            video = np.asarray(out.frames[0])  # (frames, H, W, 3) in [0, 1]
            from PIL import Image

            return [Image.fromarray((frame.clip(0, 1) * 255).round().astype(np.uint8)) for frame in video]
        with self.autocast():
            out = pipeline(**size, num_inference_steps=self.config.validation_num_inference_steps,
                           generator=generator, output_type="pil", **kwargs)
        return [out.images[0]]

    def _decode_precision(self):
        """The run's autocast on accelerators; float32 on the CPU, where bf16 convolutions are ~25x slower."""
        if self.adapter.device.type == "cpu":
            return torch.autocast("cpu", enabled=False)
        return self.autocast()


    def _preview_callback(self, item: ValidationPrompt, width: int, height: int, step: int, folder: Path, every: int):
        previews = folder / "previews"

        def callback(index, pipeline_latents):
            done = index + 1
            if done % every == 0:
                latents = self.adapter.preview_latents(pipeline_latents, height, width)
                decoder = self.preview_decoder
                with self._decode_precision():
                    pixels = decoder.decode(latents.to(decoder.device, decoder.dtype)).sample[0]
                if pixels.ndim == 4:  # a video VAE's (3, frames, H, W): the poster frame
                    pixels = pixels[:, 0]
                previews.mkdir(parents=True, exist_ok=True)
                path = previews / f"{item.nickname}_{width}x{height}_{done}.png"
                image = to_pil(pixels)
                image.save(path, compress_level=1)  # one per denoising step: fast compression, still lossless
                if self.on_preview is not None:
                    self.on_preview(PreviewImage(item.nickname, item.prompt, (width, height), done, path, image),
                                    step)

        return callback


@contextlib.contextmanager
def _float32_decode(vae):
    """While inside: ``vae.decode`` (as the pipeline calls it, under the run's autocast) runs in float32 with
    autocast off. For the CPU, where a bf16-autocast convolution is many times slower than the float32 one and the
    VAE's weights are float32 anyway."""
    decode = vae.decode

    def float32_decode(latents, *args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return decode(latents.to(vae.dtype), *args, **kwargs)

    vae.decode = float32_decode
    try:
        yield
    finally:
        del vae.decode  # the class's method again
