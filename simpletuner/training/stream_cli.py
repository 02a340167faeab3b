"""``simpletuner stream-video``: run a causal (Self-Forcing) Wan student exported by a distillation run, block by
block with its KV cache, decoding and writing each block's frames as soon as the block is done.

    simpletuner stream-video --student output/models --prompt "a red ball rolls" --out stream/

``--student`` is the run's output folder (``transformer/`` and ``distillation.json``); the VAE and text encoder come
from the teacher the run names there. Frames are written as ``<out>/frame_<n>.png`` while the video streams, then
``<out>/video.mp4``. Imports torch only after the arguments are read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--student", required=True, help="a causal distillation run's output folder")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--out", default="stream", help="folder for the frames and video.mp4 (default: %(default)s)")
    parser.add_argument("--num_frames", type=int, help="pixel frames (4k + 1); default: the run's")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    folder = Path(args.student)
    info_file = folder / "distillation.json"
    try:
        info = json.loads(info_file.read_text())
    except (OSError, ValueError) as exc:
        print(f"error: --student: {info_file} cannot be read ({exc})", file=sys.stderr)
        return 1
    if "causal" not in info:
        print(f"error: --student: {folder} holds a {info.get('model_family')} student that is not causal "
              "(distillation.causal was off); load it with its pipeline", file=sys.stderr)
        return 1
    import torch

    from simpletuner.config import load_train_config
    from simpletuner.evaluation.validation import to_pil
    from simpletuner.evaluation.video import write_mp4
    from simpletuner.models.causal_wan import CausalLayout, stream_video
    from simpletuner.models.registry import create_adapter
    from simpletuner.training.distill import latent_shape

    config = load_train_config({"model_family": info["model_family"], "model_flavour": info["model_flavour"],
                                "pretrained_model_name_or_path": info.get("pretrained_model_name_or_path"),
                                "mixed_precision": "no", "max_train_steps": 1,
                                "data_backend_config": "unused.json"}).config
    device = "cuda" if torch.cuda.is_available() else "cpu"
    adapter = create_adapter(config, device=device)
    model = adapter.denoiser_class.from_pretrained(folder / "transformer").eval().to(device)
    causal = info["causal"]
    layout = CausalLayout(causal["num_frame_per_block"], causal["local_attn_size"], causal["independent_first_frame"])
    frames = args.num_frames or info["num_frames"]
    tc = adapter.temporal_compression
    if (frames - 1) % tc:
        print(f"error: --num_frames: {frames} is not {tc}k + 1", file=sys.stderr)
        return 1
    try:
        layout.blocks((frames - 1) // tc + 1)
    except ValueError as exc:
        print(f"error: --num_frames: {exc}", file=sys.stderr)
        return 1
    text = adapter.encode_prompts([args.prompt])[0].tensors["prompt_embeds"].unsqueeze(0).to(device)
    shape = latent_shape(adapter, info["width"], info["height"], frames)
    noise = torch.randn(1, *shape, generator=torch.Generator().manual_seed(args.seed)).to(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    images, started = [], time.time()
    for block, pixels in stream_video(adapter, model, text, noise, info["timesteps"], layout,
                                      sampler=info["sampler"], seed=args.seed,
                                      context_noise=float(causal["context_noise"])):
        for frame in pixels[0].float().cpu().unbind(1):
            image = to_pil(frame)
            image.save(out / f"frame_{len(images):04d}.png")
            images.append(image)
        print(f"block {block.start}-{block.end - 1} (latent frames): {len(images)} frames so far, "
              f"{time.time() - started:.1f}s", flush=True)
    write_mp4(out / "video.mp4", images, adapter.validation_fps())
    print(f"{len(images)} frames; {out / 'video.mp4'}")
    return 0
