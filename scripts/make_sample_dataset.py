"""Draw the sample dataset shipped in datasets/sample: small shape pictures with textfile captions.

Run from the repo root: python scripts/make_sample_dataset.py  (deterministic; rewrites the folder)
"""

import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "blue": (40, 70, 220), "green": (40, 170, 70), "yellow": (235, 200, 40),
           "purple": (140, 60, 190), "white": (245, 245, 245), "black": (20, 20, 20), "orange": (240, 130, 30)}
SHAPES = ["circle", "square", "triangle"]
SIZES = [(160, 160), (192, 128), (128, 192)]


def draw(shape, fg, bg, size, rng):
    img = Image.new("RGB", size, COLOURS[bg])
    d = ImageDraw.Draw(img)
    w, h = size
    r = min(w, h) * rng.uniform(0.25, 0.4)
    cx, cy = w / 2 + rng.uniform(-0.1, 0.1) * w, h / 2 + rng.uniform(-0.1, 0.1) * h
    box = [cx - r, cy - r, cx + r, cy + r]
    if shape == "circle":
        d.ellipse(box, fill=COLOURS[fg])
    elif shape == "square":
        d.rectangle(box, fill=COLOURS[fg])
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[fg])
    return img


def main():
    out = Path("datasets/sample")
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)
    names = list(COLOURS)
    for i in range(12):
        shape = SHAPES[i % 3]
        fg, bg = rng.sample(names, 2)
        size = SIZES[(i // 3) % 3]
        stem = f"{i:02d}_{fg}_{shape}"
        draw(shape, fg, bg, size, rng).save(out / f"{stem}.png", optimize=True)
        (out / f"{stem}.txt").write_text(f"a {fg} {shape} on a {bg} background\n")


if __name__ == "__main__":
    main()
