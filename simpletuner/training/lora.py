"""PEFT LoRA on the transformer: attach, export in diffusers format, and start from an existing LoRA."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

ADAPTER_NAME = "default"


@contextmanager
def seeded_initial_weights(seed: int | None):
    """Draw an adapter's random initial weights (LoRA's A, LyCORIS') from ``seed`` alone.

    The global generator is seeded at the start of a run, but imports and model loaders draw from it before the
    adapter is attached, and only the first time in a process: without this a run's LoRA started from other weights
    than the same config trained again in the same process (in a test, a notebook). The global state is restored
    afterwards, so the run's own draws do not shift either. ``None`` (no seed asked for): unchanged.
    """
    if seed is None:
        yield
        return
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield


def add_lora(transformer, adapter, config) -> LoraConfig:
    """Freeze the transformer and attach a trainable LoRA on the modules of the family's ``lora_target`` preset."""
    transformer.requires_grad_(False)
    preset = config.lora_target  # the config layer fills the family's default and checks it against the family
    init = {"default": True, "gaussian": "gaussian", "loftq": "loftq", "olora": "olora", "pissa": "pissa"}[
        config.lora_init_type or "default"
    ]
    extra = {}
    if init == "loftq":
        from peft import LoftQConfig

        # LoftQ starts the LoRA from the 4-bit (NF4) quantization error of each weight, one alternating step
        extra["loftq_config"] = LoftQConfig(loftq_bits=4, loftq_iter=1)
    lora_config = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha if config.lora_alpha is not None else config.lora_rank,
        lora_dropout=config.lora_dropout,
        init_lora_weights=init,
        target_modules=adapter.lora_target_modules(transformer, preset),
        **extra,
    )
    transformer.add_adapter(lora_config, adapter_name=ADAPTER_NAME)
    if config.init_lora:
        load_initial_lora(transformer, config.init_lora)
    return lora_config


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    """The LoRA weights with PEFT's key names (``...lora_A.weight``), detached copies on the CPU."""
    state = get_peft_model_state_dict(transformer, adapter_name=ADAPTER_NAME)
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def load_lora_state(transformer, state: dict[str, torch.Tensor], source: str) -> None:
    """Load LoRA weights saved by ``lora_state_dict``; any mismatch is an error naming the file."""
    result = set_peft_model_state_dict(transformer, state, adapter_name=ADAPTER_NAME)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(f"{source}: {len(unexpected)} LoRA keys do not match this model, e.g. {unexpected[:3]}")
    lora_params = {n for n, _ in transformer.named_parameters() if "lora_" in n}
    missing = [k for k in (getattr(result, "missing_keys", []) or []) if k in lora_params]
    if missing:
        raise ValueError(f"{source}: missing LoRA weights for {len(missing)} modules, e.g. {missing[:3]}")


# key prefixes of the LoRA files families write: diffusers' (``transformer.``, ``unet.``), a PEFT adapter's (PixArt)
_LORA_KEY_PREFIXES = ("transformer.", "unet.", "base_model.model.")


def load_initial_lora(transformer, path: str | Path) -> None:
    """``init_lora``: start from a LoRA file a family's ``save_lora`` writes (diffusers' ``transformer.``-prefixed
    keys, or a PEFT adapter's ``adapter_model.safetensors``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"init_lora: {path} does not exist")
    try:
        loaded = load_file(path)  # safetensors only: a LoRA file is never unpickled
    except Exception as exc:  # safetensors' own error type for a pickle, a truncated file, a bad header
        raise ValueError(f"init_lora: {path} is not a readable .safetensors file ({exc})") from None
    state = {}
    for key, value in loaded.items():
        prefix = next((p for p in _LORA_KEY_PREFIXES if key.startswith(p)), "")
        state[key[len(prefix):]] = value
    load_lora_state(transformer, state, f"init_lora {path}")


# ---- LyCORIS (lora_type: lycoris) ------------------------------------------------------------------------------
# lycoris' network class keeps its module targets in class attributes; they are set for one build and put back
_PRESET_ATTRS = ("ENABLE_CONV", "TARGET_REPLACE_MODULE", "TARGET_REPLACE_NAME", "MODULE_ALGO_MAP", "NAME_ALGO_MAP",
                 "LORA_PREFIX", "USE_FNMATCH", "TARGET_EXCLUDE_NAME")
LYCORIS_WEIGHTS = "pytorch_lora_weights.safetensors"


def lycoris_preset(adapter, preset) -> dict:
    """``lycoris_config.apply_preset`` as lycoris' ``apply_preset`` takes it: a preset name (the family's own
    presets first, then lycoris' built-in ones) or a dict whose module class names may use the generic spellings
    SimpleTuner's examples use (``Attention``, ``FeedForward``), mapped to the family's classes."""
    from lycoris.config import PRESET

    family_presets = adapter.lycoris_presets()
    if preset is None:
        preset = adapter.default_lycoris_preset
    if isinstance(preset, str):
        if preset in family_presets:
            return dict(family_presets[preset])
        if preset in PRESET:
            builtin = PRESET[preset]
            return {"enable_conv": builtin.get("enable_conv", False),
                    "target_module": list(builtin.get("unet_target_module", [])),
                    "target_name": list(builtin.get("unet_target_name", []))}
        raise ValueError(f"lycoris_config.apply_preset: {preset!r} is not a preset; one of "
                         f"{', '.join([*family_presets, *PRESET])}")
    out = dict(preset)
    aliases = adapter.lycoris_module_aliases()
    if "target_module" in out:
        out["target_module"] = [aliases.get(m, m) for m in out["target_module"]]
    if "module_algo_map" in out:
        out["module_algo_map"] = {aliases.get(k, k): v for k, v in out["module_algo_map"].items()}
    return out


def add_lycoris(transformer, adapter, config):
    """Freeze the transformer and attach the LyCORIS network of ``lycoris_config``; returns the network (whose
    parameters are the trainable ones)."""
    from lycoris import LycorisNetwork, create_lycoris

    transformer.requires_grad_(False)
    settings = config.lycoris_config.model_dump()
    preset = lycoris_preset(adapter, settings.pop("apply_preset", None))
    algo = settings.pop("algo")
    saved = {name: getattr(LycorisNetwork, name) for name in _PRESET_ATTRS}
    try:
        LycorisNetwork.apply_preset(preset)
        network = create_lycoris(transformer, settings.pop("multiplier"), settings.pop("linear_dim"),
                                 settings.pop("linear_alpha"), algo=algo, warn_on_unmatched=False, **settings)
    finally:
        for name, value in saved.items():
            setattr(LycorisNetwork, name, value)
    if not network.loras:
        raise ValueError(f"lycoris_config.apply_preset: matched no module of the {adapter.family} transformer "
                         f"({preset})")
    network.apply_to()
    network.requires_grad_(True)
    transformer._lycoris_network = network  # found again by lycoris_network(); the transformer owns it
    return network


def lycoris_network(model):
    """The LyCORIS network attached to ``model`` by ``add_lycoris`` (None when there is none)."""
    return getattr(model, "_lycoris_network", None)


def lycoris_state_dict(network) -> dict[str, torch.Tensor]:
    """The network's weights with lycoris' key names (``lycoris_<module path>.lokr_w1``), detached CPU copies."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in network.state_dict().items()}


def lycoris_trainable_state(network) -> dict[str, torch.Tensor]:
    """The network's parameters as they are (checkpoints): lycoris' own state dict stores some algorithms as a
    difference from the base weight (``full``), which does not round-trip bit for bit."""
    return {n: p.detach().to("cpu").contiguous().clone() for n, p in network.named_parameters()}


def load_lycoris_trainable(network, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``lycoris_trainable_state`` weights; any mismatch is an error naming the file."""
    params = dict(network.named_parameters())
    missing, unexpected = sorted(params.keys() - state.keys()), sorted(state.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"{source}: the LyCORIS weights do not match this network (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}); was lycoris_config changed?")
    with torch.no_grad():
        for name, param in params.items():
            if state[name].shape != param.shape:
                raise ValueError(f"{source}: {name} has shape {tuple(state[name].shape)}, the network "
                                 f"{tuple(param.shape)}; was lycoris_config changed?")
            param.copy_(state[name])


def save_lycoris(network, output_dir, state: dict[str, torch.Tensor] | None = None, name: str = LYCORIS_WEIGHTS):
    """Write the network as lycoris does (``lycoris_<module path>.<weight>`` keys in safetensors, the format
    ComfyUI's LoRA loader maps onto Flux and lycoris' ``create_lycoris_from_weights`` reads), atomically."""
    import os

    from safetensors.torch import save_file

    path = Path(output_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(state if state is not None else lycoris_state_dict(network), tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
    return path
