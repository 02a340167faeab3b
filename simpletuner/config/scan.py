"""What the data will do, checked before anything trains: each dataset folder's files, captions, sizes and
buckets, whether one batch can be formed, and settings that will do nothing.

One function, :func:`scan_data`, serves ``simpletuner validate``, the wizard, the server's API and the web UI. It
is torch-free and reads no pixels: image sizes come from the files' headers (PNG, JPEG with its EXIF orientation,
WebP, BMP), and buckets from :mod:`simpletuner.config.buckets`, the same arithmetic the trainer uses. Errors are
what will make training fail; warnings are what will silently do nothing.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import paths
from .buckets import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, BucketRule, plan_image, seed_key
from .errors import FieldError

EXAMPLES = 5  # file names quoted per problem


# ---- image headers --------------------------------------------------------------------------------------------
def _jpeg_orientation(exif: bytes) -> int:
    """The EXIF orientation tag (1 when absent) of an APP1 payload after ``Exif\\0\\0``."""
    if len(exif) < 8 or exif[:2] not in (b"II", b"MM"):
        return 1
    endian = "<" if exif[:2] == b"II" else ">"
    (ifd,) = struct.unpack(endian + "I", exif[4:8])
    if ifd + 2 > len(exif):
        return 1
    (count,) = struct.unpack(endian + "H", exif[ifd:ifd + 2])
    for i in range(count):
        at = ifd + 2 + 12 * i
        if at + 12 > len(exif):
            break
        tag, kind = struct.unpack(endian + "HH", exif[at:at + 4])
        if tag == 0x0112 and kind == 3:  # SHORT
            return struct.unpack(endian + "H", exif[at + 8:at + 10])[0]
    return 1


def _jpeg_size(fh) -> tuple[int, int] | None:
    orientation = 1
    fh.seek(2)
    while True:
        byte = fh.read(1)
        while byte and byte != b"\xff":
            byte = fh.read(1)
        while byte == b"\xff":
            byte = fh.read(1)
        if not byte:
            return None
        marker = byte[0]
        if marker in (0x01, *range(0xD0, 0xD8)):
            continue  # standalone markers carry no length
        raw = fh.read(2)
        if len(raw) < 2:
            return None
        (length,) = struct.unpack(">H", raw)
        if marker in (*range(0xC0, 0xC4), *range(0xC5, 0xC8), *range(0xC9, 0xCC), *range(0xCD, 0xD0)):
            data = fh.read(5)
            if len(data) < 5:
                return None
            height, width = struct.unpack(">HH", data[1:5])
            return (height, width) if orientation in (5, 6, 7, 8) else (width, height)
        payload = fh.read(length - 2)
        if marker == 0xE1 and payload[:6] == b"Exif\x00\x00":
            orientation = _jpeg_orientation(payload[6:])
        if marker == 0xD9:
            return None


def image_size(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(width, height) as the trainer sees the image (a JPEG's EXIF rotation applied), read from the file's header;
    None when the header is not one of PNG, JPEG, WebP or BMP or is damaged."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(32)
            if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
                return struct.unpack(">II", head[16:24])
            if head[:2] == b"\xff\xd8":
                return _jpeg_size(fh)
            if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
                kind = head[12:16]
                if kind == b"VP8X":
                    w, h = head[24:27], head[27:30]
                    return int.from_bytes(w, "little") + 1, int.from_bytes(h, "little") + 1
                if kind == b"VP8L" and head[20] == 0x2F:
                    b = head[21:25]
                    return 1 + (b[0] | (b[1] & 0x3F) << 8), 1 + (b[1] >> 6 | b[2] << 2 | (b[3] & 0x0F) << 10)
                if kind == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
                    w, h = struct.unpack("<HH", head[26:30])
                    return w & 0x3FFF, h & 0x3FFF
                return None
            if head[:2] == b"BM":
                (header,) = struct.unpack("<I", head[14:18])
                if header == 12:  # OS/2 BITMAPCOREHEADER
                    return struct.unpack("<HH", head[18:22])
                w, h = struct.unpack("<ii", head[18:26])
                return abs(w), abs(h)
    except (OSError, struct.error, IndexError):
        return None
    return None


# ---- one dataset ----------------------------------------------------------------------------------------------
@dataclass
class DatasetScan:
    """What one dataset folder holds and what training will make of it."""

    id: str
    dataset_type: str
    folder: str  # as it resolves
    exists: bool = False
    images: int = 0
    videos: int = 0
    caption_files: int = 0  # .txt files beside a training file
    caption_strategy: str = "filename"  # the one that applies (the dataset's, or the scan's choice when unset)
    caption_strategy_chosen: bool = False  # True when the dataset does not set it and the scan chose
    captioned: int = 0  # files that have a caption under that strategy
    missing_captions: list[str] = field(default_factory=list)
    too_small: int = 0
    too_small_examples: list[str] = field(default_factory=list)
    unreadable: int = 0
    unreadable_examples: list[str] = field(default_factory=list)
    outside_roots: int = 0
    usable: int = 0
    buckets: dict[str, int] = field(default_factory=dict)  # "WxH" -> images (videos are measured when training)
    batches: int | None = None  # batches per epoch at train_batch_size (None: videos, counted when training)
    left_over: int = 0  # images in buckets that never fill a batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def media_files(folder: Path, video: bool) -> list[Path]:
    """The files the trainer reads from ``folder`` (recursively), sorted by path."""
    wanted = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS if video else IMAGE_EXTENSIONS
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in wanted and p.is_file())


def chosen_caption_strategy(dataset, files: list[Path]) -> str:
    """The dataset's caption_strategy; when it sets none, ``textfile`` if any of its files has a ``.txt`` caption
    beside it, else ``filename``. The trainer and the scan both decide with this."""
    if getattr(dataset, "caption_strategy", None):
        return dataset.caption_strategy
    return "textfile" if any(p.with_suffix(".txt").is_file() for p in files) else "filename"


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def scan_dataset(dataset, defaults, *, base: str | os.PathLike[str] | None = None, multiple: int = 16,
                 video_family: bool = False, batch_size: int = 1, roots: list[Path] | None = None) -> DatasetScan:
    """Scan one dataset entry (a :class:`~simpletuner.config.data.DatasetBackend`). ``defaults`` gives the
    resolution settings a dataset leaves empty (the TrainConfig); relative folders resolve from ``base`` (default:
    the working directory); files resolving outside ``roots`` are skipped, as the trainer skips them."""
    folder = Path(paths.resolve(dataset.instance_data_dir, Path(base) if base else Path.cwd()))
    out = DatasetScan(id=dataset.id, dataset_type=dataset.dataset_type, folder=str(folder))
    out.exists = folder.is_dir()
    if not out.exists:
        return out
    files = media_files(folder, video_family)
    out.caption_strategy = chosen_caption_strategy(dataset, files)
    out.caption_strategy_chosen = not getattr(dataset, "caption_strategy", None)
    paired = dataset.dataset_type in ("conditioning", "mask")
    # as simpletuner.data.discovery.bucket_rule builds it (the data layer is the trainer's reader of these fields)
    rule = BucketRule(dataset.resolution or defaults.resolution, dataset.resolution_type or defaults.resolution_type,
                      dataset.minimum_image_size, dataset.maximum_image_size, dataset.target_downsample_size,
                      bool(dataset.crop), dataset.crop_aspect or "square", dataset.crop_style or "center")
    buckets: Counter = Counter()
    for path in files:
        rel = _rel(path, folder)
        if roots is not None and not all(paths.within(os.path.realpath(p), roots)
                                         for p in (path, path.with_suffix(".txt"))):
            out.outside_roots += 1
            continue
        if path.suffix.lower() in VIDEO_EXTENSIONS:
            out.videos += 1
        else:
            out.images += 1
        has_txt = path.with_suffix(".txt").is_file()
        out.caption_files += has_txt
        if out.caption_strategy != "textfile" or has_txt:
            out.captioned += 1
        elif len(out.missing_captions) < EXAMPLES:
            out.missing_captions.append(rel)
        if path.suffix.lower() in VIDEO_EXTENSIONS:
            out.usable += 1  # its frames and size are read when training starts (PyAV)
            continue
        size = image_size(path)
        if size is None or min(size) <= 0:
            out.unreadable += 1
            if len(out.unreadable_examples) < EXAMPLES:
                out.unreadable_examples.append(rel)
            continue
        stat = path.stat()
        plan, _reason = plan_image(rule, size[0], size[1], multiple,
                                   seed_key(str(path.resolve()), stat.st_size, stat.st_mtime_ns))
        if plan is None:
            out.too_small += 1
            if len(out.too_small_examples) < EXAMPLES:
                out.too_small_examples.append(f"{rel} ({size[0]}x{size[1]})")
            continue
        out.usable += 1
        buckets[plan[0]] += 1
    out.buckets = {f"{w}x{h}": n for (w, h), n in sorted(buckets.items())}
    if dataset.dataset_type in ("image", "video") and not paired:
        if out.videos:
            out.batches = None
        else:
            copies = 1 + int(getattr(dataset, "repeats", 0) or 0)
            out.batches = sum((n * copies) // batch_size for n in buckets.values())
            out.left_over = sum(n for n in buckets.values() if n * copies < batch_size)
    return out


# ---- the whole run ----------------------------------------------------------------------------------------------
@dataclass
class DataScan:
    """:func:`scan_data`'s answer: one :class:`DatasetScan` per enabled dataset, errors (what will fail) and
    warnings (what will do nothing), and the summary lines ``validate`` prints."""

    datasets: list[DatasetScan] = field(default_factory=list)
    errors: list[FieldError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"datasets": [d.to_dict() for d in self.datasets],
                "errors": [{"path": e.path, "message": e.message} for e in self.errors],
                "warnings": list(self.warnings), "summary": self.summary()}

    def summary(self) -> list[str]:
        lines = []
        for d in self.datasets:
            where = f"datasets[{d.id}]"
            if not d.exists:
                lines.append(f"{where}: folder {d.folder} does not exist")
                continue
            media = f"{d.images} image{'s' * (d.images != 1)}"
            if d.videos:
                media += f", {d.videos} video{'s' * (d.videos != 1)}"
            if d.dataset_type in ("conditioning", "mask"):
                lines.append(f"{where} ({d.dataset_type}): {media} in {d.folder}")
                continue
            how = f"caption_strategy {d.caption_strategy}" + (" (chosen from the folder)" if d.caption_strategy_chosen
                                                               else "")
            parts = [f"{media} in {d.folder}", f"{d.captioned} with captions ({how})"]
            if d.too_small:
                parts.append(f"{d.too_small} too small")
            if d.unreadable:
                parts.append(f"{d.unreadable} unreadable")
            buckets = ", ".join(f"{k}: {n}" for k, n in d.buckets.items()) or "none"
            parts.append(f"buckets {buckets}")
            if d.batches is not None:
                parts.append(f"{d.batches} batch{'es' * (d.batches != 1)} per epoch")
            lines.append(f"{where} ({d.dataset_type}): " + "; ".join(parts))
        return lines


def _dataset_errors(d: DatasetScan, dataset, video_family: bool, out: DataScan) -> None:
    where = f"datasets[{d.id}]"
    if not d.exists:
        what = "is not a folder" if os.path.exists(d.folder) else "does not exist"
        out.errors.append(FieldError(f"{where}.instance_data_dir",
                                     f"folder {dataset.instance_data_dir!r} ({d.folder}) {what}"))
        return
    kinds = sorted(IMAGE_EXTENSIONS | (VIDEO_EXTENSIONS if video_family else set()))
    if not d.images and not d.videos:
        extra = f", {d.outside_roots} linking outside the allowed roots" if d.outside_roots else ""
        out.errors.append(FieldError(f"{where}.instance_data_dir",
                                     f"no training files in {d.folder} (looked for {' '.join(kinds)}{extra})"))
        return
    if d.outside_roots:
        out.warnings.append(f"{where}: {d.outside_roots} file(s) link outside the allowed roots and are skipped")
    if d.dataset_type in ("conditioning", "mask"):
        return
    total = d.images + d.videos
    if d.missing_captions:
        missing = total - d.captioned
        chosen = " (chosen because some files have .txt captions)" if d.caption_strategy_chosen else ""
        out.errors.append(FieldError(
            f"{where}.caption_strategy",
            f"textfile{chosen}: {missing} of {total} file(s) have no .txt caption beside them, e.g. "
            f"{', '.join(d.missing_captions)}; add the captions or set caption_strategy 'filename'"))
    if d.too_small:
        minimum = getattr(dataset, "minimum_image_size", None)
        examples = ", ".join(d.too_small_examples)
        if d.usable == 0:
            out.errors.append(FieldError(f"{where}.minimum_image_size",
                                         f"all {d.too_small} image(s) are smaller than {minimum}, e.g. {examples}"))
        else:
            out.warnings.append(f"{where}.minimum_image_size: {d.too_small} of {total} image(s) are smaller than "
                                f"{minimum} and are skipped, e.g. {examples}")
    if d.unreadable:
        message = f"{d.unreadable} of {total} image(s) cannot be read, e.g. {', '.join(d.unreadable_examples)}"
        if d.usable == 0:
            out.errors.append(FieldError(f"{where}.instance_data_dir", message))
        else:
            out.warnings.append(f"{where}: {message}; they are skipped")
    if d.left_over and d.batches:
        out.warnings.append(f"{where}: {d.left_over} image(s) sit in aspect buckets with fewer images than "
                            "train_batch_size and are never trained")


def _pairing_errors(backends, scans: dict[str, DatasetScan], base, video_family: bool) -> list[FieldError]:
    """Every training file needs its partner in each paired conditioning / mask dataset (same relative path, or
    the same name with another image extension)."""
    errors = []
    for dataset in backends.image_datasets + backends.eval_datasets:
        own = scans.get(dataset.id)
        if own is None or not own.exists:
            continue
        for kind in ("conditioning", "mask"):
            partner = backends.paired(dataset, kind)
            theirs = scans.get(partner.id) if partner is not None else None
            if theirs is None or not theirs.exists:
                continue
            root, other = Path(own.folder), Path(theirs.folder)
            stems = {p.relative_to(other).with_suffix("").as_posix() for p in media_files(other, False)}
            missing = [_rel(p, root) for p in media_files(root, video_family)
                       if p.relative_to(root).with_suffix("").as_posix() not in stems]
            if missing:
                errors.append(FieldError(
                    f"datasets[{dataset.id}].conditioning_data",
                    f"{len(missing)} file(s) have no partner in datasets[{partner.id}] ({other}), e.g. "
                    f"{', '.join(missing[:EXAMPLES])}; files are paired by their path relative to instance_data_dir"))
    return errors


def _batch_check(training: list[DatasetScan], batch_size: int, out: DataScan) -> None:
    """Error when no training dataset fills one batch (the sampler would refuse to start); warn about a dataset
    that never contributes one while others do."""
    measured = [d for d in training if d.batches is not None]
    if training and measured and len(measured) == len(training) and not any(d.batches for d in measured):
        found = "; ".join(f"datasets[{d.id}]: {d.usable} usable, buckets "
                          f"{', '.join(f'{k}: {n}' for k, n in d.buckets.items()) or 'none'}" for d in measured)
        if any(d.usable for d in measured):
            out.errors.append(FieldError(
                "train_batch_size", f"{batch_size}: no aspect bucket holds that many images ({found}); every batch "
                                    "comes from one bucket: lower train_batch_size, add images, or raise the "
                                    "dataset's repeats"))
    elif len(measured) > 1:
        for d in measured:
            if d.usable and not d.batches:
                out.warnings.append(f"datasets[{d.id}]: no aspect bucket fills a batch of train_batch_size="
                                    f"{batch_size}; this dataset is never trained on")


def check_dataset(dataset, defaults, *, family, batch_size: int = 1, base: str | os.PathLike[str] | None = None,
                  roots: list[Path] | None = None) -> DataScan:
    """One dataset on its own (the web UI's dataset page): its scan, errors and warnings, and whether it forms a
    batch of ``batch_size``; ``family`` is a :class:`~simpletuner.config.families.ModelFamily`."""
    video_family = family.modality == "video"
    out = DataScan()
    d = scan_dataset(dataset, defaults, base=base, multiple=family.resolution_multiple, video_family=video_family,
                     batch_size=batch_size, roots=roots)
    out.datasets.append(d)
    _dataset_errors(d, dataset, video_family, out)
    if d.exists:
        _batch_check([d], batch_size, out)
    return out


def scan_data(config, backends, *, base: str | os.PathLike[str] | None = None,
              roots: list[Path] | None = None) -> DataScan:
    """Scan every enabled dataset of ``backends`` (a validated :class:`~simpletuner.config.data.DataBackends`) for
    the run ``config`` (a TrainConfig) describes, and check the settings that depend on the data."""
    family = config.family
    video_family = family.modality == "video"
    out = DataScan()
    scans: dict[str, DatasetScan] = {}
    for dataset in backends.datasets:
        d = scan_dataset(dataset, config, base=base, multiple=family.resolution_multiple, video_family=video_family,
                         batch_size=config.train_batch_size, roots=roots)
        scans[dataset.id] = d
        out.datasets.append(d)
        if dataset.dataset_type == "video" and not video_family:
            out.errors.append(FieldError(f"datasets[{dataset.id}].dataset_type",
                                         f"'video' needs a video model family; {family.name} trains on images"))
            continue
        _dataset_errors(d, dataset, video_family, out)
    out.errors += _pairing_errors(backends, scans, base, video_family)
    _batch_check([scans[d.id] for d in backends.image_datasets if scans[d.id].exists], config.train_batch_size,
                 out)
    errors, warnings = setting_problems(config, backends)
    out.errors += errors
    out.warnings += warnings
    return out


# ---- settings that fail or do nothing --------------------------------------------------------------------------
_VIDEO_ONLY = ("validation_num_video_frames", "framerate")
_FLOW_ONLY = ("flow_schedule_shift", "flow_schedule_auto_shift", "flow_use_uniform_schedule", "flow_sigmoid_scale")
_LORA_ONLY = ("lora_rank", "lora_alpha", "lora_dropout", "lora_init_type", "lora_target", "lora_type")
_EMA_ONLY = ("ema_decay", "ema_update_interval", "ema_device")
_GROUP_OFFLOAD_ONLY = ("group_offload_type", "group_offload_blocks_per_group", "group_offload_use_stream")


def setting_problems(config, backends) -> tuple[list[FieldError], list[str]]:
    """(errors, warnings) for settings that will stop the run or do nothing, given the family and the datasets."""
    errors: list[FieldError] = []
    warnings: list[str] = []
    family = config.family
    user_set = config.model_fields_set

    def ignored(keys, why: str) -> None:
        for key in keys:
            if key in user_set:
                warnings.append(f"{key}: ignored, {why}")

    schedule_free = "schedulefree" in config.optimizer
    if config.lr_warmup_steps and config.lr_scheduler == "constant" and not schedule_free:
        warnings.append(f"lr_warmup_steps: {config.lr_warmup_steps} does nothing with lr_scheduler 'constant' "
                        "(no warmup); use 'constant_with_warmup'")
    if schedule_free and config.lr_scheduler != "constant":
        warnings.append(f"lr_scheduler: {config.lr_scheduler!r} is replaced by 'constant': optimizer "
                        f"{config.optimizer!r} keeps its own schedule")
    if config.eval_steps_interval and not backends.eval_datasets:
        warnings.append("eval_steps_interval: no dataset has dataset_type 'eval', so no eval loss is computed")
    wants_validation = bool(config.validation_steps or config.validation_on_startup)
    has_prompts = bool(config.validation_prompt or config.user_prompt_library)
    if wants_validation and not has_prompts:
        warnings.append("validation_steps: there is no validation_prompt or user_prompt_library, so no validation "
                        "images are made")
    validating = wants_validation and has_prompts
    if config.validation_preview and not validating:
        errors.append(FieldError("validation_preview", "needs validation images (validation_steps or "
                                                       "validation_on_startup, and a validation_prompt)"))
    if config.evaluation_type == "clip" and not validating:
        warnings.append("evaluation_type: 'clip' scores validation images, and none are made, so no CLIP scores")
    multiple = family.resolution_multiple
    for w, h in config.validation_resolutions:
        if w % multiple or h % multiple:
            errors.append(FieldError("validation_resolution", f"{w}x{h} is not a multiple of {multiple} "
                                                              f"(required by model_family {family.name!r})"))
    if family.modality != "video":
        ignored(_VIDEO_ONLY, f"{family.name} makes images, not videos")
    objective = config.prediction_type or family.default_objective
    if objective != "flow_matching":
        ignored(_FLOW_ONLY, f"{family.name} trains with {objective}, not flow matching")
    if config.model_type != "lora":
        ignored(_LORA_ONLY, "model_type is 'full' (no LoRA)")
    if not config.use_ema:
        ignored(_EMA_ONLY, "use_ema is off")
    if not config.enable_group_offload:
        ignored(_GROUP_OFFLOAD_ONLY, "enable_group_offload is off")
    return errors, warnings
