"""Starting points for a new config: the tiny CPU demo, Flux LoRA by GPU memory (24 / 16 / 12 GB), and one LoRA
preset per family in the family table (a family added to the table gets one without touching this file).

A preset is a SimpleTuner ``config.json`` (``train_config``) plus a ``multidatabackend.json`` (``data_backends``)
whose image dataset's folder the user fills in (``DATASET_PLACEHOLDER``, or the dataset chosen in the web UI).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .families import FAMILIES, tiny_flavours

DATASET_PLACEHOLDER = "datasets/my-images"


@dataclass(frozen=True)
class Preset:
    id: str
    label: str
    description: str
    train_config: dict[str, Any]
    dataset: dict[str, Any] = field(default_factory=dict)  # keys of the image dataset beyond the folder

    def data_backends(self, folder: str = DATASET_PLACEHOLDER, dataset_id: str = "my-images") -> list[dict]:
        """The preset's multidatabackend.json with ``folder`` as its image dataset."""
        family = self.train_config["model_family"]
        return [
            {"id": dataset_id, "type": "local", "instance_data_dir": folder, **self.dataset,
             "cache_dir_vae": f"cache/vae/{family}/{dataset_id}"},
            {"id": "text-embeds", "dataset_type": "text_embeds", "type": "local", "default": True,
             "cache_dir": f"cache/text/{family}"},
        ]

    def to_dict(self, folder: str = DATASET_PLACEHOLDER, dataset_id: str = "my-images") -> dict[str, Any]:
        return {"id": self.id, "label": self.label, "description": self.description,
                "train_config": dict(self.train_config), "data_backends": self.data_backends(folder, dataset_id)}


_LORA = {"model_type": "lora", "lora_rank": 16, "learning_rate": 1e-4, "lr_scheduler": "constant_with_warmup",
         "lr_warmup_steps": 100, "max_train_steps": 2000, "checkpointing_steps": 250, "checkpoints_total_limit": 5,
         "resume_from_checkpoint": "latest", "train_batch_size": 1, "optimizer": "adamw", "seed": 42,
         "gradient_checkpointing": True, "mixed_precision": "bf16", "validation_steps": 250,
         "validation_prompt": "a photo of a cat", "validation_num_inference_steps": 20, "report_to": "none"}

_FLUX_GPU = {**_LORA, "model_family": "flux", "model_flavour": "krea", "base_model_default_dtype": "bf16"}

TINY = Preset(
    id="tiny-cpu-demo",
    label="Tiny CPU demo (Flux, random weights)",
    description="A small random Flux on the CPU: trains a LoRA on your images in about a minute, to try the whole "
                "flow (upload, train, validate, download). Its pictures are noise: it is not a real model.",
    train_config={"model_family": "flux", "model_flavour": "tiny", "model_type": "lora", "lora_rank": 8,
                  "lora_alpha": 8, "learning_rate": 3e-3, "lr_scheduler": "constant_with_warmup",
                  "lr_warmup_steps": 2, "max_train_steps": 30, "checkpointing_steps": 10,
                  "checkpoints_total_limit": 3, "resume_from_checkpoint": "latest", "train_batch_size": 1,
                  "mixed_precision": "no", "seed": 42, "flow_schedule_shift": 1.0, "resolution": 64,
                  "resolution_type": "pixel", "validation_steps": 10, "validation_prompt": "a photo",
                  "validation_num_inference_steps": 2, "validation_resolution": "64", "validation_seed": 1,
                  "report_to": "none"},
    dataset={"resolution": 64, "resolution_type": "pixel", "repeats": 0},
)

FLUX_BY_MEMORY = (
    Preset(
        id="flux-lora-24gb",
        label="Flux LoRA, 24 GB GPU",
        description="FLUX.1 Krea [dev] LoRA at 1024 px: the transformer and text encoders quantized to int8 "
                    "(quanto), gradient checkpointing. Fits a 24 GB card (RTX 3090 / 4090).",
        train_config={**_FLUX_GPU, "resolution": 1024, "base_model_precision": "int8-quanto",
                      "text_encoder_1_precision": "int8-quanto", "text_encoder_2_precision": "int8-quanto",
                      "validation_resolution": "1024"},
        dataset={"resolution": 1024, "resolution_type": "pixel_area", "crop": False, "repeats": 0},
    ),
    Preset(
        id="flux-lora-16gb",
        label="Flux LoRA, 16 GB GPU",
        description="FLUX.1 Krea [dev] LoRA at 512 px: int8 transformer and text encoders, quantized on the CPU "
                    "(the bf16 weights never sit on the GPU), gradient checkpointing, the VAE and text encoders "
                    "kept off the GPU while the transformer trains.",
        train_config={**_FLUX_GPU, "resolution": 512, "base_model_precision": "int8-quanto",
                      "text_encoder_1_precision": "int8-quanto", "text_encoder_2_precision": "int8-quanto",
                      "quantize_via": "cpu", "offload_during_startup": True, "enable_model_cpu_offload": True,
                      "validation_resolution": "512"},
        dataset={"resolution": 512, "resolution_type": "pixel_area", "crop": False, "repeats": 0},
    ),
    Preset(
        id="flux-lora-12gb",
        label="Flux LoRA, 12 GB GPU",
        description="FLUX.1 Krea [dev] LoRA at 512 px: int4 transformer, int8 text encoders, quantized on the CPU, "
                    "rank 8, gradient checkpointing, the VAE and text encoders off the GPU while training. Slower "
                    "than int8; fits a 12 GB card (RTX 3060 / 4070).",
        train_config={**_FLUX_GPU, "resolution": 512, "lora_rank": 8, "base_model_precision": "int4-quanto",
                      "text_encoder_1_precision": "int8-quanto", "text_encoder_2_precision": "int8-quanto",
                      "quantize_via": "cpu", "offload_during_startup": True, "enable_model_cpu_offload": True,
                      "validation_resolution": "512"},
        dataset={"resolution": 512, "resolution_type": "pixel_area", "crop": False, "repeats": 0},
    ),
)


def family_preset(name: str) -> Preset:
    """A LoRA preset for the family ``name`` of the table: its default flavour and LoRA target, bf16, 1024 px."""
    family = FAMILIES[name]
    video = family.modality == "video"
    resolution = 480 if video else 1024
    config = {**_LORA, "model_family": name, "model_flavour": family.default_flavour, "resolution": resolution,
              "validation_resolution": str(resolution)}
    if video:
        config.update(train_batch_size=1, validation_num_inference_steps=30)
    if family.guidance_embeds:
        config["guidance_value"] = family.default_guidance_value
    return Preset(
        id=f"{name}-lora",
        label=f"{name} LoRA ({family.default_flavour})",
        description=f"{family.description}: a LoRA on its default flavour, {family.default_flavour}, at "
                    f"{resolution} px with gradient checkpointing, bf16. Pick a quantization under Memory for a "
                    "smaller GPU.",
        train_config=config,
        dataset={"resolution": resolution, "resolution_type": "pixel_area", "repeats": 0,
                 **({"dataset_type": "video"} if video else {})},
    )


def presets() -> list[Preset]:
    """Every preset: the tiny demo, Flux by memory, then one per family (in the table's name order)."""
    families = [family_preset(name) for name in sorted(FAMILIES) if tiny_flavours(FAMILIES[name])]
    return [TINY, *FLUX_BY_MEMORY, *families]


def get_preset(preset_id: str) -> Preset | None:
    return next((p for p in presets() if p.id == preset_id), None)
