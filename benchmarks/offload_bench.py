"""Group offload on a Flux-shaped transformer: what the accelerator must hold, and what the hooks cost.

    .venv/bin/python benchmarks/offload_bench.py

On a CPU-only machine group offload saves nothing (weights are already in host memory) — it is for GPUs. This
script reports:
1. Weight bytes that must sit on the onload device at once with block_level offload (the largest group of blocks
   plus the modules outside the block lists, which diffusers onloads for the whole forward), vs the whole model.
   Computed from the module structure with diffusers' grouping rule; streams prefetch one more group.
2. Measured LoRA step time on CPU with the offload hooks (onload device cpu) vs without: the hooks' bookkeeping
   overhead, which on a GPU comes on top of the host-to-device copies.
"""

from __future__ import annotations

import argparse

import torch
from diffusers import FluxTransformer2DModel
from peft import LoraConfig, inject_adapter_in_model

from simpletuner.training.offload import enable_group_offload
from simpletuner.models.quantize import weight_bytes
from timing import lora_step, median_cpu, round_robin


def flux(args):
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=args.double, num_single_layers=args.single,
        attention_head_dim=64, num_attention_heads=args.dim // 64, joint_attention_dim=args.dim,
        pooled_projection_dim=args.dim // 2, guidance_embeds=True, axes_dims_rope=(16, 24, 24),
    )


def resident_bytes(model, blocks_per_group: int) -> tuple[int, int]:
    """(bytes onloaded at once with block_level offload, total bytes)."""
    lists = [m for m in model.children() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]
    rest = weight_bytes(model) - sum(weight_bytes(m) for m in lists)
    largest = max(sum(weight_bytes(b) for b in blocks[i:i + blocks_per_group])
                  for blocks in lists for i in range(0, len(blocks), blocks_per_group))
    return rest + largest, weight_bytes(model)


def lora(model):
    model.requires_grad_(False)
    cfg = LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "proj_mlp", "ff.net.2"])
    return inject_adapter_in_model(cfg, model)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--double", type=int, default=4)
    parser.add_argument("--single", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = flux(args)
    print(f"Flux-shaped transformer: hidden {args.dim}, {args.double} double + {args.single} single blocks, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters (fp32)\n")
    print("| group_offload_blocks_per_group | weights on the onload device at once | vs whole model |")
    print("|---|---|---|")
    for per_group in (1, 2, 4):
        resident, total = resident_bytes(model, per_group)
        print(f"| {per_group} | {resident / 2**20:.1f} MiB of {total / 2**20:.1f} MiB | {resident / total:.2f}x |")
    print()

    g = torch.Generator().manual_seed(1)
    n, t = args.tokens, 32
    batch = dict(
        hidden_states=torch.randn(1, n, 64, generator=g),
        encoder_hidden_states=torch.randn(1, t, args.dim, generator=g),
        pooled_projections=torch.randn(1, args.dim // 2, generator=g), timestep=torch.rand(1, generator=g),
        img_ids=torch.randint(0, 64, (n, 3), generator=g).float(), txt_ids=torch.zeros(t, 3),
        guidance=torch.full((1,), 3.5),
    )
    target = torch.randn_like(batch["hidden_states"])
    configs = {
        "off": lora(flux(args)),
        "block_level, 1 per group": enable_group_offload(lora(flux(args)), onload_device="cpu"),
        "leaf_level": enable_group_offload(lora(flux(args)), onload_device="cpu", offload_type="leaf_level"),
    }
    optimizers = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
                  for k, m in configs.items()}

    times = round_robin(lambda name: lora_step(configs[name], optimizers[name], batch, target), configs,
                        args.steps)
    base = median_cpu(times["off"])
    print(f"LoRA step on CPU (onload device cpu: nothing moves), {n} image + {t} text tokens, CPU time, median of "
          f"{args.steps} steps, {torch.get_num_threads()} thread(s)\n")
    print("| group offload | CPU s/step | vs off |")
    print("|---|---|---|")
    for name in configs:
        median = median_cpu(times[name])
        print(f"| {name} | {median:.2f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
