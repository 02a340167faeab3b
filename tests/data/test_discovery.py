from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from simpletuner.data.discovery import DatasetError, bucket_size, discover, load_pixels, read_caption
from tests.helpers import namespace

DEFAULTS = namespace(resolution=128, resolution_type="pixel")


def backend(folder, **kw):
    values = dict(id="ds", instance_data_dir=str(folder), caption_strategy="filename", resolution=None,
                  resolution_type=None, minimum_image_size=None, maximum_image_size=None,
                  target_downsample_size=None, crop=False, crop_style="center", crop_aspect="square",
                  instance_prompt=None, repeats=0, is_regularisation_data=False)
    values.update(kw)
    return namespace(**values)


@pytest.mark.parametrize("size,res,rtype,expected", [
    ((160, 160), 128, "pixel", (128, 128)),
    ((192, 128), 128, "pixel", (192, 128)),  # shorter edge 128, aspect kept
    ((128, 192), 128, "pixel", (128, 192)),
    ((1024, 1024), 1.0, "area", (1024, 1024)),  # 1 megapixel
    ((2000, 1000), 512, "pixel_area", (720, 368)),  # 512**2 pixels at 2:1, multiples of 16
])
def test_bucket_sizes(size, res, rtype, expected):
    assert bucket_size(*size, res, rtype, 16) == expected


def test_caption_strategies(tmp_path):
    img = tmp_path / "a_red_circle.png"
    Image.new("RGB", (32, 32)).save(img)
    assert read_caption(backend(tmp_path), img) == "a red circle"
    assert read_caption(backend(tmp_path, caption_strategy="instanceprompt", instance_prompt="sks dog"), img) == "sks dog"
    with pytest.raises(DatasetError, match=r"datasets\[ds\].*a_red_circle.txt"):
        read_caption(backend(tmp_path, caption_strategy="textfile"), img)
    img.with_suffix(".txt").write_text("first caption\nsecond\n")
    assert read_caption(backend(tmp_path, caption_strategy="textfile"), img) == "first caption"


def test_discover_sample_dataset(sample_dataset):
    found = discover(backend(sample_dataset, caption_strategy="textfile", repeats=2), DEFAULTS, 16)
    assert len(found.samples) == 12 and found.repeats == 2
    assert {s.bucket for s in found.samples} == {(128, 128), (192, 128), (128, 192)}
    assert all(s.caption.startswith("a ") for s in found.samples)


def test_small_and_broken_images_are_skipped_with_reasons(tmp_path):
    Image.new("RGB", (64, 64)).save(tmp_path / "small.png")
    Image.new("RGB", (256, 256)).save(tmp_path / "big.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    found = discover(backend(tmp_path, minimum_image_size=100), DEFAULTS, 16)
    assert [s.path.rsplit("/", 1)[1] for s in found.samples] == ["big.png"]
    reasons = dict((p.rsplit("/", 1)[1], r) for p, r in found.skipped)
    assert "minimum_image_size" in reasons["small.png"] and "unreadable" in reasons["broken.png"]


def test_missing_folder_names_the_dataset(tmp_path):
    with pytest.raises(DatasetError, match=r"datasets\[ds\]\.instance_data_dir"):
        discover(backend(tmp_path / "nope"), DEFAULTS, 16)


@pytest.mark.parametrize("style", ["center", "corner", "random"])
def test_square_crops_have_bucket_size(tmp_path, style):
    Image.new("RGB", (300, 150), (255, 0, 0)).save(tmp_path / "wide.png")
    found = discover(backend(tmp_path, crop=True, crop_style=style, crop_aspect="square"), DEFAULTS, 16)
    sample = found.samples[0]
    assert sample.target_size == (128, 128)
    pixels = load_pixels(sample)
    assert pixels.shape == (3, 128, 128)
    assert pixels.min() >= -1 and pixels.max() <= 1
    if style == "corner":
        assert sample.crop_box[:2] == (0, 0)


def test_random_crop_is_stable_for_the_same_file(tmp_path):
    Image.new("RGB", (400, 200)).save(tmp_path / "wide.png")
    b = backend(tmp_path, crop=True, crop_style="random")
    assert discover(b, DEFAULTS, 16).samples[0].crop_box == discover(b, DEFAULTS, 16).samples[0].crop_box


def test_oversized_images_are_downsampled_before_cropping(tmp_path):
    Image.new("RGB", (2048, 2048)).save(tmp_path / "huge.png")
    b = backend(tmp_path, crop=True, maximum_image_size=1024, target_downsample_size=256)
    sample = discover(b, DEFAULTS, 16).samples[0]
    assert sample.resize_to == (256, 256) and sample.target_size == (128, 128)


def _pairable(tmp_path, names, partner_names, size=(96, 64), partner_size=None):
    from simpletuner.config import load_data_backends

    for folder, files, dims in (("images", names, size), ("refs", partner_names, partner_size or size)):
        (tmp_path / folder).mkdir(exist_ok=True)
        for name in files:
            (tmp_path / folder / name).parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", dims, (200, 10, 10)).save(tmp_path / folder / name)
    return load_data_backends([
        {"id": "images", "instance_data_dir": str(tmp_path / "images"), "conditioning_data": "refs", "crop": True,
         "crop_style": "random", "resolution": 48, "resolution_type": "pixel"},
        {"id": "refs", "dataset_type": "conditioning", "instance_data_dir": str(tmp_path / "refs")},
        {"id": "text", "dataset_type": "text_embeds"}])


def test_conditioning_files_pair_by_relative_path_and_share_the_crop(tmp_path):
    from simpletuner.data.discovery import with_pairs

    backends = _pairable(tmp_path, ["a.png", "sub/b.jpg", "c.png"], ["a.png", "sub/b.png", "c.png", "sub/c.png"])
    image = backends.image_datasets[0]
    samples = with_pairs(backends, image, discover(image, DEFAULTS, 16).samples)
    by_name = {Path(s.path).name: s for s in samples}
    assert Path(by_name["a.png"].conditioning.path) == (tmp_path / "refs/a.png").resolve()
    assert Path(by_name["b.jpg"].conditioning.path) == (tmp_path / "refs/sub/b.png").resolve()  # same name, .png
    assert Path(by_name["c.png"].conditioning.path) == (tmp_path / "refs/c.png").resolve()  # not sub/c.png
    for s in samples:
        ref = s.conditioning
        assert ref.dataset_id == "refs" and ref.mask is None and s.mask is None
        assert (ref.target_size, ref.resize_to, ref.crop_box) == (s.target_size, s.resize_to, s.crop_box)
    # identical files, identically prepared, give identical pixels
    assert torch.equal(load_pixels(by_name["a.png"]), load_pixels(by_name["a.png"].conditioning))


def test_an_image_without_its_pair_is_an_error_naming_both_datasets(tmp_path):
    from simpletuner.data.discovery import with_pairs

    backends = _pairable(tmp_path, ["a.png", "b.png"], ["a.png"])
    image = backends.image_datasets[0]
    with pytest.raises(DatasetError, match=r"datasets\[images\]\.conditioning_data: 1 of 2 image\(s\) have no file in "
                                           r"datasets\[refs\] .*\['b.png'\]"):
        with_pairs(backends, image, discover(image, DEFAULTS, 16).samples)


def test_a_mask_file_becomes_latent_weights_where_it_is_white(tmp_path):
    from simpletuner.data.discovery import Sample, load_mask

    mask = Image.new("L", (64, 32), 0)
    mask.paste(255, (16, 8, 36, 24))  # white over pixels x 16..35, y 8..23
    mask.save(tmp_path / "m.png")
    sample = Sample("masks", str(tmp_path / "m.png"), "", (64, 32), (64, 32), (0, 0, 64, 32))
    weights = load_mask(sample, (4, 8))  # one latent per 8x8 pixels
    assert weights.shape == (1, 4, 8)
    assert torch.equal(weights[0, :, :2], torch.zeros(4, 2)) and torch.equal(weights[0, :, 5:], torch.zeros(4, 3))
    assert torch.equal(weights[0, 0], torch.zeros(8)) and torch.equal(weights[0, 3], torch.zeros(8))
    assert torch.equal(weights[0, 1:3, 2:4], torch.ones(2, 2))
    assert torch.allclose(weights[0, 1:3, 4], torch.full((2,), 0.5))  # half of that latent's pixels are white
