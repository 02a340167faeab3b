"""Draw the paired edit dataset shipped in datasets/edit: for each pair a reference picture (a shape in one colour),
the edited picture (the same shape, same place, another colour) captioned with the edit instruction, and a loss mask
(white where the edit happened).

    datasets/edit/reference/NN_<shape>.png   what the edit model is given
    datasets/edit/edited/NN_<shape>.png      what it is trained to produce, with NN_<shape>.txt: the instruction
    datasets/edit/mask/NN_<shape>.png        the edited region

Files are paired by name, as a conditioning or mask dataset is paired to its image dataset.
Run from the repo root: python scripts/make_edit_dataset.py  (deterministic; rewrites the folders)
"""

import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "blue": (40, 70, 220), "green": (40, 170, 70), "yellow": (235, 200, 40),
           "purple": (140, 60, 190), "white": (245, 245, 245), "black": (20, 20, 20), "orange": (240, 130, 30)}
SHAPES = ["circle", "square", "triangle"]
SIZE = (128, 128)


def draw(shape, box, fill, canvas):
    d = ImageDraw.Draw(canvas)
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "square":
        d.rectangle(box, fill=fill)
    else:
        left, top, right, bottom = box
        d.polygon([((left + right) / 2, top), (left, bottom), (right, bottom)], fill=fill)


def main():
    root = Path("datasets/edit")
    folders = {name: root / name for name in ("reference", "edited", "mask")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
    rng = random.Random(4321)
    names = list(COLOURS)
    for i in range(8):
        shape = SHAPES[i % 3]
        before, after, bg = rng.sample(names, 3)
        w, h = SIZE
        r = min(w, h) * rng.uniform(0.25, 0.35)
        cx, cy = w / 2 + rng.uniform(-0.15, 0.15) * w, h / 2 + rng.uniform(-0.15, 0.15) * h
        box = [cx - r, cy - r, cx + r, cy + r]
        stem = f"{i:02d}_{shape}"
        for folder, colour in (("reference", before), ("edited", after)):
            image = Image.new("RGB", SIZE, COLOURS[bg])
            draw(shape, box, COLOURS[colour], image)
            image.save(folders[folder] / f"{stem}.png", optimize=True)
        mask = Image.new("L", SIZE, 0)
        draw(shape, box, 255, mask)
        mask.save(folders["mask"] / f"{stem}.png", optimize=True)
        (folders["edited"] / f"{stem}.txt").write_text(f"make the {before} {shape} {after}\n")


if __name__ == "__main__":
    main()
