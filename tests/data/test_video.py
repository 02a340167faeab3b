"""Video datasets: clips planned from SimpleTuner's video options and diffusion-pipe's clip modes, (frames, W, H)
buckets in counts the VAE takes, images as 1-frame clips, and bad files skipped by name and counted, never fatal."""

from __future__ import annotations

import logging
import shutil
from types import SimpleNamespace

import pytest
import torch

from simpletuner.config import load_data_backends
from simpletuner.config.data import VideoOptions
from simpletuner.data.cache import fill_latent_cache, latent_key
from simpletuner.data.discovery import discover, load_pixels
from simpletuner.data.video import VideoInfo, decode_frames, plan_clips, probe, valid_frame_count
from tests.conftest import REPO

DEFAULTS = SimpleNamespace(resolution=64, resolution_type="pixel")


def backend(folder, **video):
    entries = [{"id": "clips", "dataset_type": "video", "instance_data_dir": str(folder), "caption_strategy": "textfile",
                "resolution": 32, "resolution_type": "pixel", "video": video or None},
               {"id": "text", "dataset_type": "text_embeds"}]
    return load_data_backends(entries).datasets[0]


@pytest.fixture
def clips(tmp_path):
    folder = tmp_path / "clips"
    shutil.copytree(REPO / "datasets" / "sample_video", folder)
    return folder


def test_frame_counts_follow_the_vae():
    assert [valid_frame_count(n, 4) for n in (1, 4, 5, 8, 9, 33, 34)] == [1, 1, 5, 5, 9, 33, 33]
    assert [valid_frame_count(n, 8) for n in (8, 9, 16, 17)] == [1, 9, 9, 17]


@pytest.mark.parametrize("mode, starts", [("single_beginning", [0]), ("single_middle", [15]),
                                          ("multiple_overlapping", [0, 16, 31])])
def test_clip_modes(mode, starts):
    info = VideoInfo(frames=48, fps=24.0, width=64, height=64)
    clips, reason = plan_clips(info, VideoOptions(num_frames=17, clip_mode=mode), 4)
    assert reason is None and [c[0] for c in clips] == starts and all(len(c) == 17 for c in clips)
    assert clips[-1][-1] <= 47


def test_frame_rate_and_limits():
    info = VideoInfo(frames=48, fps=24.0, width=64, height=64)
    clips, _ = plan_clips(info, VideoOptions(num_frames=9, frame_rate=8), 4)  # every third source frame
    assert clips == [tuple(range(0, 27, 3))]
    # shorter than num_frames but not than min_frames: trains on what it has, rounded down to 4k+1
    clips, _ = plan_clips(info, VideoOptions(num_frames=33, min_frames=10, frame_rate=8), 4)
    assert [len(c) for c in clips] == [13]
    assert plan_clips(info, VideoOptions(num_frames=33, frame_rate=8), 4) == \
        ([], "clip shorter than min_frames=33 (16 frames at 8 fps)")
    assert plan_clips(info, VideoOptions(num_frames=9, max_frames=20), 4) == \
        ([], "longer than max_frames=20 (48 frames at 24 fps)")


def test_a_video_dataset_buckets_by_frames_and_images_are_one_frame(clips):
    ds = discover(backend(clips, num_frames=9, frame_rate=8, clip_mode="multiple_overlapping"), DEFAULTS, 16,
                  temporal_compression=4)
    assert not ds.skipped
    videos = [s for s in ds.samples if not s.path.endswith(".png")]
    image = [s for s in ds.samples if s.path.endswith(".png")]
    assert len(videos) == 6 * 2 and {s.bucket for s in videos} == {(9, 32, 32)}
    assert len(image) == 1 and image[0].bucket == (1, 32, 32) and image[0].frame_indices == (0,)
    pixels = load_pixels(videos[0])
    assert pixels.shape == (3, 9, 32, 32) and -1 <= pixels.min() and pixels.max() <= 1
    assert load_pixels(image[0]).shape == (3, 1, 32, 32)
    assert not torch.equal(pixels[:, 0], pixels[:, -1])  # the shape moves
    # the two clips of one file get different cache keys
    first, second = [s for s in videos if s.path == videos[0].path]
    assert latent_key(first, "vae") != latent_key(second, "vae")
    webm = [s for s in videos if s.path.endswith(".webm")]
    assert webm and load_pixels(webm[0]).shape == (3, 9, 32, 32)  # no frame count in the header: counted


def test_an_image_family_refuses_a_video_dataset(clips):
    with pytest.raises(ValueError, match=r"datasets\[clips\]\.dataset_type: 'video' needs a video model family"):
        discover(backend(clips), DEFAULTS, 16)


def test_bad_videos_are_skipped_by_name_and_counted(clips, caplog):
    (clips / "unreadable.mp4").write_bytes(b"this is not a video at all")
    (clips / "unreadable.txt").write_text("nothing")
    good = clips / "00_purple_circle.mp4"
    raw = good.read_bytes()
    (clips / "corrupt_header.mp4").write_bytes(b"\x00" * 64 + raw[64:])
    (clips / "corrupt_header.txt").write_text("a corrupt header")
    short = clips / "short.mp4"
    frames = decode_frames(good, tuple(range(6)))
    from simpletuner.evaluation.video import write_mp4

    write_mp4(short, frames, 24)
    (clips / "short.txt").write_text("too short")
    with caplog.at_level(logging.WARNING):
        ds = discover(backend(clips, num_frames=9, min_frames=9), DEFAULTS, 16, temporal_compression=4)
    skipped = dict(ds.skipped)
    assert set(map(lambda p: p.rsplit("/", 1)[-1], skipped)) == {"unreadable.mp4", "corrupt_header.mp4", "short.mp4"}
    assert "clip shorter than min_frames=9 (6 frames" in skipped[str(short)]
    assert all(f"skipping {name}" in caplog.text for name in skipped)
    assert len(ds.samples) == 7  # the six sample clips and the still image


def test_a_file_that_fails_to_decode_while_caching_is_skipped_not_fatal(clips, tmp_path):
    ds = discover(backend(clips, num_frames=9, frame_rate=8), DEFAULTS, 16, temporal_compression=4)
    victim = next(s for s in ds.samples if s.path.endswith("01_black_square.mp4"))
    # truncated after discovery: the header still says 48 frames, the data is gone
    data = open(victim.path, "rb").read()
    open(victim.path, "wb").write(data[: len(data) // 3])

    class Adapter:
        def vae_cache_identity(self):
            return "vae"

        def latent_cache_entries(self, pixels):
            return [{"latents": p[:1, :, ::8, ::8].clone()} for p in pixels]

    unreadable = []
    encoded = fill_latent_cache({str(tmp_path / "cache"): ds.samples}, Adapter(), 4, show_progress=False,
                                unreadable=unreadable)
    assert encoded == len(ds.samples) - 1
    assert [s.path for s, _ in unreadable] == [victim.path] and "cannot be decoded" in unreadable[0][1]
    with pytest.raises(ValueError, match="01_black_square.mp4: cannot be decoded"):
        fill_latent_cache({str(tmp_path / "cache2"): [victim]}, Adapter(), 4, show_progress=False)


def test_probe_reads_the_sample_clips():
    info = probe(REPO / "datasets" / "sample_video" / "05_green_triangle.webm")
    assert (info.frames, info.fps, info.width, info.height) == (48, 24.0, 64, 64)


def test_training_skips_bad_videos_and_counts_them(clips, tmp_path, caplog):
    """Through the real trainer (tiny Wan): an unreadable file, a corrupt header, a clip shorter than min_frames and
    a file that fails to decode while caching are each left out before the first step with a warning naming it, and
    the dataset summary (log line and run summary) counts them."""
    import json

    from simpletuner.evaluation.video import write_mp4
    from simpletuner.training.trainer import train
    from tests.models.contract import family_config

    (clips / "unreadable.mp4").write_bytes(b"not a video")
    (clips / "unreadable.txt").write_text("x")
    raw = (clips / "00_purple_circle.mp4").read_bytes()
    (clips / "corrupt_header.mp4").write_bytes(b"\x00" * 64 + raw[64:])
    (clips / "corrupt_header.txt").write_text("a corrupt header")
    write_mp4(clips / "short.mp4", decode_frames(clips / "00_purple_circle.mp4", (0, 1)), 24)  # 1 frame at 8 fps
    (clips / "short.txt").write_text("too short")
    (clips / "truncated.mp4").write_bytes(raw[: len(raw) // 3])  # probes as 48 frames, fails to decode
    (clips / "truncated.txt").write_text("a truncated clip")
    entries = [{"id": "clips", "dataset_type": "video", "instance_data_dir": str(clips), "caption_strategy": "textfile",
                "resolution": 64, "resolution_type": "pixel", "cache_dir_vae": str(tmp_path / "cache/vae"),
                "video": {"num_frames": 5, "frame_rate": 8}},
               {"id": "text", "dataset_type": "text_embeds", "cache_dir": str(tmp_path / "cache/text")}]
    config = family_config("wan", output_dir=str(tmp_path / "out"), max_train_steps=2, train_batch_size=2)
    with caplog.at_level(logging.INFO):
        result = train(config, load_data_backends(entries, config=config))
    assert result.global_step == 2 and result.skipped_files == {"clips": 4}
    assert json.loads((tmp_path / "out" / "run_summary.json").read_text())["skipped_files"] == {"clips": 4}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for name in ("unreadable.mp4", "corrupt_header.mp4", "short.mp4", "truncated.mp4"):
        assert any(name in message for message in warnings), (name, warnings)
    assert "datasets[clips]: " in caplog.text and "4 file(s) skipped" in caplog.text
