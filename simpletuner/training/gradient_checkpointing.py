"""``gradient_checkpointing_interval``: recompute only every N-th transformer block.

diffusers transformers call ``self._gradient_checkpointing_func(block, *args)`` for every block when
checkpointing is on; this wraps that function so the other blocks run normally (faster, more memory).
"""

from __future__ import annotations


def apply_gradient_checkpointing_interval(transformer, interval: int) -> None:
    if interval < 1:
        raise ValueError(f"gradient_checkpointing_interval: {interval} must be 1 or more")
    if not getattr(transformer, "gradient_checkpointing", False):
        raise ValueError("gradient_checkpointing_interval: needs gradient_checkpointing enabled first")
    blocks = [b for name in ("transformer_blocks", "single_transformer_blocks")
              for b in getattr(transformer, name, [])]
    checkpointed = {id(b) for i, b in enumerate(blocks) if i % interval == 0}
    inner = transformer._gradient_checkpointing_func

    def every_nth(block, *args):
        if id(block) in checkpointed:
            return inner(block, *args)
        return block(*args)

    transformer._gradient_checkpointing_func = every_nth
    transformer._simpletuner_checkpointed_blocks = len(checkpointed)
