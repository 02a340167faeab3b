"""Weight-only quantization of frozen base models: optimum-quanto (``*-quanto``), torchao (``int8-torchao``,
``fp8-torchao``) and bitsandbytes NF4 (``nf4-bnb``, CUDA only).

LoRA training on a quantized base: the base's linear weights are quantized (int8/int4/int2/fp8) and frozen, the
LoRA adapters added on top stay in full precision and are the only trainable parameters. A LoRA trained this way
is a plain PEFT/diffusers LoRA file: it loads onto the unquantized base (see tests/training/test_quantize.py).

Order in the trainer: load the base in `base_model_default_dtype` -> `quantize_model` -> add LoRA -> offload/TREAD.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # torch stays out of import time for the CLI / server
    import torch

logger = logging.getLogger(__name__)

# SimpleTuner's `*_precision` vocabulary -> optimum-quanto weight qtype names.
QUANTO_PRECISIONS: dict[str, str] = {
    "int8-quanto": "qint8",
    "int4-quanto": "qint4",
    "int2-quanto": "qint2",
    "fp8-quanto": "qfloat8",
}
TORCHAO_PRECISIONS = ("int8-torchao", "fp8-torchao")
BNB_PRECISIONS = ("nf4-bnb",)
PRECISIONS: tuple[str, ...] = ("no_change", *QUANTO_PRECISIONS, *TORCHAO_PRECISIONS, *BNB_PRECISIONS)

# Layers kept in full precision by default. They are small (a few MB in a 12B Flux) but sit where rounding error
# hurts most: the patch/text/time embedders that every token passes through first, and the final adaptive norm and
# output projection that produce the prediction itself. Names are the ones diffusers' DiTs share (Flux, SD3,
# AuraFlow, PixArt); patterns are matched against full module names with fnmatch, so `proj_out` is the top-level
# output projection only, not `single_transformer_blocks.N.proj_out` (which is quantized).
DEFAULT_EXCLUDE: tuple[str, ...] = (
    "proj_out",
    "norm_out",
    "norm_out.*",
    "x_embedder",
    "context_embedder",
    "time_text_embed",
    "time_text_embed.*",
    "pos_embed",
    "pos_embed.*",
)


def _qtype(precision: str):
    from optimum.quanto import qfloat8, qint2, qint4, qint8

    return {"qint8": qint8, "qint4": qint4, "qint2": qint2, "qfloat8": qfloat8}[QUANTO_PRECISIONS[precision]]


def check_quantization_supported(precision: str, device_type: str, *, field: str = "base_model_precision") -> None:
    """Raise ValueError when `precision` cannot run on a device of type `device_type` ("cpu", "cuda", "mps", ...).

    fp8 weights need a float8 dtype on the device: CPU and CUDA have one (quanto dequantizes where no fp8 kernel
    exists), Apple's MPS backend has none.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"{field}: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "no_change":
        return
    if precision in BNB_PRECISIONS and device_type != "cuda":
        raise ValueError(f"{field}: {precision!r} quantizes with bitsandbytes on a CUDA GPU and this run is on "
                         f"{device_type}; use 'int4-quanto' or 'int8-torchao' here")
    if precision == "fp8-quanto" and device_type == "mps":
        raise ValueError(f"{field}: fp8-quanto needs float8 support, which the mps device lacks; use int8-quanto")
    if device_type not in ("cpu", "cuda", "mps", "xpu"):
        raise ValueError(f"{field}: {precision} is not supported on device type {device_type!r}")


def check_quantized_training(
    precision: str,
    *,
    model_type: str = "lora",
    init_lora_weights: str | bool | None = None,
    field: str = "base_model_precision",
) -> None:
    """Raise ValueError for training setups that cannot work on a quanto-quantized base."""
    if precision == "no_change":
        return
    if model_type == "full":
        raise ValueError(
            f"{field}: {precision} freezes the base weights, so model_type=full has nothing to train; "
            f"use model_type=lora or {field}=no_change"
        )
    if isinstance(init_lora_weights, str) and init_lora_weights.lower() == "loftq":
        raise ValueError(
            f"init_lora_weights: loftq initialises from bitsandbytes quantization error, not quanto's; "
            f"use the default init with {field}={precision}"
        )


def quantize_model(
    module: "torch.nn.Module",
    precision: str,
    *,
    exclude: Iterable[str] | None = None,
    device: "torch.device | str | None" = None,
    field: str = "base_model_precision",
) -> "torch.nn.Module":
    """Quantize the weights of `module`'s linear layers to `precision` and freeze them, in place; return `module`.

    `precision` is one of PRECISIONS ("no_change" returns the module untouched). `exclude` lists fnmatch patterns of
    module names kept in full precision (default DEFAULT_EXCLUDE; pass [] to quantize everything). With `device`
    (`quantize_via=accelerator`) the module is moved there first, which is much faster on a GPU; the module stays
    on that device. All parameters of the module end up with requires_grad=False.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"{field}: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "no_change":
        return module

    if device is not None:
        check_quantization_supported(precision, _device_type(device), field=field)
        module.to(device)
    else:
        first = next(iter(module.parameters()), None)
        device = first.device if first is not None else "cpu"
        check_quantization_supported(precision, _device_type(device), field=field)
    patterns = list(DEFAULT_EXCLUDE if exclude is None else exclude)
    if precision in TORCHAO_PRECISIONS:
        _quantize_torchao(module, precision, patterns)
    elif precision in BNB_PRECISIONS:
        _quantize_nf4(module, patterns, device)
    else:
        from optimum.quanto import freeze, quantize

        use_quantos_torch_unpack_on_cpu()
        quantize(module, weights=_qtype(precision), exclude=patterns or None)
        freeze(module)
    module.requires_grad_(False)
    logger.info("%s: quantized %d linear layers to %s (%d kept full precision)", field,
                count_quantized(module), precision, _count_linear(module) - count_quantized(module))
    return module


def use_quantos_torch_unpack_on_cpu() -> None:
    """Unpack int4 / int2 quanto weights on the CPU with torch ops instead of quanto's C++ extension.

    quanto's CPU kernel for ``quanto::unpack`` is a C++ extension that it compiles (``torch.utils.cpp_extension``)
    the first time a packed weight is read: it needs a C++ toolchain, and compiling against torch's headers takes
    minutes on a small machine (more than 15 on two busy cores), inside the run's first step. Unpacking is a shift
    and a mask per value in a byte, which torch does directly. CUDA and MPS keep quanto's kernels. Idempotent.
    """
    import types

    from optimum.quanto.library.extensions import get_extension, is_extension_available

    if is_extension_available("quanto_cpp"):
        extension = get_extension("quanto_cpp")
        if extension._lib is None:  # not built or loaded yet: its one entry point, without compiling
            extension._lib = types.SimpleNamespace(unpack=unpack_bits)


def unpack_bits(packed: "torch.Tensor", bits: int) -> "torch.Tensor":
    """quanto's packed layout: byte j of ``packed`` holds rows j, j + n, j + 2n, ... (n = len(packed)) of the
    unpacked tensor, ``bits`` each, lowest first; returns the (8 / bits) * n rows as uint8."""
    import torch

    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * i)) & mask for i in range(8 // bits)]).to(torch.uint8)


def selected_linears(module, exclude: Iterable[str]) -> list[str]:
    """Names of the ``nn.Linear`` submodules a quantizer converts: all but those matching ``exclude``."""
    import fnmatch

    import torch

    patterns = list(exclude)
    return [name for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and not any(fnmatch.fnmatch(name, p) for p in patterns)]


def _quantize_torchao(module, precision: str, exclude: list[str]) -> None:
    """torchao weight-only int8 / float8 on the selected linears (LoRA trains on top through peft)."""
    try:
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise ImportError(f"{precision} needs the torchao package: pip install 'simpletuner[torchao]'") from None
    chosen = set(selected_linears(module, exclude))
    config = Int8WeightOnlyConfig() if precision == "int8-torchao" else Float8WeightOnlyConfig()
    quantize_(module, config, filter_fn=lambda m, name: name in chosen)


def _quantize_nf4(module, exclude: list[str], device) -> None:
    """bitsandbytes NF4: each selected linear becomes a ``Linear4bit`` whose weight is quantized when it moves to
    the CUDA device (bitsandbytes quantizes on the GPU)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ImportError("nf4-bnb needs the bitsandbytes package: pip install 'simpletuner[bnb]'") from None
    import torch

    for name in selected_linears(module, exclude):
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        linear = getattr(parent, child)
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=linear.weight.dtype if linear.weight.dtype != torch.float32 else
                              torch.bfloat16, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(linear.weight.data.to("cpu"), requires_grad=False, quant_type="nf4")
        if linear.bias is not None:
            q.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
        setattr(parent, child, q.to(device))


def _device_type(device) -> str:
    return device.split(":")[0] if isinstance(device, str) else device.type


def count_quantized(module: "torch.nn.Module") -> int:
    """Number of quantized submodules in `module` (quanto modules, torchao-quantized or NF4 linears)."""
    from optimum.quanto.nn import QModuleMixin

    def quantized(m) -> bool:
        weight = getattr(m, "weight", None)
        return isinstance(m, QModuleMixin) or (weight is not None and (
            type(weight).__module__.startswith(("torchao", "bitsandbytes"))))

    return sum(quantized(m) for m in module.modules())


def _count_linear(module) -> int:
    import torch

    return sum(isinstance(m, torch.nn.Linear) for m in module.modules())


def _leaf_tensors(t: "torch.Tensor"):
    """Yield the plain tensors that hold `t`'s storage (quanto weights nest: QTensor -> PackedTensor -> uint8)."""
    import torch

    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        yield from _leaf_tensors(getattr(t, name))


def weight_bytes(module: "torch.nn.Module") -> int:
    """Bytes held by `module`'s parameters and buffers as stored: quantized data, scales and shifts included.

    Packed int4/int2 weights count at their packed size; tensors shared between modules count once.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    tensors = [p for p in module.parameters()] + [b for b in module.buffers()]
    for tensor in tensors:
        for leaf in _leaf_tensors(tensor):
            key = (leaf.data_ptr(), leaf.numel())
            if leaf.device.type != "meta" and key in seen:
                continue
            seen.add(key)
            total += leaf.numel() * leaf.element_size()
    return total
