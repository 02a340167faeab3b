"""Aspect buckets as arithmetic: which (width, height) an image of a given size trains at, and whether it is too
small. Pure Python, so the data layer (which then reads the pixels) and the validate-time scan (which reads only
image headers, see :mod:`simpletuner.config.scan`) decide exactly the same buckets.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# what the trainer reads as training files (anything else in a dataset folder is ignored)
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v"})
# aspect ratios used by crop_aspect "closest" / "random"
CROP_ASPECTS = (1.0, 4 / 3, 3 / 4, 3 / 2, 2 / 3, 16 / 9, 9 / 16)


def _round_to(x: float, multiple: int) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


def _area_pixels(resolution: float, resolution_type: str) -> float:
    if resolution_type == "area":  # megapixels, 1.0 == 1024**2 as in SimpleTuner
        return float(resolution) * 1024**2
    return float(resolution) ** 2  # pixel_area: an edge length meaning that edge squared


def bucket_size(width: int, height: int, resolution: float, resolution_type: str, multiple: int) -> tuple[int, int]:
    """The (width, height) an image of this size trains at."""
    aspect = width / height
    if resolution_type == "pixel":  # shorter edge == resolution
        short = float(resolution)
        w, h = (short * aspect, short) if aspect >= 1 else (short, short / aspect)
    else:
        area = _area_pixels(resolution, resolution_type)
        w, h = math.sqrt(area * aspect), math.sqrt(area / aspect)
    return _round_to(w, multiple), _round_to(h, multiple)


def size_measure(width: int, height: int, resolution_type: str) -> float:
    """An image's size in the units of the dataset's resolution_type (edge px, megapixels, or edge of area)."""
    if resolution_type == "pixel":
        return min(width, height)
    if resolution_type == "area":
        return width * height / 1024**2
    return math.sqrt(width * height)


@dataclass(frozen=True)
class BucketRule:
    """A dataset's size settings, resolved: what :func:`plan_image` needs (the data layer and the scan each build
    it from the dataset entry and the config's defaults)."""

    resolution: float
    resolution_type: str
    minimum: float | None = None  # minimum_image_size
    maximum: float | None = None  # maximum_image_size
    downsample: float | None = None  # target_downsample_size
    crop: bool = False
    crop_aspect: str = "square"
    crop_style: str = "center"


def _crop_target(rule: BucketRule, width, height, multiple, rng) -> tuple[int, int]:
    if rule.crop_aspect == "preserve":
        return bucket_size(width, height, rule.resolution, rule.resolution_type, multiple)
    if rule.crop_aspect == "square":
        aspect = 1.0
    elif rule.crop_aspect == "closest":
        aspect = min(CROP_ASPECTS, key=lambda a: abs(math.log(a) - math.log(width / height)))
    else:  # random
        aspect = rng.choice(CROP_ASPECTS)
    return bucket_size(int(1000 * aspect), 1000, rule.resolution, rule.resolution_type, multiple)


def plan_image(rule: BucketRule, width: int, height: int, multiple: int, seed_key: str):
    """Decide (target_size, resize_to, crop_box) for one image of ``width`` x ``height``, or None with the reason
    to skip it. ``seed_key`` (the file's identity) seeds the random crop, so one file always gets the same crop."""
    if rule.minimum and size_measure(width, height, rule.resolution_type) < float(rule.minimum):
        return None, f"smaller than minimum_image_size={rule.minimum} ({width}x{height})"
    rng = random.Random(seed_key)
    downsampled = False
    if rule.crop:
        if rule.maximum and rule.downsample and size_measure(width, height, rule.resolution_type) > rule.maximum:
            width, height = bucket_size(width, height, rule.downsample, rule.resolution_type, 1)
            downsampled = True
        target = _crop_target(rule, width, height, multiple, rng)
    else:
        target = bucket_size(width, height, rule.resolution, rule.resolution_type, multiple)
    tw, th = target
    if downsampled and width >= tw and height >= th:
        # an oversized image is shrunk to target_downsample_size and the crop is a region of it (a detail crop)
        rw, rh = width, height
    else:
        scale = max(tw / width, th / height)
        rw, rh = max(tw, math.ceil(width * scale)), max(th, math.ceil(height * scale))
    if rule.crop_style == "random" and rule.crop:
        left, top = rng.randint(0, rw - tw), rng.randint(0, rh - th)
    elif rule.crop_style == "corner" and rule.crop:
        left, top = 0, 0
    else:
        left, top = (rw - tw) // 2, (rh - th) // 2
    return (target, (rw, rh), (left, top, left + tw, top + th)), None


def seed_key(resolved_path: str, size: int, mtime_ns: int) -> str:
    """The random-crop seed of one file: its resolved path, size and modification time."""
    return f"{resolved_path}|{size}|{mtime_ns}"
