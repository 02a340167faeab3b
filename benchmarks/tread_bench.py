"""Training step time (forward + backward + optimizer step) of a LoRA on a scaled-down transformer of a model family,
with and without TREAD routing. Prints a markdown table of median step times and speedups measured in this one run.

    .venv/bin/python benchmarks/tread_bench.py                       # Flux, 2048 image tokens, routes over 2..-2
    .venv/bin/python benchmarks/tread_bench.py --family sd3 --ratios 0.5
    .venv/bin/python benchmarks/tread_bench.py --family wan  # a Wan video latent: 4 x 32 x 64 = 8192 video tokens
    .venv/bin/python benchmarks/tread_bench.py --family hunyuanvideo --ratios 0.5 --steps 3
    .venv/bin/python benchmarks/tread_bench.py --help

Flux (the default): diffusers' FluxTransformer2DModel with random weights: 2 double + 10 single blocks (12 layers),
hidden size 128, a 32x64 packed latent (a 64x128 VAE latent, i.e. a 512x1024 image) = 2048 image tokens and 64 text
tokens. Other families (``--family sd3 | auraflow | pixart_sigma | chroma``): the family's own diffusers transformer
at the same scale (12 blocks, hidden 128 as 4 heads of 32, 2048 image tokens of a 512x1024 image, 64 text tokens),
stepped through the family adapter's ``predict`` with its TREAD layout and its default LoRA preset, so the routed
path is the one training takes. Attention dominates at this size (2048 tokens against a 128-wide MLP), as it does
in the real models at high resolution. With ``--family wan`` the model is diffusers' WanTransformer3DModel (12 blocks,
hidden 128) on a (16, 4, 64, 128) video latent (2x2 patches: 4 x 32 x 64 = 8192 tokens, 3-D RoPE sliced per sample
by simpletuner.models.wan's layout) and 64 text tokens. Configs are timed round-robin so background load hits them
alike. ``--family qwen_image`` times a Qwen-Image-shaped transformer (the same 12 blocks, all dual-stream,
routed by the Qwen-Image adapter's TREAD layout). ``--family hunyuanvideo`` times diffusers'
HunyuanVideoTransformer3DModel (2 dual- + 10 single-stream blocks, hidden 128) on the same (16, 4, 64, 128) video
latent as Wan (8192 video tokens) through the HunyuanVideo adapter's ``predict`` and TREAD layout.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

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


# ---- the other families: their own transformer at Flux's bench scale, stepped through their adapter ----------------
class _AdapterStep:
    """``model(**batch).sample`` for the timing harness: the family adapter's ``predict`` on the transformer."""

    def __init__(self, adapter, model):
        self.adapter, self.model = adapter, model

    def __call__(self, **batch):
        return SimpleNamespace(sample=self.adapter.predict(self.model, **batch))


def _family_model(args):
    """(transformer config, latents, text) for ``args.family``: ``double + single`` blocks (one kind of block for
    SD3 and PixArt), hidden ``heads * head_dim``."""
    g = torch.Generator().manual_seed(1)
    h, w, n_txt, hidden = 2 * args.latent_h, 2 * args.latent_w, args.text_tokens, args.heads * args.head_dim
    layers = args.double + args.single
    if args.family == "sd3":  # SD3.5-medium-like: qk RMS norm, the second attention in the first half
        config = dict(
            sample_size=h, patch_size=2, in_channels=16, num_layers=layers, attention_head_dim=args.head_dim,
            num_attention_heads=args.heads, joint_attention_dim=64, caption_projection_dim=hidden,
            pooled_projection_dim=64, out_channels=16, pos_embed_max_size=max(h, w) // 2, qk_norm="rms_norm",
            dual_attention_layers=tuple(range(layers // 2)))
        latents = torch.randn(args.batch, 16, h, w, generator=g)
        text = {"prompt_embeds": torch.randn(args.batch, n_txt, 64, generator=g),
                "pooled_prompt_embeds": torch.randn(args.batch, 64, generator=g)}
    elif args.family == "auraflow":  # MMDiT blocks, then single blocks over one text+image sequence
        config = dict(
            sample_size=h, patch_size=2, in_channels=4, num_mmdit_layers=args.double, num_single_dit_layers=args.single,
            attention_head_dim=args.head_dim, num_attention_heads=args.heads, joint_attention_dim=64,
            caption_projection_dim=hidden, out_channels=4, pos_embed_max_size=(max(h, w) // 2) ** 2)
        latents = torch.randn(args.batch, 4, h, w, generator=g)
        text = {"prompt_embeds": torch.randn(args.batch, n_txt, 64, generator=g)}
    elif args.family == "pixart_sigma":  # self-attention over image tokens, cross-attention to the text
        config = dict(
            num_attention_heads=args.heads, attention_head_dim=args.head_dim, in_channels=4, out_channels=8,
            num_layers=layers, cross_attention_dim=hidden, attention_bias=True, sample_size=h, patch_size=2,
            activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
            norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=64, use_additional_conditions=False)
        latents = torch.randn(args.batch, 4, h, w, generator=g)
        text = {"prompt_embeds": torch.randn(args.batch, n_txt, 64, generator=g),
                "prompt_attention_mask": torch.ones(args.batch, n_txt)}
    elif args.family == "chroma":  # Flux's layout with a text+image attention mask in every block
        config = dict(
            patch_size=1, in_channels=64, num_layers=args.double, num_single_layers=args.single,
            attention_head_dim=args.head_dim, num_attention_heads=args.heads, joint_attention_dim=64,
            axes_dims_rope=rope_axes(args.head_dim), approximator_num_channels=16, approximator_hidden_dim=64,
            approximator_layers=1)
        latents = torch.randn(args.batch, 16, h, w, generator=g)
        text = {"prompt_embeds": torch.randn(args.batch, n_txt, 64, generator=g),
                "prompt_attention_mask": torch.ones(args.batch, n_txt)}
    elif args.family == "hunyuanvideo":  # dual- then single-stream blocks over a (frames, h, w) video latent
        # no guidance embedding: it is one small MLP of the timestep, and the bench's adapter has no config to feed it
        config = dict(
            in_channels=16, out_channels=16, num_attention_heads=args.heads, attention_head_dim=args.head_dim,
            num_layers=args.double, num_single_layers=args.single, num_refiner_layers=1, patch_size=2, patch_size_t=1,
            guidance_embeds=False, text_embed_dim=64, pooled_projection_dim=64, rope_axes_dim=rope_axes(args.head_dim))
        latents = torch.randn(args.batch, 16, args.frames, h, w, generator=g)
        text = {"prompt_embeds": torch.randn(args.batch, n_txt, 64, generator=g),
                "prompt_attention_mask": torch.ones(args.batch, n_txt),
                "pooled_prompt_embeds": torch.randn(args.batch, 64, generator=g)}
    else:
        raise SystemExit(f"--family: {args.family!r} has no bench model; one of {', '.join(FAMILIES)}")
    return config, latents, text


def build_wan(args):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=args.heads, attention_head_dim=args.head_dim, in_channels=16,
        out_channels=16, text_dim=64, freq_dim=64, ffn_dim=4 * args.heads * args.head_dim,
        num_layers=args.double + args.single, rope_max_seq_len=64)
    model.requires_grad_(False)
    model = inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
                                    model)
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    return model.train()


def wan_inputs(args):
    g = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(args.batch, 16, args.frames, 2 * args.latent_h, 2 * args.latent_w, generator=g),
        encoder_hidden_states=torch.randn(args.batch, args.text_tokens, 64, generator=g),
        timestep=torch.rand(args.batch, generator=g) * 1000,
    )


def wan_layout(model):
    from simpletuner.models.wan import WanAdapter

    return WanAdapter.tread_layout(None, model)


def build_family(args):
    """(step callable, transformer, batch, target, TREAD layout) for a family, stepped through its adapter."""
    from peft import LoraConfig

    from simpletuner.config import get_family
    from simpletuner.models.registry import get_adapter_class

    adapter_class = get_adapter_class(args.family)
    adapter = adapter_class.__new__(adapter_class)  # predict / layout / presets need no config or weights
    config, latents, text = _family_model(args)
    torch.manual_seed(0)
    model = adapter_class.denoiser_class(**config)  # the class the family trains (PixArt's has PEFT mixed in)
    model.requires_grad_(False)
    targets = adapter.lora_target_modules(model, get_family(args.family).default_lora_target)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets))
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    flow = get_family(args.family).default_objective == "flow_matching"
    t = torch.full((args.batch,), 0.5) if flow else torch.full((args.batch,), 500)  # sigma, or a DDPM timestep
    batch = {"noisy_latents": latents, "t": t, "text": text}
    return _AdapterStep(adapter, model), model, batch, torch.randn_like(latents), adapter.tread_layout(model)


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


FAMILIES = ("flux", "sd3", "auraflow", "pixart_sigma", "chroma", "wan", "qwen_image", "hunyuanvideo")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="flux", choices=FAMILIES, help="model family whose transformer is timed")
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
    parser.add_argument("--frames", type=int, default=4, help="latent frames (--family wan, hunyuanvideo)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.family == "flux":
        model = build(args)
        step = model
        batch = inputs(args)
        target = torch.randn_like(batch["hidden_states"])
        layout = TreadLayout(blocks=list(model.transformer_blocks) + list(model.single_transformer_blocks))
    elif args.family == "qwen_image":
        model, batch, layout = build_qwen_image(args)
        step = model
        target = torch.randn_like(batch["hidden_states"])
    elif args.family == "wan":
        model = step = build_wan(args)
        batch = wan_inputs(args)
        target = torch.randn_like(batch["hidden_states"])
        layout = wan_layout(model)
    else:
        step, model, batch, target, layout = build_family(args)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    handle = apply_tread(model, [{"selection_ratio": args.ratios[0], "start_layer_idx": args.start,
                                  "end_layer_idx": args.end}], layout, generator=torch.Generator().manual_seed(0))
    route = handle.routes[0]
    configs = [None, *args.ratios]

    def run(ratio):
        handle.enabled = ratio is not None
        if ratio is not None:
            handle.routes[0] = type(route)(ratio, route.start_layer_idx, route.end_layer_idx)
        return lora_step(step, opt, batch, target)

    times = round_robin(run, configs, args.steps)

    n_img = args.latent_h * args.latent_w * (args.frames if args.family in ("wan", "hunyuanvideo") else 1)
    n_layers = args.double + args.single
    one_kind = args.family in ("sd3", "pixart_sigma", "wan", "qwen_image")
    kinds = "one kind of block" if one_kind else f"{args.double} double + {args.single} single"
    print(f"{args.family} LoRA training step, {n_img} image + {args.text_tokens} text tokens, batch {args.batch}, "
          f"{n_layers} layers ({kinds}), hidden {args.heads * args.head_dim}, "
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
