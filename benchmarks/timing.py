"""The timing harness the benchmarks share: one LoRA training step, and configs timed round-robin.

Imported by the scripts beside it (run them as ``python benchmarks/<name>.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterable

import torch


def lora_step(model, opt, batch: dict, target: torch.Tensor) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of forward + MSE + backward + optimizer step. With one thread CPU time
    is immune to other processes taking the core, so it is the steadier figure on a shared machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(**batch).sample, target).backward()
    opt.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def round_robin(run: Callable[[Hashable], tuple[float, float]], configs: Iterable[Hashable],
                steps: int) -> dict[Hashable, list[tuple[float, float]]]:
    """One warm-up call per config (allocator, kernels), then ``steps`` rounds of one timed call per config, so
    background load hits every config alike. Returns each config's (wall, cpu) samples."""
    configs = list(configs)
    for config in configs:
        run(config)
    times = {config: [] for config in configs}
    for _ in range(steps):
        for config in configs:
            times[config].append(run(config))
    return times


def median_wall(samples: list[tuple[float, float]]) -> float:
    return statistics.median(wall for wall, _ in samples)


def median_cpu(samples: list[tuple[float, float]]) -> float:
    return statistics.median(cpu for _, cpu in samples)
