"""``simpletuner consolidate CHECKPOINT [--out DIR]``: a sharded (FSDP) checkpoint -> the weights a finished run
writes, loadable by the family's diffusers pipeline: ``DIR/transformer/`` for a full fine-tune, the family's LoRA
file (``DIR/pytorch_lora_weights.safetensors``) for a LoRA run.

One process, no GPU and no process group: every shard is read with torch.distributed.checkpoint into whole tensors
(after the same file checks as a resume, so a damaged shard is named), and the result is written into a temporary
folder that is renamed to ``DIR`` once complete (default: ``<CHECKPOINT>-consolidated`` beside the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint-<step> folder of a run with fsdp_enable")
    parser.add_argument("--out", default=None,
                        help="folder to write (must not exist; default: <checkpoint>-consolidated beside it)")


def consolidate(checkpoint: str | Path, out: str | Path | None = None) -> Path:
    """Write the weights of ``checkpoint`` into ``out``; returns the transformer folder or the LoRA file."""
    from simpletuner.config import load_train_config
    from simpletuner.models.registry import create_adapter
    from simpletuner.training import sharding
    from simpletuner.training.checkpoint import fsync_tree, read_training_state

    checkpoint = Path(checkpoint).resolve()
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint: {checkpoint} is not a folder")
    saved = read_training_state(checkpoint)
    layout = saved.get("sharding")
    if not layout:
        raise ValueError(f"checkpoint: {checkpoint} is not sharded (its run had no fsdp_enable): its "
                         "trainable.safetensors already holds the whole trained weights")
    if layout.get("kind") != sharding.FsdpRun.kind:
        raise ValueError(f"checkpoint: {checkpoint} was written by DeepSpeed; use the zero_to_fp32.py script DeepSpeed "
                         f"wrote into {checkpoint / sharding.DeepSpeedRun.folder}")
    target = Path(out).resolve() if out else checkpoint.with_name(f"{checkpoint.name}-consolidated")
    if target.exists():
        raise FileExistsError(f"--out: {target} already exists; choose another folder or remove it")

    config = load_train_config(checkpoint / sharding.RUN_CONFIG).config
    parts = sharding.read_parts(checkpoint, layout, optimizer=False)
    weights = sharding.read_full_weights(checkpoint, parts)
    transformer_config = _read_json(checkpoint / sharding.TRANSFORMER_CONFIG)
    lora_config = None
    if config.model_type == "lora":
        from peft import LoraConfig

        lora_config = LoraConfig.from_pretrained(str(checkpoint))
    adapter = create_adapter(config)

    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        written = sharding.write_weights(adapter, config, weights, transformer_config, lora_config, tmp)
        fsync_tree(tmp)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target / written.relative_to(tmp)


def _read_json(path: Path) -> dict:
    from simpletuner.training.checkpoint import CheckpointDamaged

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(f"{path}: missing or damaged ({exc})") from None


def run(args) -> int:
    from simpletuner.config import ConfigError
    from simpletuner.training.checkpoint import CheckpointDamaged

    try:
        path = consolidate(args.checkpoint, args.out)
    except (ConfigError, CheckpointDamaged, FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    kind = "diffusers transformer folder (Model.from_pretrained, then the pipeline's transformer=)" if path.is_dir() \
        else "LoRA file (pipeline.load_lora_weights)"
    print(f"wrote {path}: a {kind}")
    return 0
