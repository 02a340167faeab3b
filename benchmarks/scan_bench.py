"""The validate-time data scan (simpletuner.config.scan) on a folder of N captioned images: how long it takes, and
how that compares with what the trainer's discovery spends reading the same folder (PIL opens every file).

    .venv/bin/python benchmarks/scan_bench.py [--images 2000]

Prints files per second for both, measured in this one run, and their ratio; the buckets must agree.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from PIL import Image

from simpletuner.config import load_data_backends, load_train_config
from simpletuner.config.scan import scan_data
from simpletuner.data.discovery import discover


def make_folder(root: Path, count: int) -> None:
    rng = random.Random(0)
    sizes = [(512, 512), (768, 512), (512, 768), (640, 480), (1024, 576)]
    for i in range(count):
        size = rng.choice(sizes)
        fmt, ext = rng.choice([("PNG", ".png"), ("JPEG", ".jpg"), ("WEBP", ".webp")])
        Image.new("RGB", size, (i % 255, 80, 160)).save(root / f"{i:05d}{ext}", fmt)
        (root / f"{i:05d}.txt").write_text(f"image {i}")


def best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "pics"
        folder.mkdir()
        make_folder(folder, args.images)
        config = load_train_config({"model_family": "flux", "model_flavour": "tiny", "max_train_steps": 10,
                                    "resolution": 512}).config
        backends = load_data_backends([{"id": "pics", "instance_data_dir": str(folder)},
                                       {"id": "te", "dataset_type": "text_embeds", "default": True}], config=config)
        scan = scan_data(config, backends)
        found = discover(backends.datasets[0], config, 16)
        buckets: dict[str, int] = {}
        for s in found.samples:
            key = f"{s.target_size[0]}x{s.target_size[1]}"
            buckets[key] = buckets.get(key, 0) + 1
        assert scan.datasets[0].buckets == dict(sorted(buckets.items())), "the scan and discovery disagree"
        t_scan = best_of(lambda: scan_data(config, backends))
        t_discover = best_of(lambda: discover(backends.datasets[0], config, 16))
        n = args.images
        print(f"images: {n}")
        print(f"scan (headers):       {t_scan:.3f} s  ({n / t_scan:,.0f} images/s)")
        print(f"discovery (PIL open): {t_discover:.3f} s  ({n / t_discover:,.0f} images/s)")
        print(f"scan time / discovery time: {t_scan / t_discover:.2f}")


if __name__ == "__main__":
    main()
