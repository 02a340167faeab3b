"""Video files: probe, plan clips, decode frames (``simpletuner.evaluation.video`` writes mp4s). PyAV (FFmpeg's libraries, in its wheel) does the work.

PyAV is used because its wheels carry FFmpeg itself (H.264, VP8/9, AV1 decoders and the libx264 encoder), so one
``pip install av`` reads mp4/webm/mov and writes validation mp4s with no system FFmpeg; decord's last wheel (2021)
decodes only and pins an old FFmpeg, and torchvision's video readers need its CUDA-built wheels (see DESIGN.md).

Clip planning follows SimpleTuner's ``video`` options (``num_frames``, ``min_frames``, ``max_frames``, a frame rate)
and diffusion-pipe's clip modes (``single_beginning``, ``single_middle``, ``multiple_overlapping``); the frame count
is rounded down to one the family's VAE takes (``4k + 1`` for Wan and HunyuanVideo, ``8k + 1`` for LTX-Video).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from simpletuner.config.buckets import VIDEO_EXTENSIONS  # noqa: F401  (what counts as a video file)
# SimpleTuner's default clip length when num_frames is not set: five seconds
DEFAULT_SECONDS = 5


@dataclass(frozen=True)
class VideoInfo:
    frames: int
    fps: float
    width: int
    height: int


def probe(path: str | Path) -> VideoInfo:
    """Frame count, frame rate and size of a video's first video stream (raises on an unreadable file)."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        rate = stream.average_rate or stream.guessed_rate
        frames = stream.frames
        if not frames:  # webm/mkv headers carry no count: count the packets (no decoding)
            frames = sum(1 for packet in container.demux(stream) if packet.size)
    if not width or not height:
        raise ValueError("the video stream has no frame size")
    if not rate:
        raise ValueError("the video stream has no frame rate")
    return VideoInfo(int(frames), float(rate), int(width), int(height))


def valid_frame_count(frames: int, temporal_compression: int) -> int:
    """The largest count <= ``frames`` of the form ``k * temporal_compression + 1`` (0 if none)."""
    if frames < 1:
        return 0
    return (frames - 1) // temporal_compression * temporal_compression + 1


def plan_clips(info: VideoInfo, options, temporal_compression: int) -> tuple[list[tuple[int, ...]], str | None]:
    """Source frame indices of each clip this video trains as, or ([], reason) when it is skipped."""
    rate = float(options.frame_rate) if options is not None and options.frame_rate else info.fps
    stride = info.fps / rate  # source frames per sampled frame
    available = int(math.floor((info.frames - 1) / stride + 1e-9)) + 1 if info.frames > 0 else 0
    num_frames = options.num_frames if options is not None and options.num_frames else round(DEFAULT_SECONDS * rate)
    min_frames = options.min_frames if options is not None and options.min_frames else num_frames
    max_frames = options.max_frames if options is not None else None
    if available < min_frames:
        return [], f"clip shorter than min_frames={min_frames} ({available} frames at {rate:g} fps)"
    if max_frames and available > max_frames:
        return [], f"longer than max_frames={max_frames} ({available} frames at {rate:g} fps)"
    length = valid_frame_count(min(num_frames, available), temporal_compression)
    if length < 1:
        return [], f"no clip of a valid length ({available} frames; the model takes {temporal_compression}k+1)"
    mode = options.clip_mode if options is not None else "single_beginning"
    if mode == "single_middle":
        starts = [(available - length) // 2]
    elif mode == "multiple_overlapping":
        count = math.ceil(available / length)
        starts = [round(i * (available - length) / (count - 1)) for i in range(count)] if count > 1 else [0]
    else:
        starts = [0]
    clips = [tuple(min(info.frames - 1, int(round((s + i) * stride))) for i in range(length))
             for s in dict.fromkeys(starts)]
    return clips, None


def decode_frames(path: str | Path, indices: tuple[int, ...]):
    """The frames at ``indices`` (ascending source indices) as RGB PIL images; raises if any is missing."""
    import av

    wanted = set(indices)
    last = max(wanted)
    found = {}
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                found[i] = frame.to_image()
            if i >= last:
                break
    missing = sorted(wanted - found.keys())
    if missing:
        raise ValueError(f"decoded {len(found)} of {len(wanted)} frames; frame {missing[0]} is missing or damaged")
    return [found[i] for i in indices]
