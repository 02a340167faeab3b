"""The validate-time data scan (simpletuner.config.scan): image sizes from headers, captions, too-small images,
buckets and batches as the trainer makes them, and settings that fail or do nothing."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from simpletuner.config import load_data_backends, load_train_config
from simpletuner.config.scan import image_size, scan_data
from simpletuner.data.discovery import discover
from simpletuner.data.sampler import BucketBatchSampler

REPO = Path(__file__).resolve().parents[2]


def _exif_rotated(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.new("RGB", (40, 24), "red").save(buf, "JPEG", exif=exif.tobytes())
    return buf.getvalue()


def _encoded(fmt: str, size=(37, 21), mode="RGB", **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, "blue").save(buf, fmt, **kwargs)
    return buf.getvalue()


@pytest.mark.parametrize("name,data", [
    ("a.png", _encoded("PNG")),
    ("a.jpg", _encoded("JPEG")),
    ("a.jpg", _encoded("JPEG", progressive=True)),
    ("a.jpg", _exif_rotated(6)),  # rotated 90 degrees: PIL's exif_transpose swaps the sides
    ("a.jpg", _exif_rotated(3)),
    ("a.webp", _encoded("WEBP")),
    ("a.webp", _encoded("WEBP", lossless=True)),
    ("a.webp", _encoded("WEBP", mode="RGBA")),
    ("a.bmp", _encoded("BMP")),
    ("big.png", _encoded("PNG", size=(5000, 3001))),
], ids=["png", "jpeg", "progressive-jpeg", "jpeg-exif-6", "jpeg-exif-3", "webp", "webp-lossless", "webp-alpha",
        "bmp", "big-png"])
def test_header_sizes_are_what_the_trainer_sees(tmp_path, name, data):
    from PIL import ImageOps

    path = tmp_path / name
    path.write_bytes(data)
    with Image.open(path) as im:
        expected = ImageOps.exif_transpose(im).size
    assert image_size(path) == expected


@pytest.mark.parametrize("data", [b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff\xe0\x00\x10JFIF", b"not an image"])
def test_damaged_headers_have_no_size(tmp_path, data):
    path = tmp_path / "x.png"
    path.write_bytes(data)
    assert image_size(path) is None


def _image(path: Path, size, caption: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, "green").save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)


def _scan(tmp_path, dataset: dict, **config):
    config = load_train_config({"model_family": "flux", "model_flavour": "tiny", "max_train_steps": 10,
                                "resolution": 64, "resolution_type": "pixel", **config}).config
    entries = [{"id": "pics", "instance_data_dir": "pics", **dataset},
               {"id": "te", "dataset_type": "text_embeds", "default": True}]
    backends = load_data_backends(entries, config=config)
    return scan_data(config, backends, base=tmp_path), config, backends


def _errors(scan) -> dict[str, str]:
    return {e.path: e.message for e in scan.errors}


def test_a_missing_folder_is_an_error(tmp_path):
    scan, *_ = _scan(tmp_path, {})
    assert "pics" in _errors(scan)["datasets[pics].instance_data_dir"]
    assert "does not exist" in _errors(scan)["datasets[pics].instance_data_dir"]
    assert scan.summary() == [f"datasets[pics]: folder {tmp_path / 'pics'} does not exist"]


def test_an_empty_folder_is_an_error(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "notes.md").write_text("no images here")
    scan, *_ = _scan(tmp_path, {})
    assert "no training files" in _errors(scan)["datasets[pics].instance_data_dir"]


def test_missing_captions_are_an_error_naming_the_files(tmp_path):
    for i in range(3):
        _image(tmp_path / "pics" / f"{i}.png", (64, 64), "a cat" if i == 0 else None)
    scan, *_ = _scan(tmp_path, {"caption_strategy": "textfile"})
    message = _errors(scan)["datasets[pics].caption_strategy"]
    assert "2 of 3 file(s) have no .txt caption" in message and "1.png" in message and "2.png" in message
    d = scan.datasets[0]
    assert (d.images, d.captioned, d.caption_files) == (3, 1, 1)


def test_caption_strategy_follows_the_folder_when_unset(tmp_path):
    for i in range(2):
        _image(tmp_path / "pics" / f"{i}.png", (64, 64), "a cat")
    scan, *_ = _scan(tmp_path, {})
    assert scan.errors == []
    d = scan.datasets[0]
    assert (d.caption_strategy, d.caption_strategy_chosen, d.captioned) == ("textfile", True, 2)
    assert "2 with captions (caption_strategy textfile (chosen from the folder))" in scan.summary()[0]
    # no caption files: file names are the captions
    for i in range(2):
        (tmp_path / "pics" / f"{i}.txt").unlink()
    scan, *_ = _scan(tmp_path, {})
    assert scan.datasets[0].caption_strategy == "filename" and scan.errors == []


def test_the_trainer_reads_the_captions_the_scan_chose(tmp_path):
    _image(tmp_path / "pics" / "0.png", (64, 64), "a green square")
    _, config, backends = _scan(tmp_path, {"instance_data_dir": str(tmp_path / "pics")})
    (sample,) = discover(backends.datasets[0], config, 16).samples
    assert sample.caption == "a green square"


def test_too_small_images_warn_and_all_too_small_fails(tmp_path):
    _image(tmp_path / "pics" / "big.png", (128, 96), "big")
    _image(tmp_path / "pics" / "small.png", (32, 32), "small")
    scan, *_ = _scan(tmp_path, {"minimum_image_size": 64})
    assert scan.errors == []
    assert any("1 of 2 image(s) are smaller than 64" in w and "small.png (32x32)" in w for w in scan.warnings)
    (tmp_path / "pics" / "big.png").unlink()
    scan, *_ = _scan(tmp_path, {"minimum_image_size": 64})
    assert "all 1 image(s) are smaller than 64" in _errors(scan)["datasets[pics].minimum_image_size"]


def test_buckets_and_batches_are_the_trainers(tmp_path):
    """Every crop setting buckets an image exactly as discovery does, and the batch count is the sampler's."""
    sizes = [(64, 64), (128, 64), (64, 128), (100, 70), (300, 200), (90, 160), (64, 64), (128, 64)]
    for i, size in enumerate(sizes):
        _image(tmp_path / "pics" / f"{i}.png", size, f"image {i}")
    for extra in ({}, {"crop": True, "crop_aspect": "random", "crop_style": "random"},
                  {"crop": True, "crop_aspect": "closest"}, {"resolution": 0.01, "resolution_type": "area"}):
        scan, config, backends = _scan(tmp_path, {"instance_data_dir": str(tmp_path / "pics"), "repeats": 1,
                                                  **extra}, train_batch_size=2)
        found = discover(backends.datasets[0], config, 16)
        expected: dict[str, int] = {}
        for s in found.samples:
            key = f"{s.target_size[0]}x{s.target_size[1]}"
            expected[key] = expected.get(key, 0) + 1
        d = scan.datasets[0]
        assert d.buckets == dict(sorted(expected.items())), extra
        assert d.batches == BucketBatchSampler([found], 2, seed=0).batches_per_epoch, extra


def test_no_batch_can_be_formed(tmp_path):
    _image(tmp_path / "pics" / "square.png", (64, 64), "a")
    _image(tmp_path / "pics" / "wide.png", (128, 64), "b")
    scan, *_ = _scan(tmp_path, {}, train_batch_size=2)
    message = _errors(scan)["train_batch_size"]
    assert "2: no aspect bucket holds that many images" in message and "64x64: 1" in message
    scan, *_ = _scan(tmp_path, {"repeats": 1}, train_batch_size=2)  # repeats fill the buckets
    assert scan.errors == [] and scan.datasets[0].batches == 2


def test_a_video_dataset_in_an_image_family_fails(tmp_path):
    _image(tmp_path / "pics" / "0.png", (64, 64), "a")
    scan, *_ = _scan(tmp_path, {"dataset_type": "video"})
    assert "needs a video model family" in _errors(scan)["datasets[pics].dataset_type"]


def test_settings_that_do_nothing_warn(tmp_path):
    _image(tmp_path / "pics" / "0.png", (64, 64), "a")
    scan, *_ = _scan(tmp_path, {}, lr_scheduler="constant", lr_warmup_steps=5, eval_steps_interval=4,
                     validation_steps=5, framerate=24, model_type="full", lora_rank=8, ema_decay=0.9)
    text = "\n".join(scan.warnings)
    assert "lr_warmup_steps: 5 does nothing with lr_scheduler 'constant'" in text
    assert "eval_steps_interval: no dataset has dataset_type 'eval'" in text
    assert "validation_steps: there is no validation_prompt" in text
    assert "framerate: ignored, flux makes images, not videos" in text
    assert "lora_rank: ignored, model_type is 'full'" in text
    assert "ema_decay: ignored, use_ema is off" in text
    scan, *_ = _scan(tmp_path, {}, lr_scheduler="constant_with_warmup", lr_warmup_steps=5)
    assert scan.warnings == [] and scan.errors == []


def test_settings_that_fail(tmp_path):
    _image(tmp_path / "pics" / "0.png", (64, 64), "a")
    scan, *_ = _scan(tmp_path, {}, validation_preview=True, validation_steps=5, validation_prompt="x",
                     validation_resolution="70")
    assert "is not a multiple of 16" in _errors(scan)["validation_resolution"]
    scan, *_ = _scan(tmp_path, {}, validation_preview=True)
    assert "needs validation images" in _errors(scan)["validation_preview"]


def test_the_sample_dataset_scans_clean():
    config = load_train_config(REPO / "config" / "config.json").config
    backends = load_data_backends(REPO / "config" / "multidatabackend.json", config=config)
    scan = scan_data(config, backends, base=REPO)
    assert scan.errors == []
    d = scan.datasets[0]
    assert (d.images, d.captioned, d.usable) == (12, 12, 12)
