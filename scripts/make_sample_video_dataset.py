"""Draw the sample video dataset shipped in datasets/sample_video: two-second clips of a shape moving over a
background (H.264 .mp4 and one VP9 .webm, 24 fps, 64x64) with textfile captions, plus one still image (images in a
video family's dataset train as 1-frame videos).

Run from the repo root: python scripts/make_sample_video_dataset.py  (deterministic; rewrites the folder)
"""

import random
import shutil
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "blue": (40, 70, 220), "green": (40, 170, 70), "yellow": (235, 200, 40),
           "purple": (140, 60, 190), "white": (245, 245, 245), "black": (20, 20, 20), "orange": (240, 130, 30)}
SHAPES = ["circle", "square", "triangle"]
MOTIONS = {"left to right": (1, 0), "right to left": (-1, 0), "top to bottom": (0, 1), "bottom to top": (0, -1)}
SIZE, FPS, SECONDS = 64, 24, 2


def frame(shape, fg, bg, cx, cy, r):
    img = Image.new("RGB", (SIZE, SIZE), COLOURS[bg])
    d = ImageDraw.Draw(img)
    box = [cx - r, cy - r, cx + r, cy + r]
    if shape == "circle":
        d.ellipse(box, fill=COLOURS[fg])
    elif shape == "square":
        d.rectangle(box, fill=COLOURS[fg])
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[fg])
    return img


def write_clip(path: Path, frames: list, codec: str) -> None:
    # bitexact: no random segment id or encoder string in the header, so files are the same on every run
    with av.open(str(path), mode="w", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = SIZE, SIZE, "yuv420p"
        # fixed encoder settings, so the files are the same on every run
        stream.options = {"crf": "18", "threads": "1"} if codec == "libx264" else {"crf": "20", "b": "0", "threads": "1"}
        for img in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.asarray(img), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def main():
    out = Path("datasets/sample_video")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rng = random.Random(4321)
    names = list(COLOURS)
    for i in range(6):
        shape = SHAPES[i % 3]
        fg, bg = rng.sample(names, 2)
        motion = list(MOTIONS)[i % 4]
        dx, dy = MOTIONS[motion]
        r = SIZE * 0.18
        frames = []
        for k in range(FPS * SECONDS):
            p = k / (FPS * SECONDS - 1) - 0.5  # -0.5 .. 0.5 across the clip
            frames.append(frame(shape, fg, bg, SIZE / 2 + dx * p * SIZE * 0.6, SIZE / 2 + dy * p * SIZE * 0.6, r))
        stem = f"{i:02d}_{fg}_{shape}"
        codec, ext = ("libvpx-vp9", ".webm") if i == 5 else ("libx264", ".mp4")
        write_clip(out / f"{stem}{ext}", frames, codec)
        (out / f"{stem}.txt").write_text(f"a {fg} {shape} moving {motion} on a {bg} background\n")
    fg, bg = rng.sample(names, 2)
    frame("circle", fg, bg, SIZE / 2, SIZE / 2, SIZE * 0.25).save(out / f"06_{fg}_circle.png", optimize=True)
    (out / f"06_{fg}_circle.txt").write_text(f"a still {fg} circle on a {bg} background\n")


if __name__ == "__main__":
    main()
