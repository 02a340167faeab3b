"""Weight memory and LoRA step time of a quantized Flux-shaped transformer (quanto, torchao, and bitsandbytes NF4
where a CUDA GPU runs it) vs the unquantized one.

    .venv/bin/python benchmarks/quantize_bench.py

1. Weight bytes (parameters + quantized data, scales and shifts, as stored) of a bf16 Flux-shaped transformer
   (hidden 1024, 5 double + 10 single blocks, ~350M parameters: the block linears dominate as in the real 12B
   Flux, though the embedders' share is ~2% here vs ~0.5% there) after each precision, relative to bf16. The embedders and output layers stay in bf16
   (quantize.DEFAULT_EXCLUDE) and are counted.
2. LoRA training step time (forward + backward + AdamW step, fp32 activations on CPU) on a smaller model, relative
   to the unquantized base. Configs are timed round-robin; CPU time of this process with one thread.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import time

import torch
from diffusers import FluxTransformer2DModel
from peft import LoraConfig, inject_adapter_in_model

from simpletuner.models.quantize import quantize_model, weight_bytes
from timing import lora_step, median_cpu, round_robin

PRECISIONS = ["no_change", "int8-quanto", "fp8-quanto", "int4-quanto", "int2-quanto"]
if importlib.util.find_spec("torchao") is not None:
    PRECISIONS += ["int8-torchao", "fp8-torchao"]
if importlib.util.find_spec("bitsandbytes") is not None and torch.cuda.is_available():
    PRECISIONS += ["nf4-bnb"]  # bitsandbytes quantizes on the GPU; on the CPU it is refused, so no row
GOALS = {"int8-quanto": 0.55, "int4-quanto": 0.30, "int8-torchao": 0.55, "nf4-bnb": 0.30}


def flux(dim: int, double: int, single: int, dtype):
    torch.manual_seed(0)
    heads = dim // 128
    return FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=double, num_single_layers=single, attention_head_dim=128,
        num_attention_heads=heads, joint_attention_dim=dim, pooled_projection_dim=dim // 2, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ).to(dtype)


def sizes(args):
    rows = []
    reference = None
    for precision in PRECISIONS:
        model = flux(args.dim, args.double, args.single, torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        start = time.perf_counter()
        quantize_model(model, precision, device="cuda" if precision == "nf4-bnb" else None)
        seconds = time.perf_counter() - start
        size = weight_bytes(model)
        reference = reference or size
        rows.append((precision, size, size / reference, seconds))
        del model
        gc.collect()
    print(f"Weight bytes, Flux-shaped transformer: hidden {args.dim}, {args.double} double + {args.single} single "
          f"blocks, {params / 1e6:.0f}M parameters, bf16 base\n")
    print("| base_model_precision | weight MiB | vs bf16 | goal | quantize time (s) |")
    print("|---|---|---|---|---|")
    for precision, size, ratio, seconds in rows:
        goal = f"<= {GOALS[precision]:.2f}x" if precision in GOALS else ""
        label = "no_change (bf16)" if precision == "no_change" else precision
        print(f"| {label} | {size / 2**20:.1f} | {ratio:.3f}x | {goal} | {seconds:.2f} |")
    print()


def lora_model(args, precision):
    model = flux(args.step_dim, args.step_double, args.step_single, torch.float32)
    quantize_model(model, precision)
    model.requires_grad_(False)
    cfg = LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj",
                                                          "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp",
                                                          "ff.net.2"])
    model = inject_adapter_in_model(cfg, model)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def step_times(args):
    g = torch.Generator().manual_seed(1)
    n, t = args.tokens, 64
    batch = dict(
        hidden_states=torch.randn(1, n, 64, generator=g),
        encoder_hidden_states=torch.randn(1, t, args.step_dim, generator=g),
        pooled_projections=torch.randn(1, args.step_dim // 2, generator=g),
        timestep=torch.rand(1, generator=g),
        img_ids=torch.randint(0, 64, (n, 3), generator=g).float(),
        txt_ids=torch.zeros(t, 3),
        guidance=torch.full((1,), 3.5),
    )
    target = torch.randn_like(batch["hidden_states"])
    timed = [p for p in PRECISIONS if p != "nf4-bnb"]  # NF4 trains on a GPU only: its step is not a CPU figure
    models = {p: lora_model(args, p) for p in timed}

    times = round_robin(lambda p: lora_step(*models[p], batch, target), timed, args.steps)
    base = median_cpu(times["no_change"])
    print(f"LoRA (r=16) step time on CPU: hidden {args.step_dim}, {args.step_double} double + {args.step_single} single blocks, "
          f"{n} image + {t} text tokens, fp32 activations, median of {args.steps} steps, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}\n")
    print("| base_model_precision | CPU s/step | vs no_change |")
    print("|---|---|---|")
    for precision in timed:
        median = median_cpu(times[precision])
        print(f"| {precision} | {median:.2f} | {median / base:.2f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024, help="hidden size for the weight-bytes table")
    parser.add_argument("--double", type=int, default=5, help="double blocks (weight-bytes table)")
    parser.add_argument("--single", type=int, default=10, help="single blocks (weight-bytes table)")
    parser.add_argument("--step-double", type=int, default=2, help="double blocks (step-time table)")
    parser.add_argument("--step-single", type=int, default=4, help="single blocks (step-time table)")
    parser.add_argument("--step-dim", type=int, default=512, help="hidden size for the step-time table")
    parser.add_argument("--tokens", type=int, default=1024, help="image tokens for the step-time table")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes(args)
    step_times(args)


if __name__ == "__main__":
    main()
