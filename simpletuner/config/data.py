"""The schema of multidatabackend.json: a JSON list of dataset backends plus one text-embeds backend.

Errors name entries ``datasets[<id>].<key>`` (``datasets[<n>]``, the 0-based position, when an entry has no
usable id). Unknown keys are warnings, not errors; SimpleTuner's documented keys that are not fields here are
handled as :mod:`simpletuner.config.simpletuner_keys` says. What the folders hold is checked separately by
:func:`simpletuner.config.scan.scan_data`, because a config may be validated on a machine other than the one that
trains.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from .coerce import Int, Number, StrictModel, check_resolution
from .errors import ConfigError, FieldError, errors_from_validation
from .simpletuner_keys import DATASET_KEYS, apply_rules
from .train import TrainConfig

_NOT_YET = {
    "dataset_type": {"image_embeds", "conditioning_image_embeds", "audio"},
    # reference images cropped independently of their target, ControlNet inputs, segmentation masks
    "conditioning_type": {"reference_loose", "controlnet", "segmentation"},
    "type": {"aws", "csv", "huggingface", "parquet"},
    "caption_strategy": {"parquet", "jsonl", "huggingface", "csv"},
}

def _field(default: Any, description: str, path: str | None = None, **kwargs: Any) -> Any:
    extra = {"group": "data", **({"path": path} if path else {})}  # path: see simpletuner.config.paths
    return Field(default, description=description, json_schema_extra=extra, **kwargs)


CLIP_MODES = ("single_beginning", "single_middle", "multiple_overlapping")


class VideoOptions(StrictModel):
    """SimpleTuner's ``video`` block of a dataset, plus diffusion-pipe's clip modes.

    A clip is ``num_frames`` frames (rounded down to a count the family's VAE takes, e.g. 4k+1 for Wan), sampled at
    ``frame_rate`` (the file's own rate when empty). A video with fewer usable frames than ``num_frames`` trains on
    the frames it has (its own frame bucket) unless that is fewer than ``min_frames``; one with more than
    ``max_frames`` is skipped.
    """

    num_frames: Optional[Int] = Field(None, ge=1, description="frames per training clip; empty = 5 s at frame_rate")
    min_frames: Optional[Int] = Field(None, ge=1, description="skip videos with fewer frames; empty = num_frames")
    max_frames: Optional[Int] = Field(None, ge=1, description="skip videos with more frames than this")
    frame_rate: Optional[Number] = Field(None, gt=0, description="sample clips at this many frames per second; "
                                                                 "empty = the file's own rate")
    is_i2v: Optional[bool] = Field(None, description="condition on each clip's first frame (image-to-video "
                                                     "flavours); empty = what the model flavour does")
    clip_mode: Literal["single_beginning", "single_middle", "multiple_overlapping"] = Field(
        "single_beginning", description="which clip(s) of a longer video train: its first num_frames, the middle "
                                        "ones, or as few overlapping clips as cover it all (diffusion-pipe)")

    @model_validator(mode="before")
    @classmethod
    def _diffusion_pipe_spelling(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "video_clip_mode" in data and "clip_mode" not in data:
            data = {**data, "clip_mode": data["video_clip_mode"]}
            data.pop("video_clip_mode")
        return data

    @model_validator(mode="after")
    def _check(self) -> VideoOptions:
        errors = []
        if self.min_frames is not None and self.max_frames is not None and self.min_frames > self.max_frames:
            errors.append(FieldError("min_frames", f"is larger than max_frames ({self.max_frames})"))
        if self.num_frames is not None and self.max_frames is not None and self.num_frames > self.max_frames:
            errors.append(FieldError("num_frames", f"is larger than max_frames ({self.max_frames})"))
        if errors:
            raise ConfigError(errors)
        return self


# dataset types paired to an image (or eval) dataset through its ``conditioning_data``
PAIRED_TYPES = ("conditioning", "mask")


class DatasetBackend(StrictModel):
    """A folder of training (``image`` or ``video``) or held-out evaluation (``eval``) files with captions, or of
    images paired to those by relative path: reference images (``conditioning``) or loss masks (``mask``)."""

    id: str = _field(..., "unique name of the dataset; also names its caches", min_length=1)
    type: Literal["local"] = _field("local", "storage backend; only 'local' folders are supported")
    dataset_type: Literal["image", "video", "eval", "conditioning", "mask"] = _field(
        "image", "'image' or 'video' for training data, 'eval' for eval loss, 'conditioning' for the reference "
                 "images of an edit model, 'mask' for loss masks; conditioning and mask datasets are paired to an "
                 "image dataset by its conditioning_data"
    )
    instance_data_dir: str = _field(..., "folder of images or videos (searched recursively)", path="dir",
                                    min_length=1)
    resolution: Optional[Number] = _field(
        None, "target size: pixels, or megapixels for resolution_type 'area'; empty = the config's resolution"
    )
    resolution_type: Optional[Literal["pixel", "area", "pixel_area"]] = _field(
        None, "'pixel' (shorter edge), 'area' (megapixels) or 'pixel_area'; empty = the config's"
    )
    minimum_image_size: Optional[Number] = _field(
        None, "skip images smaller than this (same unit as resolution)", gt=0
    )
    maximum_image_size: Optional[Number] = _field(
        None, "images larger than this are first downsampled to target_downsample_size", gt=0
    )
    target_downsample_size: Optional[Number] = _field(
        None, "size that over-large images are downsampled to before cropping", gt=0
    )
    crop: bool = _field(False, "crop images to their bucket instead of only resizing")
    crop_style: Literal["center", "random", "corner"] = _field("random", "where crops are taken")
    crop_aspect: Literal["square", "preserve", "closest", "random"] = _field(
        "square", "aspect ratio of crops"
    )
    caption_strategy: Optional[Literal["filename", "textfile", "instanceprompt"]] = _field(
        None, "captions from the file name, a .txt next to the image, or instance_prompt; empty = 'textfile' when "
              "the folder has .txt captions, else 'filename'"
    )
    instance_prompt: Optional[str] = _field(None, "caption of every image (caption_strategy 'instanceprompt')")
    repeats: Int = _field(0, "extra times each image is seen per epoch (0 = once)", ge=0, le=1_000_000)
    is_regularisation_data: bool = _field(False, "regularisation data (trained against the base model)")
    cache_dir_vae: Optional[str] = _field(None, "latent cache folder; default cache/vae/<id>", path="dir")
    conditioning_data: Optional[list[str]] = _field(
        None, "ids of the conditioning and/or mask datasets paired with this one (each file matched by its path "
              "relative to instance_data_dir, and cropped as its image is)"
    )
    conditioning_type: Optional[Literal["reference_strict", "mask"]] = _field(
        None, "SimpleTuner's kind of a conditioning dataset: 'reference_strict' (prepared exactly like its paired "
              "image, the only kind of reference supported) or 'mask' (the same as dataset_type 'mask')"
    )
    disabled: bool = _field(False, "leave this dataset out")
    probability: float = _field(1.0, "relative chance of drawing a batch from this dataset", gt=0)
    video: Optional[VideoOptions] = _field(
        None, "video options: {num_frames, min_frames, max_frames, frame_rate, is_i2v, clip_mode}"
    )

    @field_validator("conditioning_data", mode="before")
    @classmethod
    def _id_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> DatasetBackend:
        errors = []
        if self.conditioning_type == "mask" and self.dataset_type == "conditioning":
            self.dataset_type = "mask"  # SimpleTuner spells a mask dataset as a conditioning dataset of type mask
        if self.conditioning_type is not None and self.dataset_type not in PAIRED_TYPES:
            errors.append(FieldError("conditioning_type", "applies to conditioning datasets only"))
        if self.conditioning_data and self.dataset_type in PAIRED_TYPES:
            errors.append(FieldError("conditioning_data", f"a {self.dataset_type} dataset is paired to an image "
                                                          "dataset, not the other way round"))
        if self.caption_strategy == "instanceprompt" and not self.instance_prompt:
            errors.append(FieldError("instance_prompt", "is required for caption_strategy 'instanceprompt'"))
        if self.resolution is not None:
            message = check_resolution(self.resolution, self.resolution_type or "pixel_area")
            if message:
                errors.append(FieldError("resolution", message))
        if (
            self.minimum_image_size is not None
            and self.maximum_image_size is not None
            and self.minimum_image_size > self.maximum_image_size
        ):
            errors.append(
                FieldError("minimum_image_size", f"is larger than maximum_image_size ({self.maximum_image_size})")
            )
        if self.maximum_image_size is not None and self.target_downsample_size is None:
            errors.append(FieldError("target_downsample_size", "is required when maximum_image_size is set"))
        if errors:
            raise ConfigError(errors)
        if self.cache_dir_vae is None:
            self.cache_dir_vae = f"cache/vae/{self.id}"
        return self


class TextEmbedsBackend(StrictModel):
    """Where prompt embeddings are cached."""

    id: str = _field(..., "unique name of the backend", min_length=1)
    dataset_type: Literal["text_embeds"] = _field("text_embeds", "always 'text_embeds'")
    type: Literal["local"] = _field("local", "storage backend; only 'local' is supported")
    default: bool = _field(False, "the text-embeds backend used by all datasets")
    cache_dir: Optional[str] = _field(None, "embedding cache folder; default cache/text/<id>", path="dir")
    write_batch_size: Int = _field(128, "embeddings written per batch", ge=1, le=65_536)
    disabled: bool = _field(False, "leave this backend out")

    @model_validator(mode="after")
    def _default_dir(self) -> TextEmbedsBackend:
        if self.cache_dir is None:
            self.cache_dir = f"cache/text/{self.id}"
        return self


Backend = Union[DatasetBackend, TextEmbedsBackend]


@dataclass
class DataBackends:
    """A validated multidatabackend.json.

    ``datasets``: the enabled image/eval datasets in file order; ``text_embeds``: the text-embeds backend in use;
    ``disabled``: ids of entries marked ``disabled``; ``warnings``: unknown keys and similar, as ``path: message``.
    """

    datasets: list[DatasetBackend]
    text_embeds: TextEmbedsBackend
    warnings: list[str] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    source: str | None = None

    @property
    def image_datasets(self) -> list[DatasetBackend]:
        """Enabled training datasets (``dataset_type`` image or video)."""
        return [d for d in self.datasets if d.dataset_type in ("image", "video")]

    @property
    def eval_datasets(self) -> list[DatasetBackend]:
        """Enabled evaluation datasets (``dataset_type`` eval)."""
        return [d for d in self.datasets if d.dataset_type == "eval"]

    def paired(self, dataset: DatasetBackend, kind: str) -> DatasetBackend | None:
        """The ``kind`` ('conditioning' or 'mask') dataset paired with ``dataset`` by its conditioning_data."""
        by_id = {d.id: d for d in self.datasets}
        return next((by_id[i] for i in dataset.conditioning_data or () if by_id[i].dataset_type == kind), None)

    @property
    def uses_references(self) -> bool:
        """The training datasets are paired with reference images: the run trains an edit model."""
        return any(self.paired(d, "conditioning") is not None for d in self.image_datasets)


def _is_true(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on", "t", "y")
    return value is True or value == 1


def _entry_path(index: int, entry: Any) -> str:
    ident = entry.get("id") if isinstance(entry, Mapping) else None
    if isinstance(ident, str) and ident and not any(c in ident for c in "[]"):
        return f"datasets[{ident}]"
    return f"datasets[{index}]"


def _unsupported(entry: Mapping[str, Any], path: str) -> list[FieldError]:
    errors = []
    for key, values in _NOT_YET.items():
        value = entry.get(key)
        if isinstance(value, str) and value.strip().lower() in values:
            if key == "type":
                msg = f"{value!r} is not supported yet; only 'local' backends are supported"
            else:
                msg = f"{value!r} is not supported yet"
            errors.append(FieldError(f"{path}.{key}", msg))
    return errors


def parse_data_backends(
    entries: Any,
    *,
    resolution: float | None = None,
    resolution_type: str | None = None,
    source: str | None = None,
    require_images: bool = True,
) -> DataBackends:
    """Validate the contents of a multidatabackend.json (a list of backend objects).

    Datasets without ``resolution``/``resolution_type`` take the given defaults (the config's ``resolution`` and
    ``resolution_type``; 1024 / pixel_area when None). Raises ConfigError listing every problem. A distillation run
    (``require_images=False``) learns from prompts and needs only the text-embeds backend.
    """
    if isinstance(entries, Mapping):
        raise ConfigError([FieldError("datasets", "expected a JSON list of backends, got an object")], source)
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        raise ConfigError([FieldError("datasets", f"expected a JSON list of backends, got {entries!r}")], source)
    errors: list[FieldError] = []
    warnings: list[str] = []
    datasets: list[DatasetBackend] = []
    text_embeds: list[TextEmbedsBackend] = []
    disabled: list[str] = []
    seen_ids: dict[str, int] = {}
    failed_kinds: set[str] = set()  # kinds of entries already reported invalid: no "missing" error for them

    for index, entry in enumerate(entries):
        path = _entry_path(index, entry)
        if not isinstance(entry, Mapping):
            errors.append(FieldError(path, f"expected an object, got {entry!r}"))
            continue
        entry = {str(k).lstrip("-"): v for k, v in entry.items()}
        if "is_regularization_data" in entry and "is_regularisation_data" not in entry:
            entry["is_regularisation_data"] = entry.pop("is_regularization_data")
        ident = entry.get("id")
        if isinstance(ident, str) and ident:
            if ident in seen_ids:
                errors.append(
                    FieldError(f"{path}.id", f"duplicate id {ident!r} (also used by entry {seen_ids[ident]})")
                )
            seen_ids.setdefault(ident, index)
        if _is_true(entry.get("disabled")):
            # SimpleTuner skips disabled entries entirely, so a half-written one does not block training.
            disabled.append(str(ident) if ident else path)
            continue
        kind = str(entry.get("dataset_type", "image")).strip().lower()
        not_yet = _unsupported(entry, path)
        if not_yet:
            errors.extend(not_yet)
            failed_kinds.add(kind)
            continue
        model: type[StrictModel] = TextEmbedsBackend if kind == "text_embeds" else DatasetBackend
        known = model.model_fields
        entry, refused, notes = apply_rules(entry, DATASET_KEYS, prefix=f"{path}.")
        warnings.extend(notes)
        if refused:
            errors.extend(refused)
            failed_kinds.add(kind)
            continue
        for key in list(entry):
            if key not in known:
                del entry[key]
                close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                warnings.append(f"{path}.{key}: unknown key, ignored{hint}")
        try:
            backend = model.model_validate(entry)
        except ValidationError as exc:
            errors.extend(errors_from_validation(exc, prefix=path))
            failed_kinds.add("text_embeds" if model is TextEmbedsBackend else kind)
            continue
        if isinstance(backend, TextEmbedsBackend):
            text_embeds.append(backend)
        else:
            if backend.resolution_type is None:
                backend.resolution_type = resolution_type or "pixel_area"  # type: ignore[assignment]
            if backend.resolution is None:
                backend.resolution = resolution if resolution is not None else 1024
                message = check_resolution(backend.resolution, backend.resolution_type)
                if message:
                    errors.append(FieldError(f"{path}.resolution", f"(from the config) {message}"))
            datasets.append(backend)

    errors.extend(_pairing_errors(datasets, disabled, warnings))
    if require_images and not any(d.dataset_type in ("image", "video") for d in datasets) \
            and not {"image", "video"} & failed_kinds:
        errors.append(FieldError("datasets", "no enabled image dataset; add one with dataset_type 'image' "
                                             "(or 'video')"))
    chosen: TextEmbedsBackend | None = None
    if not text_embeds and "text_embeds" not in failed_kinds:
        errors.append(
            FieldError(
                "datasets",
                'a text_embeds backend is required, e.g. {"id": "text-embeds", "dataset_type": "text_embeds", '
                '"type": "local", "default": true}',
            )
        )
    elif len(text_embeds) == 1 and "text_embeds" not in failed_kinds:
        chosen = text_embeds[0]
    elif text_embeds and "text_embeds" not in failed_kinds:
        defaults = [t for t in text_embeds if t.default]
        if len(defaults) != 1:
            ids = ", ".join(t.id for t in text_embeds)
            errors.append(
                FieldError(
                    "datasets",
                    f"{len(text_embeds)} text_embeds backends ({ids}) need exactly one with \"default\": true, "
                    f"found {len(defaults)}",
                )
            )
        else:
            chosen = defaults[0]
            warnings.append(
                "datasets: " + f"{len(text_embeds)} text_embeds backends; using the default one, {chosen.id!r}"
            )
    if errors:
        raise ConfigError(errors, source)
    assert chosen is not None
    return DataBackends(datasets=datasets, text_embeds=chosen, warnings=warnings, disabled=disabled, source=source)


def _pairing_errors(datasets: list[DatasetBackend], disabled: list[str], warnings: list[str]) -> list[FieldError]:
    """``conditioning_data`` names enabled conditioning / mask datasets, at most one of each per dataset; a paired
    type that nothing pairs with is a warning."""
    errors = []
    by_id = {d.id: d for d in datasets}
    used: set[str] = set()
    for d in datasets:
        kinds: dict[str, str] = {}
        for ident in d.conditioning_data or ():
            where = f"datasets[{d.id}].conditioning_data"
            other = by_id.get(ident)
            if other is None:
                known = ", ".join(x.id for x in datasets if x.dataset_type in PAIRED_TYPES) or "none"
                state = "is disabled" if ident in disabled else "is not a dataset id"
                errors.append(FieldError(where, f"{ident!r} {state} (conditioning and mask datasets: {known})"))
            elif other.dataset_type not in PAIRED_TYPES:
                errors.append(FieldError(where, f"{ident!r} is a dataset_type {other.dataset_type!r} dataset; "
                                                "pair conditioning or mask datasets"))
            elif other.dataset_type in kinds:
                errors.append(FieldError(where, f"{kinds[other.dataset_type]!r} and {ident!r} are both "
                                                f"{other.dataset_type} datasets; one of each kind per dataset is "
                                                "supported"))
            else:
                kinds[other.dataset_type] = ident
                used.add(ident)
    for d in datasets:
        if d.dataset_type in PAIRED_TYPES and d.id not in used:
            warnings.append(f"datasets[{d.id}]: a {d.dataset_type} dataset that no dataset names in its "
                            "conditioning_data; ignored")
    return errors


def reference_errors(backends: DataBackends, config: TrainConfig) -> list[FieldError]:
    """Reference images against the model: an edit flavour needs every training and eval dataset paired with
    its references; a model that takes none refuses them; a run with references has them for every dataset (its
    batches cannot mix edit and text-to-image samples)."""
    family = config.family
    flavour = config.model_flavour
    takes = family.takes_references(flavour)
    needs = flavour in family.reference_flavours or (takes and backends.uses_references)
    errors = []
    for d in backends.image_datasets + backends.eval_datasets:
        has = backends.paired(d, "conditioning") is not None
        where = f"datasets[{d.id}].conditioning_data"
        if has and not takes:
            edit = ", ".join(family.reference_flavours)
            hint = f"; model_flavour {edit} does" if edit else ""
            errors.append(FieldError(where, f"model_family {family.name} flavour {flavour!r} does not take "
                                            f"reference images{hint}"))
        elif needs and not has:
            errors.append(FieldError(where, f"model_flavour {flavour!r} is trained on (reference, edit) pairs: "
                                            "name the conditioning dataset holding this dataset's reference images"))
    return errors


def load_data_backends(
    source: str | os.PathLike[str] | Sequence[Mapping[str, Any]],
    *,
    config: TrainConfig | None = None,
    resolution: float | None = None,
    resolution_type: str | None = None,
    require_images: bool | None = None,
) -> DataBackends:
    """Load and validate multidatabackend.json (a path) or its contents (a list of backend objects).

    Dataset defaults come from ``config`` (its ``resolution`` and ``resolution_type``) unless given explicitly;
    see :func:`parse_data_backends`. Errors from a file are attributed to it. An image or video dataset is required
    unless ``config`` distills (``require_images`` says so explicitly where there is no config).
    """
    from .loader import read_json

    if config is not None:
        resolution = config.resolution if resolution is None else resolution
        resolution_type = config.resolution_type if resolution_type is None else resolution_type
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    entries = read_json(source) if name is not None else source
    if require_images is None:
        require_images = config is None or config.distillation is None
    backends = parse_data_backends(entries, resolution=resolution, resolution_type=resolution_type, source=name,
                                   require_images=require_images)
    if config is not None:
        errors = reference_errors(backends, config)
        if errors:
            raise ConfigError(errors, name)
    return backends


DEFAULT_DATA_BACKEND_NAME = "multidatabackend.json"


def data_backend_beside(config_path: str | os.PathLike[str] | None) -> str | None:
    """``multidatabackend.json`` in the config file's folder, if there is one: where SimpleTuner's users keep it
    (``config/config.json`` + ``config/multidatabackend.json``), used when ``data_backend_config`` is not set."""
    if config_path is None:
        return None
    candidate = os.path.join(os.path.dirname(os.fspath(config_path)), DEFAULT_DATA_BACKEND_NAME)
    return candidate if os.path.isfile(candidate) else None


def found_beside_message(found: str, config_path: str | os.PathLike[str]) -> str:
    """The one line that says a data backend file was found beside the config."""
    return f"data_backend_config: not set; using {found}, found beside {os.fspath(config_path)}"
