"""Optimizers by SimpleTuner's names (the registry at the end), and ``adamw_bf16``: AdamW for bf16 weights, with
stochastic rounding of each update.

Plain AdamW on bf16 weights loses small updates to rounding (bf16 keeps 8 bits of mantissa); rounding the fp32
result up or down at random, in proportion to the remainder, keeps the update right in expectation. Moments are
kept in fp32. On fp32 weights it behaves exactly like AdamW.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import inspect
import math
from dataclasses import dataclass, field

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


# ---- the registry: SimpleTuner's optimizer names -> classes --------------------------------------------------
@dataclass(frozen=True)
class OptimizerSpec:
    target: str  # "module:Class"
    defaults: dict = field(default_factory=dict)  # SimpleTuner's defaults for it, under the config's own values
    schedule_free: bool = False  # keeps its own schedule (train/eval modes); lr_scheduler must stay constant
    beta3: float | None = None  # AdEMAMix's slow EMA: betas become (adam_beta1, adam_beta2, beta3)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("torch.optim:AdamW"),
    "adamw_bf16": OptimizerSpec("simpletuner.training.optimizers:AdamWBF16"),
    # optimi: Kahan summation keeps bf16 weights' small updates (kahan_sum None = on for bf16 parameters)
    "optimi-adamw": OptimizerSpec("optimi:AdamW"),
    "optimi-stableadamw": OptimizerSpec("optimi:StableAdamW"),
    "optimi-lion": OptimizerSpec("optimi:Lion", {"weight_decay": 0.0}),
    "prodigy": OptimizerSpec("prodigyopt:Prodigy"),
    "adamw_schedulefree": OptimizerSpec("schedulefree:AdamWScheduleFree", schedule_free=True),
    "ademamix": OptimizerSpec("pytorch_optimizer:AdEMAMix", beta3=0.9999),
    "bnb-adamw": OptimizerSpec("bitsandbytes.optim:AdamW"),
    "bnb-adamw8bit": OptimizerSpec("bitsandbytes.optim:AdamW8bit"),
    "bnb-adamw-paged": OptimizerSpec("bitsandbytes.optim:PagedAdamW"),
    "bnb-adamw8bit-paged": OptimizerSpec("bitsandbytes.optim:PagedAdamW8bit"),
    "bnb-lion": OptimizerSpec("bitsandbytes.optim:Lion", {"weight_decay": 0.0}),
    "bnb-lion8bit": OptimizerSpec("bitsandbytes.optim:Lion8bit", {"weight_decay": 0.0}),
    "bnb-lion-paged": OptimizerSpec("bitsandbytes.optim:PagedLion", {"weight_decay": 0.0}),
    "bnb-lion8bit-paged": OptimizerSpec("bitsandbytes.optim:PagedLion8bit", {"weight_decay": 0.0}),
    "bnb-ademamix": OptimizerSpec("bitsandbytes.optim:AdEMAMix", beta3=0.9999),
    "bnb-ademamix8bit": OptimizerSpec("bitsandbytes.optim:AdEMAMix8bit", beta3=0.9999),
    "bnb-ademamix-paged": OptimizerSpec("bitsandbytes.optim:PagedAdEMAMix", beta3=0.9999),
    "bnb-ademamix8bit-paged": OptimizerSpec("bitsandbytes.optim:PagedAdEMAMix8bit", beta3=0.9999),
}


def optimizer_class(name: str):
    """Import the class behind optimizer ``name``; ImportError naming the extra that installs it."""
    from simpletuner.config.requirements import OPTIMIZER_PACKAGES

    module_name, _, attr = OPTIMIZERS[name].target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        package = OPTIMIZER_PACKAGES[name]
        hint = package.hint() if package is not None else "reinstall simpletuner"
        raise ImportError(f"optimizer: {name!r} needs a package that is not installed: {hint}") from None
    return getattr(module, attr)


def optimizer_kwargs(config, cls) -> dict:
    """The keyword arguments optimizer ``cls`` gets: lr, then the adam_* settings it takes, then
    ``optimizer_config``. ValueError naming ``optimizer_config.<key>`` for a keyword it does not take."""
    spec = OPTIMIZERS[config.optimizer]
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())
    kwargs = {"lr": config.learning_rate}
    common = {"betas": (config.adam_beta1, config.adam_beta2), "weight_decay": config.adam_weight_decay,
              "eps": config.adam_epsilon}
    if spec.beta3 is not None:
        common["betas"] = (config.adam_beta1, config.adam_beta2, spec.beta3)
    common.update(spec.defaults)
    kwargs.update({k: v for k, v in common.items() if k in accepted})
    if spec.schedule_free and "warmup_steps" in accepted:
        kwargs["warmup_steps"] = config.lr_warmup_steps  # schedule-free warms up itself; the scheduler stays flat
    for key, value in (config.optimizer_config or {}).items():
        if key not in accepted and not takes_any:
            raise ValueError(f"optimizer_config.{key}: {config.optimizer!r} ({cls.__module__}.{cls.__name__}) takes "
                             f"no such argument; it takes {', '.join(sorted(accepted))}")
        kwargs[key] = tuple(value) if isinstance(value, list) else value
    return kwargs


def param_groups(model, config, lr_scale=()) -> list[dict]:
    """Trainable parameters in optimizer groups: one per learning-rate multiplier of the family's ``lr_scale``
    (fnmatch patterns over parameter names, first match wins), the rest at ``learning_rate``."""
    groups: dict[float, list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        scale = next((s for pattern, s in lr_scale if fnmatch.fnmatch(name, pattern)), 1.0)
        groups.setdefault(scale, []).append(param)
    return [{"params": params, "lr": config.learning_rate * scale}
            for scale, params in sorted(groups.items(), key=lambda kv: kv[0] != 1.0)]


def build_optimizer(config, params):
    """The optimizer ``config.optimizer`` names over ``params`` (tensors or param-group dicts)."""
    cls = optimizer_class(config.optimizer)
    return cls(params, **optimizer_kwargs(config, cls))


def is_schedule_free(optimizer) -> bool:
    return hasattr(optimizer, "eval") and hasattr(optimizer, "train") and "ScheduleFree" in type(optimizer).__name__


@contextlib.contextmanager
def evaluation_weights(optimizer):
    """A schedule-free optimizer's parameters hold its training iterate; validation and export want the averaged
    weights, which ``optimizer.eval()`` swaps in (and ``train()`` swaps back). Other optimizers: nothing."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if not is_schedule_free(optimizer):
        yield
        return
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()
