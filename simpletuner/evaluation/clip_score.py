"""CLIP score: how well an image matches its prompt, as 100 x the cosine similarity of their CLIP embeddings.

The usual CLIP-score convention (Hessel et al. 2021, as torchmetrics reports it): ``max(100 * cos(image, text), 0)``.
Higher is better; with CLIP ViT-L/14 good text-to-image samples typically score in the 25-35 range.

``pretrained_evaluation_model_name_or_path`` names the CLIP model (a hub id or a local folder in the
``CLIPModel`` / ``CLIPProcessor`` layout). ``"tiny"`` (and the default, when the model flavour is ``tiny``)
means a random-initialised tiny CLIP written on first use under the tiny-checkpoint folder, so tests and the
demo never download anything.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from simpletuner.models import tiny

log = logging.getLogger("simpletuner.evaluation")

TINY_CLIP = "tiny"
# bump when the tiny CLIP's architecture or init changes
TINY_CLIP_FORMAT = 1


def default_clip_model() -> str:
    from simpletuner.config.train import TrainConfig

    return TrainConfig.model_fields["pretrained_evaluation_model_name_or_path"].default


def clip_model_path(config) -> str:
    """Where the CLIP model for ``evaluation_type: clip`` comes from (the tiny one for tiny runs)."""
    name = config.pretrained_evaluation_model_name_or_path or default_clip_model()
    if name == TINY_CLIP or (config.model_flavour == "tiny" and name == default_clip_model()):
        return str(ensure_tiny_clip())
    return name


def write_tiny_clip(folder: Path, seed: int = 0) -> None:
    """A random-initialised CLIPModel (text + vision) with an offline tokenizer and image processor."""
    from transformers import CLIPImageProcessor, CLIPProcessor

    tokenizer = tiny.clip_tokenizer(77)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
        torch.manual_seed(seed)
        model = _tiny_clip_model(tokenizer)
    with torch.no_grad():
        # a shared offset in both embedding spaces, so random weights give scores in (0, 100) rather than
        # half of them clamped to 0; the image- and prompt-dependent part still varies
        model.visual_projection.weight.copy_(model.text_projection.weight)
        model.text_model.final_layer_norm.bias.fill_(1.0)
        model.vision_model.post_layernorm.bias.fill_(1.0)
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
    )
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)


def _tiny_clip_model(tokenizer):
    from transformers import CLIPConfig, CLIPModel

    return CLIPModel(CLIPConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 77, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "image_size": 32, "patch_size": 8,
        },
        projection_dim=32,
    ))


def ensure_tiny_clip() -> Path:
    """``tiny_root()/clip-v<N>``, written atomically on first use."""
    target = tiny.tiny_root() / f"clip-v{TINY_CLIP_FORMAT}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".clip-", dir=target.parent))
    try:
        write_tiny_clip(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class ClipScorer:
    """Loads a CLIP model once and scores (image, prompt) pairs."""

    def __init__(self, model_path: str, device: torch.device | str = "cpu"):
        from transformers import CLIPModel, CLIPProcessor

        self.model_path = model_path
        self.device = torch.device(device)
        try:
            self.processor = CLIPProcessor.from_pretrained(model_path)
            self.model = CLIPModel.from_pretrained(model_path, dtype=torch.float32)
        except (OSError, ValueError) as exc:  # a missing folder can surface as an invalid repo id (ValueError)
            raise OSError(f"pretrained_evaluation_model_name_or_path: cannot load CLIP from {model_path!r}: {exc}") from exc
        self.model.requires_grad_(False).eval().to(self.device)

    @torch.no_grad()
    def score(self, images, prompts: list[str]) -> list[float]:
        """CLIP score of each image against the prompt at the same index."""
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        inputs = self.processor(text=list(prompts), images=list(images), return_tensors="pt", padding=True,
                                truncation=True)
        out = self.model(**{k: v.to(self.device) for k, v in inputs.items()})
        image = torch.nn.functional.normalize(out.image_embeds.float(), dim=-1)
        text = torch.nn.functional.normalize(out.text_embeds.float(), dim=-1)
        return (100 * (image * text).sum(-1)).clamp(min=0).cpu().tolist()
