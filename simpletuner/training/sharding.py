"""Sharded training: FSDP2 for full fine-tunes and LoRA runs (``fsdp_enable``), and DeepSpeed ZeRO passed through to
accelerate on CUDA GPUs (``deepspeed_config``).

Where an FSDP run is sharded (decided after reading accelerate 1.15 and torch 2.13):

- On GPUs, accelerate's FSDP plugin (``fsdp_version=2``) shards the transformer inside ``accelerator.prepare``: each of
  the family's blocks (``ModelAdapter.fsdp_block_classes``, or ``fsdp_transformer_layer_cls_to_wrap``) becomes one
  ``fully_shard`` unit, then the root module.
- On the CPU accelerate never turns its plugin on (with ``ACCELERATE_USE_CPU`` the state is ``MULTI_CPU``, which trains
  plain DDP, and ``prepare`` refuses a model holding DTensors), so :meth:`FsdpRun.shard` calls torch's ``fully_shard``
  on the same blocks and then the root itself, over all processes' gloo group, and the model stays out of
  ``accelerator.prepare`` (the optimizer and the schedule still go through it).

Both leave the same module behind (DTensor parameters, each process holding 1/N of every one), so checkpoints, the
final export and ``simpletuner consolidate`` share one code path on torch.distributed.checkpoint (DCP).

What an FSDP run adds to a checkpoint (``checkpoint.py`` writes the rest, atomically as always):

- ``SHARDED_STATE_DICT``: ``sharded/``, DCP's files (one ``__<rank>_0.distcp`` per process and ``.metadata``) with
  the trained weights and the optimizer's tensors, and ``optimizer_groups.pt`` with the optimizer's other values;
- ``FULL_STATE_DICT``: ``trainable.safetensors`` and ``optimizer.pt``, gathered whole by the main process (every
  process reads them back whole on resume);
- ``run_config.json`` (the training config without its webhooks), ``transformer_config.json`` and, for LoRA, peft's
  ``adapter_config.json``: what consolidation needs to write the weights as users load them.

``training_state.json`` records every file's size, so a missing or cut-short file is reported by name before anything
is restored. DCP reads tensors with ``torch.load(weights_only=True)``; its ``.metadata`` pickle is read here with an
unpickler that builds only DCP's own metadata classes, and the optimizer's non-tensor values never enter DCP (DCP
would unpickle them), so resuming still never runs pickled code.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from simpletuner.training.checkpoint import CheckpointDamaged, load_pt
from simpletuner.training.guards import LossNotFinite, require_finite

log = logging.getLogger("simpletuner.sharding")

FULL = "FULL_STATE_DICT"
SHARDED_DIR = "sharded"
OPTIMIZER_GROUPS = "optimizer_groups.pt"
RUN_CONFIG = "run_config.json"
TRANSFORMER_CONFIG = "transformer_config.json"
LORA_CONFIG = "adapter_config.json"  # peft's own file name (LoraConfig.save_pretrained / from_pretrained)
ADAPTER_NAME = "default"
_PRIVATE = {"webhook_config"}  # never written into a checkpoint: it holds the webhook's signing secret


# ---- the Accelerator -------------------------------------------------------------------------------------------
def accelerator_kwargs(config) -> dict:
    """Keyword arguments of the run's ``Accelerator``: accelerate's FSDP or DeepSpeed plugin on CUDA GPUs, nothing
    otherwise (an FSDP run on the CPU shards by hand; DeepSpeed off CUDA is refused by the preflight)."""
    if not uses_cuda():
        return {}
    if config.fsdp_enable:
        return {"fsdp_plugin": fsdp_plugin(config)}
    if config.deepspeed_config is not None:
        from accelerate.utils import DeepSpeedPlugin

        world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch for every process
        return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=deepspeed_settings(config, world_size))}
    return {}


def uses_cuda() -> bool:
    """Whether accelerate will run this process on a CUDA GPU (decided before the Accelerator exists, because its
    plugins are arguments): not with ``ACCELERATE_USE_CPU``, which the launcher sets on machines without GPUs."""
    from accelerate.utils import parse_flag_from_env

    return torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")


def block_classes(config) -> list[str]:
    """The class names of the blocks sharded one by one: the config's, else the family's transformer blocks."""
    from simpletuner.models.registry import get_adapter_class

    names = config.fsdp_transformer_layer_cls_to_wrap or get_adapter_class(config.model_family).fsdp_block_classes()
    if not names:
        raise ValueError(f"fsdp_transformer_layer_cls_to_wrap: model_family {config.model_family!r} names no "
                         "transformer blocks to shard; name its block classes here")
    return list(names)


def fsdp_plugin(config):
    """accelerate's FSDP2 plugin for a GPU run: the family's blocks wrapped one by one, then the root."""
    from accelerate import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=config.fsdp_version, reshard_after_forward=config.fsdp_reshard_after_forward,
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=block_classes(config),
        state_dict_type=config.fsdp_state_dict_type, cpu_ram_efficient_loading=False,
    )


def deepspeed_settings(config, world_size: int) -> dict:
    """The user's DeepSpeed config with the values accelerate would fill from a dataloader ("auto" or absent: batch
    sizes, accumulation, clipping) taken from this config instead; the trainer hands accelerate no dataloader."""
    settings = copy.deepcopy(config.deepspeed_config)
    fills = {
        "train_micro_batch_size_per_gpu": config.train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "train_batch_size": config.train_batch_size * config.gradient_accumulation_steps * world_size,
        "gradient_clipping": config.max_grad_norm,
    }
    for key, value in fills.items():
        if settings.get(key, "auto") == "auto":
            settings[key] = value
    return settings


def for_run(config, accelerator) -> FsdpRun | DeepSpeedRun | None:
    """The run's sharding (None for an unsharded run)."""
    if config.fsdp_enable:
        return FsdpRun(config, accelerator)
    if config.deepspeed_config is not None:
        return DeepSpeedRun(config, accelerator)
    return None


# ---- FSDP ------------------------------------------------------------------------------------------------------
class FsdpRun:
    """One FSDP run's transformer and its state: shard it, prepare it, save, check, restore and gather it."""

    kind = "fsdp"

    def __init__(self, config, accelerator):
        from accelerate.utils import DistributedType

        if accelerator.num_processes < 2:
            raise ValueError("fsdp_enable: needs 2 or more processes (simpletuner train --num_processes 2, or a "
                             "job's num_processes); a single process has nothing to shard across")
        self.config = config
        self.accelerator = accelerator
        self.by_hand = accelerator.distributed_type != DistributedType.FSDP  # the CPU: accelerate leaves it to us
        self.model = None
        self.optimizer = None

    # ---- setup ----
    def shard(self, transformer):
        """Shard ``transformer`` block by block across all processes (on the CPU; on GPUs accelerate's plugin does it
        in ``prepare``). Its parameters are replaced by DTensors: build the optimizer afterwards."""
        names = block_classes(self.config)
        present = {type(m).__name__ for m in transformer.modules()}
        unknown = [n for n in names if n not in present]
        if unknown:
            raise ValueError(f"fsdp_transformer_layer_cls_to_wrap: {', '.join(unknown)} not found in "
                             f"{type(transformer).__name__} (its blocks are e.g. "
                             f"{', '.join(sorted(_block_names(transformer))[:4]) or 'unnamed'})")
        if not self.by_hand:
            return transformer
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.accelerator.device.type, (self.accelerator.num_processes,))
        reshard = self.config.fsdp_reshard_after_forward
        # descendants before their ancestors (nested block classes, e.g. a UNet's), the root last
        blocks = [m for m in reversed(list(transformer.modules())) if type(m).__name__ in names and m is not transformer]
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(transformer, mesh=mesh, reshard_after_forward=reshard)
        log.info("FSDP: %d blocks (%s) and the root sharded over %d processes", len(blocks), ", ".join(names),
                 self.accelerator.num_processes)
        return transformer

    def prepare(self, transformer, optimizer, lr_scheduler):
        """``accelerator.prepare`` for a sharded model: the optimizer and schedule only when sharded by hand (accelerate
        would wrap the model in DDP), all three through accelerate's FSDP plugin otherwise."""
        if self.by_hand:
            optimizer, lr_scheduler = self.accelerator.prepare(optimizer, lr_scheduler)
        else:
            transformer, optimizer, lr_scheduler = self.accelerator.prepare(transformer, optimizer, lr_scheduler)
        self.model = self.accelerator.unwrap_model(transformer)
        self.optimizer = optimizer
        return transformer, optimizer, lr_scheduler

    # ---- state ----
    @property
    def full(self) -> bool:
        return self.config.fsdp_state_dict_type == FULL

    def _options(self, full: bool = False, strict: bool = True):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # the frozen base of a LoRA run is never saved: it is the base model
        return StateDictOptions(ignore_frozen_params=True, full_state_dict=full, cpu_offload=full, strict=strict)

    def _torch_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds the real one

    def require_finite(self, step: int, what: str) -> None:
        """LossNotFinite on every process when any process's shard of the trained weights is not finite."""
        local = {n: (p.to_local() if hasattr(p, "to_local") else p)
                 for n, p in self.model.named_parameters() if p.requires_grad}
        require_finite_everywhere(local, step, what, self.accelerator.device)

    def save(self, folder: Path) -> None:
        """Write the model and optimizer state into ``folder``; every process calls it together."""
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import get_state_dict

        main = self.accelerator.is_main_process
        model_state, optim_state = get_state_dict(self.model, self._torch_optimizer(), options=self._options(self.full))
        if self.full:
            if main:
                save_file({k: v.contiguous() for k, v in model_state.items()}, folder / "trainable.safetensors")
                torch.save(optim_state, folder / "optimizer.pt")
        else:
            tensors, rest = split_tensors(optim_state)
            dcp.save({"model": model_state, "optimizer": tensors},
                     storage_writer=dcp.FileSystemWriter(folder / SHARDED_DIR, sync_files=True))
            if main:
                torch.save(rest, folder / OPTIMIZER_GROUPS)
        if main:
            self._describe_model(folder)

    def _describe_model(self, folder: Path) -> None:
        settings = self.config.model_dump(mode="json", exclude=_PRIVATE)
        (folder / RUN_CONFIG).write_text(json.dumps(settings, indent=2))
        (folder / TRANSFORMER_CONFIG).write_text(json.dumps(transformer_config(self.model), indent=2))
        if self.config.model_type == "lora":
            self.model.peft_config[ADAPTER_NAME].save_pretrained(str(folder))

    def describe(self, folder: Path) -> dict:
        """What ``training_state.json`` records about the sharded state written into ``folder``: the layout, the
        world size, and every file's size."""
        return {"kind": self.kind, "state_dict_type": self.config.fsdp_state_dict_type,
                "world_size": self.accelerator.num_processes, "files": file_sizes(folder)}

    def load(self, folder: Path, parts: dict) -> None:
        """Restore the weights and the optimizer from ``folder`` (read and checked by ``read_parts``); every process
        calls it together."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        optimizer = self._torch_optimizer()
        if parts["state_dict_type"] == FULL:
            model_state, optim_state = parts["trainable"], parts["optimizer"]
            options = self._options(full=True, strict=False)
        else:
            model_state, optim_state = get_state_dict(self.model, optimizer, options=self._options())
            tensors, _ = split_tensors(optim_state)
            dcp.load({"model": model_state, "optimizer": tensors}, storage_reader=SafeReader(str(folder / SHARDED_DIR)))
            optim_state = merge_tensors(tensors, parts["optimizer_groups"])
            options = self._options(strict=False)
        result = set_state_dict(self.model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                                options=options)
        trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
        missing = sorted(trained & set(result.missing_keys))
        if missing or result.unexpected_keys:
            raise ValueError(f"{folder}: checkpoint does not match the model (missing {missing[:3]}, unexpected "
                             f"{list(result.unexpected_keys)[:3]})")

    def export(self, adapter, folder: Path) -> Path | None:
        """Gather the trained weights (every process calls it) and write them as a finished run does; the path on
        the main process, None on the others."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.model, options=self._options(full=True))
        return write_gathered(self, adapter, state, folder)


def require_finite_everywhere(local: dict[str, torch.Tensor], step: int, what: str, device) -> None:
    """``require_finite`` on this process's part of the weights, raised on every process when any part is not
    finite, so all of them stop together, before a collective save that would otherwise wait forever."""
    import torch.distributed as dist

    try:
        require_finite(local, step, what)
        error = None
    except LossNotFinite as exc:
        error = exc
    flag = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if flag.item():
        raise LossNotFinite(f"{what} at step {step}: another process's part of the weights is not finite; not "
                            "saved. Lower learning_rate or check the data, then Retry from the last checkpoint")


def file_sizes(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` (relative path -> size), as ``check_files`` verifies them."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def _block_names(model) -> set[str]:
    return {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Block")}


def transformer_config(model) -> dict:
    """The denoiser's diffusers config (its constructor arguments), JSON-ready."""
    return {k: v for k, v in dict(model.config).items() if not k.startswith("_")}


def split_tensors(tree: dict) -> tuple[dict, dict]:
    """A nested dict -> (the same dicts holding only its tensors, the same dicts holding everything else)."""
    tensors, rest = {}, {}
    for key, value in tree.items():
        if isinstance(value, dict):
            tensors[key], rest[key] = split_tensors(value)
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            rest[key] = value
    return tensors, rest


def merge_tensors(tensors: dict, rest: dict) -> dict:
    out = dict(rest)
    for key, value in tensors.items():
        out[key] = merge_tensors(value, rest.get(key, {})) if isinstance(value, dict) else value
    return out


# ---- reading a sharded checkpoint ------------------------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` pickle, allowed to build DCP's metadata classes and nothing else."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
                ("collections", "OrderedDict"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module: str, name: str):
        if (module == "torch.distributed.checkpoint.metadata" or (module, name) in self._ALLOWED
                or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(folder: Path):
    """DCP metadata of ``folder`` (never running pickled code); CheckpointDamaged naming the file otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(folder) / ".metadata"
    try:
        with path.open("rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path}: missing") from None
    except Exception as exc:  # cut short, corrupt, or a pickle asking for something else
        raise CheckpointDamaged(f"{path}: cannot be read safely ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointDamaged(f"{path}: not a checkpoint's metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_files(folder: Path, sharding: dict) -> None:
    """CheckpointDamaged naming the first file of the sharded state that is missing or not the size it was
    written with."""
    for name, size in sharding.get("files", {}).items():
        path = Path(folder) / name
        if not path.is_file():
            raise CheckpointDamaged(f"{path}: missing")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointDamaged(f"{path}: {actual} bytes, but {size} were written (cut short or damaged)")


def read_parts(folder: Path, sharding: dict, *, optimizer: bool = True) -> dict:
    """Check every file of a checkpoint's sharded state and read what is restored from it into memory (the sharded
    layout's tensors are read later, straight into the model's shards). CheckpointDamaged names a damaged file."""
    from safetensors.torch import load_file

    folder = Path(folder)
    check_files(folder, sharding)
    parts = {"kind": sharding.get("kind"), "state_dict_type": sharding.get("state_dict_type")}
    if parts["kind"] == DeepSpeedRun.kind:
        return parts  # DeepSpeed's engine reads its own files
    if parts["state_dict_type"] == FULL:
        try:
            parts["trainable"] = load_file(folder / "trainable.safetensors")
        except Exception as exc:  # safetensors' own error type: a bad header
            raise CheckpointDamaged(f"{folder / 'trainable.safetensors'}: damaged ({exc})") from None
        if optimizer:
            parts["optimizer"] = load_pt(folder / "optimizer.pt")
    else:
        read_metadata(folder / SHARDED_DIR)
        if optimizer:
            parts["optimizer_groups"] = load_pt(folder / OPTIMIZER_GROUPS)
    return parts


def read_full_weights(folder: Path, parts: dict) -> dict[str, torch.Tensor]:
    """The trained weights of a checkpoint whole, in this one process (no process group): what consolidation
    writes out."""
    if parts["state_dict_type"] == FULL:
        return parts["trainable"]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = SafeReader(str(Path(folder) / SHARDED_DIR))
    metadata = read_metadata(Path(folder) / SHARDED_DIR)
    weights = {key[len("model."):]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
               for key, md in metadata.state_dict_metadata.items()
               if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP warns that a load without a process group is a single-process load
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": weights}, storage_reader=reader, no_dist=True)
    return weights


# ---- the weights as users load them ----------------------------------------------------------------------------
def write_weights(adapter, config, state: dict[str, torch.Tensor], config_of_transformer: dict, lora_config,
                  folder: Path) -> Path:
    """Trained weights keyed as in the model that trained them -> what a finished run writes into ``folder``: the
    diffusers transformer folder ``transformer/`` (full) or the family's LoRA file. Built around an empty (meta)
    denoiser made from its config, so nothing but the trained weights is loaded."""
    from accelerate import init_empty_weights

    folder = Path(folder)
    with init_empty_weights(include_buffers=False):
        model = adapter.denoiser_class.from_config(config_of_transformer)
    if config.model_type == "lora":
        from peft.utils import get_peft_model_state_dict

        model.add_adapter(lora_config, adapter_name=ADAPTER_NAME)
        wanted = set(get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME))
        lora = get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER_NAME)
        missing = sorted(wanted - set(lora))
        if missing:
            raise ValueError(f"the trained LoRA lacks {len(missing)} of its weights, e.g. {missing[:3]}")
        return adapter.save_lora({k: v.detach().cpu().contiguous() for k, v in lora.items()}, folder)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"the trained weights do not match {type(model).__name__} (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    model.save_pretrained(folder / "transformer", safe_serialization=True)
    return folder / "transformer"


def write_gathered(run, adapter, state: dict[str, torch.Tensor], folder: Path) -> Path | None:
    """The main process writes the gathered trained weights of ``run``; the others return None."""
    if not run.accelerator.is_main_process:
        return None
    lora = run.model.peft_config[ADAPTER_NAME] if run.config.model_type == "lora" else None
    return write_weights(adapter, run.config, state, transformer_config(run.model), lora, folder)


# ---- DeepSpeed (CUDA only) -------------------------------------------------------------------------------------
class DeepSpeedRun:
    """A DeepSpeed ZeRO run: accelerate's DeepSpeed plugin prepares the model, and DeepSpeed's engine writes and
    reads its own checkpoint (every process its partition) inside ours."""

    kind = "deepspeed"
    folder = "deepspeed"
    tag = "state"

    def __init__(self, config, accelerator):
        self.config = config
        self.accelerator = accelerator
        self.model = None
        self.optimizer = None
        self.engine = None

    def shard(self, transformer):
        return transformer  # accelerate's DeepSpeed plugin partitions it in prepare

    def prepare(self, transformer, optimizer, lr_scheduler):
        transformer, optimizer, lr_scheduler = self.accelerator.prepare(transformer, optimizer, lr_scheduler)
        self.engine = transformer  # the DeepSpeedEngine
        self.model = self.accelerator.unwrap_model(transformer)
        self.optimizer = optimizer
        return transformer, optimizer, lr_scheduler

    def require_finite(self, step: int, what: str) -> None:
        # ZeRO-3 keeps each process's partition of a parameter in ``ds_tensor`` (``data`` is then empty)
        local = {n: getattr(p, "ds_tensor", p) for n, p in self.model.named_parameters() if p.requires_grad}
        require_finite_everywhere(local, step, what, self.accelerator.device)

    def save(self, folder: Path) -> None:
        self.engine.save_checkpoint(str(folder / self.folder), tag=self.tag)
        if self.accelerator.is_main_process:
            (folder / RUN_CONFIG).write_text(json.dumps(self.config.model_dump(mode="json", exclude=_PRIVATE), indent=2))

    def describe(self, folder: Path) -> dict:
        return {"kind": self.kind, "world_size": self.accelerator.num_processes, "files": file_sizes(folder)}

    def load(self, folder: Path, parts: dict) -> None:
        self.engine.load_checkpoint(str(folder / self.folder), tag=self.tag, load_optimizer_states=True,
                                    load_lr_scheduler_states=False)

    def export(self, adapter, folder: Path) -> Path | None:
        state = self.accelerator.get_state_dict(self.engine)  # ZeRO-3 gathers its partitions
        trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return write_gathered(self, adapter, {k: v for k, v in state.items() if k in trained}, folder)
