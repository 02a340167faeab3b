"""Find training images and videos, read their captions and decide each one's bucket, crop and (videos) clips.

Everything here is deterministic from the file and the dataset settings, so a sample's cache key (see
``cache.py``) names exactly the pixels that get encoded. For a video family (``temporal_compression`` given) every
sample is a clip of ``frames`` frames, bucketed by (frames, width, height); an image is a 1-frame clip.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from PIL import Image, ImageOps

from simpletuner.config import paths
from simpletuner.config.buckets import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, BucketRule, plan_image, seed_key
from simpletuner.config.buckets import bucket_size  # noqa: F401  (the data layer's name for it)
from simpletuner.config.scan import chosen_caption_strategy, media_files

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A problem with a dataset's files (names the dataset id and the file or folder)."""


@dataclass(frozen=True)
class Sample:
    """One training image, its caption, and how it is turned into pixels."""

    dataset_id: str
    path: str
    caption: str
    target_size: tuple[int, int]  # (width, height) of the bucket
    resize_to: tuple[int, int]  # size before cropping
    crop_box: tuple[int, int, int, int]  # left, top, right, bottom in the resized image
    is_regularisation: bool = False
    file_size: int = 0
    mtime_ns: int = 0
    # source frame indices of a video family's clip ((0,) for an image); None in an image family
    frame_indices: tuple[int, ...] | None = None
    original_size: tuple[int, int] | None = None  # (width, height) of the file, before any resize or crop
    conditioning: Sample | None = None  # the paired reference image, prepared exactly as this one
    mask: Sample | None = None  # the paired loss mask, likewise

    @property
    def num_frames(self) -> int | None:
        return None if self.frame_indices is None else len(self.frame_indices)

    @property
    def bucket(self) -> tuple[int, ...]:
        """(width, height) in an image family; (frames, width, height) in a video family."""
        return self.target_size if self.frame_indices is None else (len(self.frame_indices), *self.target_size)


@dataclass
class DatasetSamples:
    dataset_id: str
    samples: list[Sample] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    repeats: int = 0
    probability: float = 1.0  # relative chance of a batch coming from this dataset (see sampler.py)


def bucket_rule(backend, defaults) -> BucketRule:
    """The dataset's size settings, its empty resolution fields filled from ``defaults`` (the TrainConfig)."""
    return BucketRule(
        resolution=backend.resolution or defaults.resolution,
        resolution_type=backend.resolution_type or defaults.resolution_type,
        minimum=backend.minimum_image_size, maximum=backend.maximum_image_size,
        downsample=backend.target_downsample_size, crop=bool(backend.crop),
        crop_aspect=backend.crop_aspect or "square", crop_style=backend.crop_style or "center")


def read_caption(backend, path: Path, strategy: str | None = None) -> str:
    """``path``'s caption under ``strategy`` (default: the dataset's caption_strategy, else 'filename')."""
    strategy = strategy or getattr(backend, "caption_strategy", None) or "filename"
    if strategy == "instanceprompt":
        return backend.instance_prompt
    if strategy == "textfile":
        txt = path.with_suffix(".txt")
        if not txt.is_file():
            raise DatasetError(f"datasets[{backend.id}]: caption file {txt} is missing (caption_strategy=textfile)")
        caption = txt.read_text(encoding="utf-8").strip()
        # SimpleTuner textfiles may hold several captions, one per line; the first one is used here
        return caption.splitlines()[0].strip() if caption else ""
    stem = path.stem
    return " ".join(stem.replace("_", " ").split())


def discover(backend, defaults, multiple: int, *, temporal_compression: int | None = None) -> DatasetSamples:
    """All usable images (and, for a video family, videos) of one dataset backend, sorted by path (the sampler
    shuffles). ``temporal_compression``: the video family's frames per latent frame (clips are ``k * it + 1`` frames
    long); None for an image family. Unreadable or unusable files are skipped with a warning naming them."""
    from simpletuner.data.video import plan_clips, probe

    root = Path(backend.instance_data_dir).expanduser()
    if not root.is_dir():
        raise DatasetError(f"datasets[{backend.id}].instance_data_dir: folder {root} does not exist")
    if temporal_compression is None and getattr(backend, "dataset_type", "image") == "video":
        raise DatasetError(f"datasets[{backend.id}].dataset_type: 'video' needs a video model family "
                           "(wan, ltxvideo, ltxvideo2, hunyuanvideo); this one trains on images")
    result = DatasetSamples(backend.id, repeats=int(getattr(backend, "repeats", 0) or 0),
                            probability=float(getattr(backend, "probability", 1.0) or 1.0))
    video = temporal_compression is not None
    files = media_files(root, video)
    strategy = chosen_caption_strategy(backend, files)
    rule = bucket_rule(backend, defaults)
    roots = paths.roots_from_env()
    for path in files:
        if roots is not None and not all(paths.within(os.path.realpath(p), roots)
                                         for p in (path, path.with_suffix(".txt"))):
            result.skipped.append((str(path), "it or its caption file links outside the allowed roots"))
            continue
        is_video = path.suffix.lower() in VIDEO_EXTENSIONS
        try:
            if is_video:
                info = probe(path)
                width, height = info.width, info.height
            else:
                with Image.open(path) as im:
                    width, height = ImageOps.exif_transpose(im).size
        except Exception as exc:  # a broken file is skipped, not fatal
            result.skipped.append((str(path), f"unreadable {'video' if is_video else 'image'}: {exc}"))
            continue
        if is_video:
            clips, reason = plan_clips(info, getattr(backend, "video", None), temporal_compression)
            if not clips:
                result.skipped.append((str(path), reason))
                continue
        else:
            clips = [(0,)] if video else [None]
        stat = path.stat()
        plan, reason = plan_image(rule, width, height, multiple,
                                  seed_key(str(path.resolve()), stat.st_size, stat.st_mtime_ns))
        if plan is None:
            result.skipped.append((str(path), reason))
            continue
        target, resize_to, crop_box = plan
        caption = read_caption(backend, path, strategy)
        for frames in clips:
            result.samples.append(Sample(
                dataset_id=backend.id, path=str(path.resolve()), caption=caption,
                target_size=target, resize_to=resize_to, crop_box=crop_box,
                is_regularisation=bool(getattr(backend, "is_regularisation_data", False)),
                file_size=stat.st_size, mtime_ns=stat.st_mtime_ns, frame_indices=frames,
                original_size=(width, height),
            ))
    for file, reason in result.skipped:
        log.warning("datasets[%s]: skipping %s: %s", backend.id, file, reason)
    return result


def _image_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def pair(samples: list[Sample], backend, paired_backend, kind: str) -> list[Sample]:
    """``samples`` (of ``backend``) each with its file of ``paired_backend`` attached as ``kind`` ('conditioning'
    or 'mask'): the file at the same path relative to instance_data_dir (or, when no file has that exact name, the
    one with the same name and another image extension), prepared with the sample's own bucket, resize and crop so
    the two stay pixel-aligned. DatasetError naming both datasets when a sample has no partner."""
    root = Path(backend.instance_data_dir).expanduser().resolve()
    paired_root = Path(paired_backend.instance_data_dir).expanduser()
    where = f"datasets[{backend.id}].conditioning_data"
    if not paired_root.is_dir():
        raise DatasetError(f"datasets[{paired_backend.id}].instance_data_dir: folder {paired_root} does not exist")
    files = {p.relative_to(paired_root).as_posix(): p for p in _image_files(paired_root)}
    by_stem: dict[str, list[Path]] = {}
    for rel, path in files.items():
        by_stem.setdefault(rel.rsplit(".", 1)[0], []).append(path)
    out, missing, reshaped = [], [], 0
    for s in samples:
        rel = Path(s.path).relative_to(root).as_posix()
        partner = files.get(rel)
        if partner is None:
            candidates = by_stem.get(rel.rsplit(".", 1)[0], [])
            partner = candidates[0] if len(candidates) == 1 else None
        if partner is None:
            missing.append(rel)
            continue
        with Image.open(partner) as im:
            width, height = ImageOps.exif_transpose(im).size
        if s.original_size and abs(math.log((width / height) / (s.original_size[0] / s.original_size[1]))) > 0.02:
            reshaped += 1
        stat = partner.stat()
        other = Sample(dataset_id=paired_backend.id, path=str(partner.resolve()), caption="",
                       target_size=s.target_size, resize_to=s.resize_to, crop_box=s.crop_box,
                       file_size=stat.st_size, mtime_ns=stat.st_mtime_ns, original_size=(width, height))
        out.append(replace(s, **{kind: other}))
    if missing:
        raise DatasetError(f"{where}: {len(missing)} of {len(samples)} image(s) have no file in "
                           f"datasets[{paired_backend.id}] ({paired_root}), e.g. {missing[:3]}; files are paired by "
                           "their path relative to instance_data_dir")
    if reshaped:
        log.warning("%s: %d %s image(s) of datasets[%s] have another aspect ratio than their image and are "
                    "stretched to its crop", where, reshaped, kind, paired_backend.id)
    return out


def with_pairs(backends, backend, samples: list[Sample]) -> list[Sample]:
    """``samples`` of ``backend`` with the conditioning and mask files its ``conditioning_data`` pairs them with."""
    for kind in ("conditioning", "mask"):
        paired = backends.paired(backend, kind)
        if paired is not None:
            samples = pair(samples, backend, paired, kind)
    return samples


def _to_tensor(im):
    import numpy as np
    import torch

    arr = torch.from_numpy(np.asarray(im, dtype=np.float32).copy()).permute(2, 0, 1)
    return arr / 127.5 - 1.0


def load_pixels(sample: Sample):
    """The sample's pixels as a float tensor in [-1, 1]: (3, H, W) for an image family's image, (3, F, H, W) for a
    video family's clip (F = 1 for an image). Raises (naming nothing; the caller names the file) if it cannot be
    decoded."""
    import torch

    from simpletuner.data.video import decode_frames

    if Path(sample.path).suffix.lower() in VIDEO_EXTENSIONS:
        frames = decode_frames(sample.path, sample.frame_indices)
    else:
        with Image.open(sample.path) as im:
            frames = [ImageOps.exif_transpose(im).convert("RGB")]
    tensors = [_to_tensor(f.convert("RGB").resize(sample.resize_to, Image.Resampling.LANCZOS).crop(sample.crop_box))
               for f in frames]
    if sample.frame_indices is None:
        return tensors[0]
    return torch.stack(tensors, dim=1)


def reference_sample(path: Path, width: int, height: int) -> Sample:
    """An image file fitted to width x height as a Sample: resized to cover the size, centre-cropped (how a
    validation reference image is fitted to a validation resolution); its resolved path, size and mtime make its
    cache keys."""
    with Image.open(path) as im:
        w, h = ImageOps.exif_transpose(im).size
    scale = max(width / w, height / h)
    rw, rh = max(width, math.ceil(w * scale)), max(height, math.ceil(h * scale))
    left, top = (rw - width) // 2, (rh - height) // 2
    stat = Path(path).stat()
    return Sample("reference", str(Path(path).resolve()), "", (width, height), (rw, rh),
                  (left, top, left + width, top + height), file_size=stat.st_size, mtime_ns=stat.st_mtime_ns,
                  original_size=(w, h))


def load_pixels_at(path: Path, width: int, height: int):
    """An image file as pixels in [-1, 1], (3, height, width), fitted as ``reference_sample`` fits it."""
    return load_pixels(reference_sample(path, width, height))


def load_mask(sample: Sample, latent_size: tuple[int, int]):
    """The sample's mask file as loss weights at latent resolution, (1, h, w) in [0, 1]: white trains, black is
    ignored; the pixels are prepared like the image's (resize, crop), then area-averaged down to the latents."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    with Image.open(sample.path) as im:
        im = ImageOps.exif_transpose(im).convert("L")
        im = im.resize(sample.resize_to, Image.Resampling.BILINEAR).crop(sample.crop_box)
    pixels = torch.from_numpy(np.asarray(im, dtype=np.float32).copy())[None, None] / 255.0
    return F.interpolate(pixels, size=latent_size, mode="area")[0]
