"""``optimizer: adamw_bf16``: AdamW for bf16 weights, with stochastic rounding of each update.

Plain AdamW on bf16 weights loses small updates to rounding (bf16 keeps 8 bits of mantissa); rounding the fp32
result up or down at random, in proportion to the remainder, keeps the update right in expectation. Moments are
kept in fp32. On fp32 weights it behaves exactly like AdamW.
"""

from __future__ import annotations

import math

import torch


def _stochastic_round_to_bf16(value: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    bits = value.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, device=bits.device, dtype=torch.int32, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class AdamWBF16(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                grad = p.grad.float()
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = 1 - beta1 ** state["step"]
                bias2 = 1 - beta2 ** state["step"]
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(group["eps"])
                updated = p.float() * (1 - group["lr"] * group["weight_decay"])
                updated.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias1)
                if p.dtype == torch.bfloat16:
                    p.copy_(_stochastic_round_to_bf16(updated, None))
                else:
                    p.copy_(updated)
        return loss
