"""Training step time (forward + backward + optimizer step) of a LoRA on a Flux-shaped transformer, with and without
TREAD routing. Prints a markdown table of median step times and speedups measured in this one run.

    .venv/bin/python benchmarks/tread_bench.py            # 2048 image tokens, routes over layers 2..-2
    .venv/bin/python benchmarks/tread_bench.py --help

The model is diffusers' FluxTransformer2DModel with random weights: 2 double + 10 single blocks (12 layers), hidden
size 128, a 32x64 packed latent (a 64x128 VAE latent, i.e. a 512x1024 image) = 2048 image tokens and 64 text tokens.
Configs are timed round-robin so background load hits them alike. ``--family qwen_image`` times a Qwen-Image-shaped
transformer instead (the same 12 blocks, all dual-stream, routed by the Qwen-Image adapter's TREAD layout).
"""

from __future__ import annotations

import argparse

import torch
from diffusers import FluxTransformer2DModel
from peft import LoraConfig, inject_adapter_in_model

from simpletuner.training.tread import TreadLayout, apply_tread
from timing import lora_step, median_cpu, median_wall, round_robin


def build(args):
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=args.double, num_single_layers=args.single,
        attention_head_dim=args.head_dim, num_attention_heads=args.heads, joint_attention_dim=64,
        pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=rope_axes(args.head_dim),
    )
    model.requires_grad_(False)
    cfg = LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj",
                                                          "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp",
                                                          "proj_out", "ff.net.2"], exclude_modules=["proj_out"])
    model = inject_adapter_in_model(cfg, model)
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    return model


def rope_axes(head_dim):
    third = (head_dim // 3) // 2 * 2
    return (head_dim - 2 * third, third, third)


def inputs(args):
    g = torch.Generator().manual_seed(1)
    h, w = args.latent_h, args.latent_w
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                            indexing="ij")
    img_ids = torch.stack([torch.zeros_like(ys), ys, xs], -1).reshape(-1, 3)
    return dict(
        hidden_states=torch.randn(args.batch, h * w, 64, generator=g),
        encoder_hidden_states=torch.randn(args.batch, args.text_tokens, 64, generator=g),
        pooled_projections=torch.randn(args.batch, 64, generator=g),
        timestep=torch.rand(args.batch, generator=g),
        img_ids=img_ids,
        txt_ids=torch.zeros(args.text_tokens, 3),
        guidance=torch.full((args.batch,), 3.5),
    )


def build_qwen_image(args):
    """(model, inputs, layout) for a Qwen-Image-shaped LoRA step: diffusers' QwenImageTransformer2DModel with random
    weights, ``--double + --single`` dual-stream blocks (Qwen-Image has only those) of ``--heads x --head-dim``,
    ``--latent-h x --latent-w`` packed image tokens and ``--text-tokens`` text tokens; LoRA on the attention of
    both streams (the ``all`` preset), routed through the adapter's own TREAD layout."""
    from diffusers import QwenImageTransformer2DModel

    from simpletuner.models.qwen_image import LORA_PRESETS, qwen_image_tread_layout

    torch.manual_seed(0)
    third = (args.head_dim // 3) // 2 * 2
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=args.double + args.single,
        attention_head_dim=args.head_dim, num_attention_heads=args.heads, joint_attention_dim=64,
        axes_dims_rope=(args.head_dim - 2 * third, third, third),
    )
    model.requires_grad_(False)
    model = inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, target_modules=LORA_PRESETS["all"]), model)
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    g = torch.Generator().manual_seed(1)
    batch = dict(
        hidden_states=torch.randn(args.batch, args.latent_h * args.latent_w, 64, generator=g),
        encoder_hidden_states=torch.randn(args.batch, args.text_tokens, 64, generator=g),
        timestep=torch.rand(args.batch, generator=g),
        img_shapes=[[(1, args.latent_h, args.latent_w)]] * args.batch,
    )
    return model, batch, qwen_image_tread_layout(model)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latent-h", type=int, default=32, help="packed latent height (tokens)")
    parser.add_argument("--latent-w", type=int, default=64, help="packed latent width (tokens)")
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--double", type=int, default=2, help="double-stream (MMDiT) blocks")
    parser.add_argument("--single", type=int, default=10, help="single-stream blocks")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--start", type=int, default=2, help="route start_layer_idx")
    parser.add_argument("--end", type=int, default=-2, help="route end_layer_idx")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.7])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per config (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 keeps timings steady on a shared machine)")
    parser.add_argument("--checkpointing", action="store_true", help="enable gradient checkpointing")
    parser.add_argument("--family", choices=["flux", "qwen_image"], default="flux",
                        help="qwen_image: all --double + --single blocks are Qwen-Image dual-stream blocks")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.family == "qwen_image":
        model, batch, layout = build_qwen_image(args)
    else:
        model = build(args)
        batch = inputs(args)
        layout = TreadLayout(blocks=list(model.transformer_blocks) + list(model.single_transformer_blocks))
    target = torch.randn_like(batch["hidden_states"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    handle = apply_tread(model, [{"selection_ratio": args.ratios[0], "start_layer_idx": args.start,
                                  "end_layer_idx": args.end}], layout, generator=torch.Generator().manual_seed(0))
    route = handle.routes[0]
    configs = [None, *args.ratios]

    def run(ratio):
        handle.enabled = ratio is not None
        if ratio is not None:
            handle.routes[0] = type(route)(ratio, route.start_layer_idx, route.end_layer_idx)
        return lora_step(model, opt, batch, target)

    times = round_robin(run, configs, args.steps)

    n_img = args.latent_h * args.latent_w
    n_layers = args.double + args.single
    blocks = (f"{n_layers} dual-stream blocks" if args.family == "qwen_image"
              else f"{n_layers} layers ({args.double} double + {args.single} single)")
    shape = "Qwen-Image" if args.family == "qwen_image" else "Flux"
    print(f"{shape}-shaped LoRA training step, {n_img} image + {args.text_tokens} text tokens, batch {args.batch}, "
          f"{blocks}, hidden {args.heads * args.head_dim}, "
          f"route layers {route.start_layer_idx}..{route.end_layer_idx}"
          f"{', gradient checkpointing' if args.checkpointing else ''}; "
          f"median of {args.steps} steps, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| selection_ratio | image tokens in route | wall s/step | CPU s/step | speedup (wall) | speedup (CPU) |")
    print("|---|---|---|---|---|---|")
    base_wall, base_cpu = median_wall(times[None]), median_cpu(times[None])
    for ratio in configs:
        wall, cpu = median_wall(times[ratio]), median_cpu(times[ratio])
        kept = n_img if ratio is None else handle.router.kept_count(n_img, ratio)
        label = "off (no TREAD)" if ratio is None else f"{ratio}"
        print(f"| {label} | {kept} | {wall:.2f} | {cpu:.2f} | {base_wall / wall:.2f}x | {base_cpu / cpu:.2f}x |")


if __name__ == "__main__":
    main()
