"""What each option needs besides the core install: a package (and the extra that installs it) or a device.

``simpletuner validate`` and ``simpletuner train`` call :func:`missing_packages` before anything is loaded or
cached, so a run never fails half-way on an import; the trainer calls :func:`device_errors` once it knows its
device, also before caching. Packages are looked up with ``importlib.util.find_spec`` (nothing is imported here).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import FieldError


@dataclass(frozen=True)
class Package:
    module: str  # what is imported
    pip: str  # the distribution that provides it
    extra: str | None  # ``pip install 'simpletuner[<extra>]'`` installs it; None = a core dependency

    def hint(self) -> str:
        if self.extra:
            return f"pip install 'simpletuner[{self.extra}]' (or pip install {self.pip})"
        return f"pip install {self.pip} (a core dependency: reinstall simpletuner)"


OPTIMI = Package("optimi", "torch-optimi", "optimizers")
PRODIGY = Package("prodigyopt", "prodigyopt", "optimizers")
SCHEDULEFREE = Package("schedulefree", "schedulefree", "optimizers")
PYTORCH_OPTIMIZER = Package("pytorch_optimizer", "pytorch-optimizer", "optimizers")
BITSANDBYTES = Package("bitsandbytes", "bitsandbytes", "bnb")
LYCORIS = Package("lycoris", "lycoris-lora", "lycoris")
TORCHAO = Package("torchao", "torchao", "torchao")
QUANTO = Package("optimum.quanto", "optimum-quanto", None)
WANDB = Package("wandb", "wandb", None)
TENSORBOARD = Package("tensorboard", "tensorboard", "tracking")
DEEPSPEED = Package("deepspeed", "deepspeed", "deepspeed")

# ``optimizer`` choices, with SimpleTuner's names, and the package each needs (None: torch itself / this package).
# bitsandbytes' optimizers run on CUDA only here (see device_errors).
OPTIMIZER_PACKAGES: Mapping[str, Package | None] = {
    "adamw": None,
    "adamw_bf16": None,
    "optimi-adamw": OPTIMI,
    "optimi-stableadamw": OPTIMI,
    "optimi-lion": OPTIMI,
    "prodigy": PRODIGY,
    "adamw_schedulefree": SCHEDULEFREE,
    "ademamix": PYTORCH_OPTIMIZER,
    "bnb-adamw": BITSANDBYTES,
    "bnb-adamw8bit": BITSANDBYTES,
    "bnb-adamw-paged": BITSANDBYTES,
    "bnb-adamw8bit-paged": BITSANDBYTES,
    "bnb-lion": BITSANDBYTES,
    "bnb-lion8bit": BITSANDBYTES,
    "bnb-lion-paged": BITSANDBYTES,
    "bnb-lion8bit-paged": BITSANDBYTES,
    "bnb-ademamix": BITSANDBYTES,
    "bnb-ademamix8bit": BITSANDBYTES,
    "bnb-ademamix-paged": BITSANDBYTES,
    "bnb-ademamix8bit-paged": BITSANDBYTES,
}
OPTIMIZERS: tuple[str, ...] = tuple(OPTIMIZER_PACKAGES)

QUANTO_PRECISIONS = ("int8-quanto", "int4-quanto", "int2-quanto", "fp8-quanto")
TORCHAO_PRECISIONS = ("int8-torchao", "fp8-torchao")
BNB_PRECISIONS = ("nf4-bnb",)
PRECISIONS: tuple[str, ...] = ("no_change", *QUANTO_PRECISIONS, *TORCHAO_PRECISIONS, *BNB_PRECISIONS)
_PRECISION_FIELDS = ("base_model_precision", "text_encoder_1_precision", "text_encoder_2_precision",
                     "text_encoder_3_precision")


def _precision_package(precision: str) -> Package | None:
    if precision in QUANTO_PRECISIONS:
        return QUANTO
    if precision in TORCHAO_PRECISIONS:
        return TORCHAO
    if precision in BNB_PRECISIONS:
        return BITSANDBYTES
    return None


def needed_packages(values: Mapping[str, Any]) -> list[tuple[str, Package]]:
    """(field, package) for every package the settings in ``values`` (TrainConfig fields) need."""
    needs: list[tuple[str, Package]] = []
    optimizer = OPTIMIZER_PACKAGES.get(str(values.get("optimizer")))
    if optimizer is not None:
        needs.append(("optimizer", optimizer))
    if values.get("model_type", "lora") == "lora" and values.get("lora_type") == "lycoris":
        needs.append(("lora_type", LYCORIS))
    if values.get("model_type", "lora") == "lora" and values.get("lora_init_type") == "loftq":
        needs.append(("lora_init_type", BITSANDBYTES))  # peft's LoftQ quantizes with bitsandbytes
    for name in _PRECISION_FIELDS:
        package = _precision_package(str(values.get(name) or "no_change"))
        if package is not None:
            needs.append((name, package))
    if values.get("deepspeed_config") is not None:
        needs.append(("deepspeed_config", DEEPSPEED))
    report_to = values.get("report_to")
    if report_to in ("wandb", "all"):
        needs.append(("report_to", WANDB))
    if report_to in ("tensorboard", "all"):
        needs.append(("report_to", TENSORBOARD))
    return needs


def is_installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_packages(values: Mapping[str, Any]) -> list[FieldError]:
    """An error per setting whose package is not installed, naming the extra that installs it."""
    errors = []
    for field, package in needed_packages(values):
        if not is_installed(package.module):
            errors.append(FieldError(field, f"{values.get(field)!r} needs the {package.pip} package, which is not "
                                            f"installed: {package.hint()}"))
    return errors


def device_errors(values: Mapping[str, Any], device_type: str) -> list[FieldError]:
    """Settings that cannot run on a device of type ``device_type`` ("cpu", "cuda", "mps", ...)."""
    errors = []
    optimizer = str(values.get("optimizer"))
    if OPTIMIZER_PACKAGES.get(optimizer) is BITSANDBYTES and device_type != "cuda":
        errors.append(FieldError("optimizer", f"{optimizer!r} uses bitsandbytes' CUDA kernels and this run is on "
                                              f"{device_type}; use 'adamw', 'optimi-adamw', 'optimi-lion' or "
                                              "'ademamix' here"))
    for name in _PRECISION_FIELDS:
        precision = values.get(name)
        if precision in BNB_PRECISIONS and device_type != "cuda":
            errors.append(FieldError(name, f"{precision!r} quantizes with bitsandbytes on a CUDA GPU and this run is "
                                           f"on {device_type}; use 'int4-quanto' or 'int8-torchao' here"))
        if precision == "fp8-quanto" and device_type == "mps":
            errors.append(FieldError(name, "'fp8-quanto' needs float8 support, which the mps device lacks; "
                                           "use 'int8-quanto'"))
    if values.get("model_type", "lora") == "lora" and values.get("lora_init_type") == "loftq" and device_type != "cuda":
        errors.append(FieldError("lora_init_type", f"'loftq' quantizes the base with bitsandbytes on a CUDA GPU and "
                                                   f"this run is on {device_type}; use 'default' here"))
    if values.get("deepspeed_config") is not None and device_type != "cuda":
        errors.append(FieldError("deepspeed_config", f"DeepSpeed ZeRO runs on CUDA GPUs and this run is on "
                                                     f"{device_type}; remove it (fsdp_enable shards on any device)"))
    if values.get("fsdp_enable") and device_type == "cpu" and values.get("mixed_precision", "no") != "no":
        errors.append(FieldError("mixed_precision", f"{values.get('mixed_precision')!r} with fsdp_enable on the CPU: "
                                                    "a sharded CPU run trains in fp32 here; set mixed_precision "
                                                    "'no'"))
    if values.get("enable_model_cpu_offload") and device_type == "cpu":
        errors.append(FieldError("enable_model_cpu_offload", "the run is on the CPU, so there is no accelerator "
                                                             "memory to offload the VAE and text encoders from; "
                                                             "remove it"))
    return errors
