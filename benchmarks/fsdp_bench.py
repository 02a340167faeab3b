"""FSDP vs DDP on two gloo processes (this machine's CPU): what each process holds, and what a step costs.

    .venv/bin/python benchmarks/fsdp_bench.py [--dim 256 --double 2 --single 4 --steps 5]

A full fine-tune of a Flux-shaped transformer (``--dim`` wide), two processes, each on its own batch. DDP keeps the
whole model, its gradients and AdamW's two moments on every process; FSDP (``sharding.FsdpRun``, the trainer's own
code: ``fully_shard`` on each transformer block, then the root) keeps 1/2 of each, and gathers one block's weights
at a time for its forward and backward. Printed, from one run:

1. Bytes of training state (weights + gradients + optimizer state) each process holds between steps, counted from
   the tensors themselves (local shards for FSDP), and the ratio FSDP / DDP.
2. The median step time (wall and process CPU) of each, and the ratio FSDP / DDP: the price of gathering weights
   and reduce-scattering gradients over gloo instead of one all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

WORLD = 2


def flux(args):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=args.double, num_single_layers=args.single,
        attention_head_dim=64, num_attention_heads=args.dim // 64, joint_attention_dim=args.dim,
        pooled_projection_dim=args.dim // 2, guidance_embeds=True, axes_dims_rope=(16, 24, 24),
    )


def batch(args, rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens, text = args.tokens, 32
    return dict(hidden_states=torch.randn(1, tokens, 64, generator=g),
                encoder_hidden_states=torch.randn(1, text, args.dim, generator=g),
                pooled_projections=torch.randn(1, args.dim // 2, generator=g), timestep=torch.rand(1, generator=g),
                img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3), guidance=torch.ones(1),
                return_dict=False)


def held_bytes(model, optimizer) -> int:
    """Bytes of weights, gradients and optimizer state this process holds (its shards, under FSDP)."""
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = 0
    for p in model.parameters():
        total += local(p) + (local(p.grad) if p.grad is not None else 0)
    for state in optimizer.state.values():
        total += sum(local(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def worker(rank: int, args, port: int, out: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE":
                       str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ACCELERATE_USE_CPU": "1"})
    torch.set_num_threads(1)
    import torch.distributed as dist
    from accelerate import Accelerator

    from simpletuner.config import load_train_config
    from simpletuner.training.sharding import FsdpRun

    accelerator = Accelerator()
    config = load_train_config({"model_family": "flux", "model_flavour": "tiny", "model_type": "full",
                                "fsdp_enable": True, "mixed_precision": "no", "max_train_steps": 1}).config
    results = {}
    for mode in ("ddp", "fsdp"):
        model = flux(args).requires_grad_(True)
        if mode == "fsdp":
            model = FsdpRun(config, accelerator).shard(model)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times, held = [], 0
        for step in range(args.steps + 1):  # the first is a warm-up
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            out_ = model(**batch(args, rank, step))[0]
            out_.pow(2).mean().backward()
            optimizer.step()
            if step:
                times.append((time.perf_counter() - wall, time.process_time() - cpu))
            held = held_bytes(model, optimizer)  # gradients still held, as between backward and zero_grad
            optimizer.zero_grad(set_to_none=True)
        results[mode] = {"held": held, "wall": statistics.median(t for t, _ in times),
                         "cpu": statistics.median(c for _, c in times)}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--double", type=int, default=2)
    parser.add_argument("--single", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="image tokens per sample")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        mp.spawn(worker, args=(args, port, out), nprocs=WORLD, join=True)
        r = json.loads(Path(out).read_text())
    mib = 2 ** 20
    print(f"Flux-shaped transformer, dim {args.dim}, {args.double} double + {args.single} single blocks, "
          f"{args.tokens} image tokens, full fine-tune, AdamW, {WORLD} gloo processes, 1 thread each")
    print(f"training state held per process: DDP {r['ddp']['held'] / mib:.1f} MiB, FSDP {r['fsdp']['held'] / mib:.1f} "
          f"MiB -> FSDP/DDP {r['fsdp']['held'] / r['ddp']['held']:.2f}x")
    print(f"median step: DDP {r['ddp']['wall'] * 1e3:.0f} ms wall / {r['ddp']['cpu'] * 1e3:.0f} ms CPU, "
          f"FSDP {r['fsdp']['wall'] * 1e3:.0f} ms wall / {r['fsdp']['cpu'] * 1e3:.0f} ms CPU -> FSDP/DDP "
          f"{r['fsdp']['wall'] / r['ddp']['wall']:.2f}x wall, {r['fsdp']['cpu'] / r['ddp']['cpu']:.2f}x CPU")


if __name__ == "__main__":
    main()
