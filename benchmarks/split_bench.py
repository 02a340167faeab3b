"""Split training against one-stage training: peak memory and wall time, measured in one run.

    .venv/bin/python benchmarks/split_bench.py                 # Flux's proportions at 1/80 scale
    .venv/bin/python benchmarks/split_bench.py --scale 0.025   # bigger (needs ~4x the memory)

Writes a random-initialised Flux in the diffusers layout whose parts keep Flux.1's proportions, scaled down by one
factor: transformer 11.9B, T5-XXL 4.76B, CLIP-L 123M, VAE 84M parameters (counted from diffusers'/transformers'
own classes; the printed table shows what each came out as). ``--proportions wan-1.3b`` gives the same Flux-shaped
parts Wan 2.1 T2V 1.3B's proportions instead (a 1.42B transformer beside a 5.68B UMT5), where the text encoder
outweighs the denoiser. Then three real ``simpletuner`` commands on the
shipped sample images, each a fresh process, one after the other:

1. one stage: ``simpletuner train`` with cold caches (VAE + text encoders cache, are unloaded, then the LoRA trains)
2. stage 1: ``simpletuner cache`` (only the VAE and the text encoders)
3. stage 2: ``simpletuner train`` with ``train_from_cache`` (only the transformer)

and prints each one's peak resident memory (the process's ru_maxrss, read with wait4; this script never imports
torch itself, since a child's ru_maxrss starts from its parent's size at the fork) and wall time, the peak of a
process that only imports the trainer (what every run holds before it loads a weight), and the ratios: stage 2's peak over the one-stage run's, and stage 1 + stage 2's wall time over the one-stage run's. The
step count, image size and T5 length are small so it runs on a CPU; they do not change which weights are resident.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# parameter counts the scaled parts aim at: Flux.1 [dev]'s own (diffusers/transformers classes), and Wan 2.1 T2V
# 1.3B's (a 1.42B transformer beside a 5.68B UMT5 encoder and a 127M VAE; no CLIP) given to Flux-shaped parts
PROPORTIONS = {
    "flux": {"transformer": 11.90e9, "text_encoder_2": 4.76e9, "text_encoder": 123e6, "vae": 83.8e6},
    "wan-1.3b": {"transformer": 1.42e9, "text_encoder_2": 5.68e9, "text_encoder": 1e6, "vae": 127e6},
}


def count(build) -> int:
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def closest(target: float, candidates, build) -> tuple[object, int]:
    """The candidate (sizes in increasing order) whose model has the parameter count closest to ``target``, found by
    bisection (counted on the meta device, nothing allocated); returns it and its count."""
    candidates = list(candidates)
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if count(lambda: build(candidates[mid])) < target:
            lo = mid + 1
        else:
            hi = mid
    near = [candidates[i] for i in (lo - 1, lo) if 0 <= i < len(candidates)]
    sized = [(c, count(lambda: build(c))) for c in near]
    return min(sized, key=lambda item: abs(item[1] - target))


def write_checkpoint(folder: Path, scale: float, target: dict[str, float]) -> dict[str, tuple[int, float]]:
    """The scaled Flux at ``folder`` (``target``: each part's parameter count before scaling); returns
    {component: (parameters, its share of the target)}."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from simpletuner.models import tiny

    tokenizer, tokenizer_2 = tiny.clip_tokenizer(77), tiny.t5_tokenizer(512)

    def transformer(heads):  # Flux's 19 double + 38 single blocks, 64-wide heads
        return FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                                      attention_head_dim=64, num_attention_heads=heads, joint_attention_dim=t5_width,
                                      pooled_projection_dim=clip_width, guidance_embeds=True,
                                      axes_dims_rope=(16, 24, 24))

    def t5(width):  # T5-XXL's 24 layers, d_ff = 2.5 d_model
        return T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=width, d_ff=width * 5 // 2,
                                       d_kv=64, num_layers=24, num_heads=max(1, width // 64),
                                       feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                                       decoder_start_token_id=0))

    def clip(width):  # CLIP-L's 12 layers
        return CLIPTextModel(CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=4 * width,
                                            num_hidden_layers=12, num_attention_heads=width // 32,
                                            max_position_embeddings=77, projection_dim=width,
                                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                            pad_token_id=tokenizer.pad_token_id))

    def vae(width):  # Flux's VAE layout: 4 levels, 2 layers each, 16 latent channels
        return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                             up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=16,
                             block_out_channels=(width, 2 * width, 4 * width, 4 * width), norm_num_groups=math.gcd(32, width),
                             scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                             use_post_quant_conv=False)

    t5_width, t5_params = closest(target["text_encoder_2"] * scale, range(64, 4097, 32), t5)
    clip_width, clip_params = closest(target["text_encoder"] * scale, range(32, 769, 32), clip)
    heads, transformer_params = closest(target["transformer"] * scale, range(1, 49), transformer)
    vae_width, vae_params = closest(target["vae"] * scale, range(8, 129, 8), vae)
    torch.manual_seed(0)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                  max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096),
        vae=vae(vae_width), text_encoder=clip(clip_width), tokenizer=tokenizer, text_encoder_2=t5(t5_width),
        tokenizer_2=tokenizer_2, transformer=transformer(heads))
    pipe.save_pretrained(folder, safe_serialization=True)
    counts = {"transformer": transformer_params, "text_encoder_2": t5_params, "text_encoder": clip_params,
              "vae": vae_params}
    return {name: (n, n / target[name]) for name, n in counts.items()}


def write_run(tmp: Path, name: str, model: Path, args) -> Path:
    folder = tmp / name
    folder.mkdir()
    config = {
        "model_family": "flux", "model_flavour": "dev", "pretrained_model_name_or_path": str(model),
        "model_type": "lora", "lora_rank": 16, "lora_target": "all", "output_dir": str(folder / "output"),
        "data_backend_config": str(folder / "multidatabackend.json"), "train_batch_size": 1,
        "max_train_steps": args.steps, "checkpointing_steps": 1000, "learning_rate": 1e-4, "optimizer": "adamw",
        "mixed_precision": "no", "seed": 0, "tokenizer_max_length": args.t5_length, "report_to": "none",
    }
    backends = [{"id": "sample", "instance_data_dir": str(tmp / "sample"), "caption_strategy": "textfile",
                 "resolution": args.resolution, "resolution_type": "pixel", "cache_dir_vae": str(folder / "cache/vae")},
                {"id": "text", "dataset_type": "text_embeds", "cache_dir": str(folder / "cache/text")}]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "multidatabackend.json").write_text(json.dumps(backends))
    return folder / "config.json"


# what every run holds before it loads a weight: the interpreter, torch, diffusers, transformers, the trainer
BASELINE = "import simpletuner.training.trainer, simpletuner.training.split, simpletuner.models.flux"


def measure(*args: str, env: dict, log: Path) -> tuple[float, float]:
    """(peak RSS in MiB, wall seconds) of ``simpletuner <args>`` (or, with ``-c``, of that Python code) in a fresh
    process."""
    start = time.perf_counter()
    command = [sys.executable, *args] if args[0] == "-c" else [sys.executable, "-m", "simpletuner.cli", *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"simpletuner {' '.join(args)} exited {code}; see {log}:\n{log.read_text()[-3000:]}")
    return usage.ru_maxrss / 1024, wall  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proportions", choices=sorted(PROPORTIONS), default="flux",
                        help="whose parameter counts the parts keep (default: Flux.1's)")
    parser.add_argument("--scale", type=float, default=1 / 80, help="fraction of those parameter counts")
    parser.add_argument("--steps", type=int, default=2, help="training steps of each run")
    parser.add_argument("--resolution", type=int, default=128, help="training image size in pixels")
    parser.add_argument("--t5-length", type=int, default=128, help="T5 tokens per prompt (Flux dev: 512)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    parser.add_argument("--write-checkpoint", type=Path, help=argparse.SUPPRESS)  # the child that writes it
    args = parser.parse_args()
    if args.write_checkpoint:
        sizes = write_checkpoint(args.write_checkpoint, args.scale, PROPORTIONS[args.proportions])
        print(json.dumps(sizes))
        return

    tmp = Path(tempfile.mkdtemp(prefix="split-bench-"))
    try:
        shutil.copytree(REPO / "datasets" / "sample", tmp / "sample")
        model = tmp / "flux-scaled"
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
               "TRANSFORMERS_VERBOSITY": "error"}
        # in a child: this process stays free of torch, since a child's ru_maxrss starts at its parent's size
        written = subprocess.run([sys.executable, __file__, "--write-checkpoint", str(model), "--scale",
                                  str(args.scale), "--proportions", args.proportions], env=env, check=True,
                                 capture_output=True, text=True)
        sizes = json.loads(written.stdout.strip().splitlines()[-1])
        one = write_run(tmp, "one-stage", model, args)
        split = write_run(tmp, "split", model, args)
        base_rss, _ = measure("-c", BASELINE, env=env, log=tmp / "baseline.log")
        one_rss, one_wall = measure("train", "--config", str(one), env=env, log=tmp / "one-stage.log")
        s1_rss, s1_wall = measure("cache", "--config", str(split), env=env, log=tmp / "stage1.log")
        s2_rss, s2_wall = measure("train", "--config", str(split), "--train_from_cache", env=env,
                                  log=tmp / "stage2.log")
        one_losses = (tmp / "one-stage" / "output" / "training_log.jsonl").read_text()
        two_losses = (tmp / "split" / "output" / "training_log.jsonl").read_text()
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"{args.proportions} proportions at scale {args.scale:g} ({args.steps} steps, {args.resolution}px, "
          f"T5 length {args.t5_length}, {args.threads} threads)")
    print("| component | parameters | of the target's |")
    print("|---|---:|---:|")
    for name, (n, share) in sizes.items():
        print(f"| {name} | {n / 1e6:.1f}M | {share:.4f} |")
    print()
    print("| run | peak RSS (MiB) | wall (s) |")
    print("|---|---:|---:|")
    for name, rss, wall in (("one stage (train, cold caches)", one_rss, one_wall), ("stage 1 (cache)", s1_rss, s1_wall),
                            ("stage 2 (train_from_cache)", s2_rss, s2_wall)):
        print(f"| {name} | {rss:.0f} | {wall:.1f} |")
    print()
    print(f"| (imports only, no weights) | {base_rss:.0f} | |")
    print()
    print(f"peak RSS, stage 2 / one stage:               {s2_rss / one_rss:.2f}x  (goal <= 0.5x)")
    print(f"  above the imports' {base_rss:.0f} MiB:             {(s2_rss - base_rss) / (one_rss - base_rss):.2f}x")
    print(f"peak RSS, stage 1 / one stage:               {s1_rss / one_rss:.2f}x")
    print(f"wall time, (stage 1 + stage 2) / one stage:  {(s1_wall + s2_wall) / one_wall:.2f}x")
    print(f"same losses in both:                         {one_losses == two_losses}")
    if args.keep:
        print(f"kept {tmp}")


if __name__ == "__main__":
    main()
