"""``use_ema``: an exponential moving average of the trained weights (diffusers' ``EMAModel``).

The average covers the trainable parameters only (the LoRA / LyCORIS weights, or the full model's), is updated every
``ema_update_interval`` optimizer steps with diffusers' warm-up (decay ``min(ema_decay, (1 + n) / (10 + n))`` at
the n-th update), lives on the CPU (``ema_device: cpu``) or beside the weights, is saved in every checkpoint
(``ema.pt``, plain tensors and numbers: loadable with ``weights_only=True``) and restored exactly on resume.
``swapped_in(model)`` puts the averaged weights into the model for validation or export and the trained ones back
afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from diffusers.training_utils import EMAModel


class TrainedWeightsEMA:
    def __init__(self, params: list[torch.nn.Parameter], *, decay: float, update_interval: int = 1,
                 device: str | torch.device = "cpu"):
        self.params = list(params)
        self.update_interval = max(1, int(update_interval))
        self.device = torch.device(device)
        # diffusers' EMA keeps the decay warm-up and the state layout; the shadows are float32 on ``device``
        self.ema = EMAModel(self.params, decay=decay, use_ema_warmup=False, foreach=True)
        self.ema.shadow_params = [p.detach().to(self.device, torch.float32).clone() for p in self.params]

    @torch.no_grad()
    def update(self, global_step: int) -> bool:
        """After optimizer step ``global_step``: fold the weights into the average when the interval says so."""
        if global_step % self.update_interval:
            return False
        self.ema.optimization_step += 1
        decay = self.ema.get_decay(self.ema.optimization_step)
        self.ema.cur_decay_value = decay
        # shadow += (1 - decay) * (weight - shadow), with the weights brought to where the average lives
        torch._foreach_lerp_(self.ema.shadow_params,
                             [p.detach().to(self.device, torch.float32) for p in self.params], 1 - decay)
        return True

    @torch.no_grad()
    def reset_to_weights(self) -> None:
        """Start the average over from the current weights (resuming a checkpoint saved without an EMA)."""
        for shadow, param in zip(self.ema.shadow_params, self.params):
            shadow.copy_(param.detach().to(shadow.device, torch.float32))

    def state_dict(self) -> dict:
        state = dict(self.ema.state_dict())
        state["shadow_params"] = [s.detach().cpu().clone() for s in self.ema.shadow_params]
        return state

    def load_state_dict(self, state: dict, source: str) -> None:
        shadows = state.get("shadow_params") or []
        if len(shadows) != len(self.params) or any(s.shape != p.shape for s, p in zip(shadows, self.params)):
            raise ValueError(f"{source}: the EMA weights do not match the trained weights "
                             f"({len(shadows)} tensors saved, {len(self.params)} trained)")
        self.ema.load_state_dict({**state, "shadow_params": list(shadows)})
        self.ema.shadow_params = [s.to(self.device, torch.float32) for s in shadows]

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The trained parameters hold the EMA weights for the duration; their own values come back after."""
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for param, shadow in zip(self.params, self.ema.shadow_params):
                param.copy_(shadow.to(param.device, param.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for param, value in zip(self.params, saved):
                    param.copy_(value)
