"""Qwen-Image specifics the family contract does not cover: the prompt template cut, unpadded cached embeddings
batched with their masks, and where TREAD is refused."""

from __future__ import annotations

import pytest
import torch

from simpletuner.models.base import TextEmbedding
from simpletuner.models.qwen_image import QwenImageAdapter
from tests.models.contract import family_config


@pytest.fixture(scope="module")
def adapter(tiny_dir):
    return QwenImageAdapter(family_config("qwen_image"))


def test_the_template_is_cut_where_the_pipeline_cuts_it(adapter):
    """QwenImagePipeline drops a fixed number of leading tokens (its system prompt); the tiny tokenizer splits
    the template into exactly that many, as the real one does, so the cached embeddings are the prompt's own."""
    pipe = adapter.text_pipeline()
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    short, long = adapter.encode_prompts(["a red circle", "a red circle on a blue background"])
    assert short.tensors["prompt_embeds"].shape[0] < long.tensors["prompt_embeds"].shape[0]
    suffix = len(pipe.tokenizer("<|im_end|>\n<|im_start|>assistant\n").input_ids)
    assert short.tensors["prompt_embeds"].shape[0] == len(pipe.tokenizer("a red circle").input_ids) + suffix


def test_a_padded_batch_predicts_what_each_prompt_predicts_alone(adapter):
    transformer = adapter.load_transformer().eval()
    items = adapter.encode_prompts(["a red circle", "a blue square on a green background with a red circle"])
    batch = TextEmbedding.collate(items)
    assert batch["prompt_embeds_mask"][0].sum() < batch["prompt_embeds_mask"].shape[1]  # the short one is padded
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        together = adapter.predict(transformer, latents, t, batch)
        alone = [adapter.predict(transformer, latents[i:i + 1], t[i:i + 1], TextEmbedding.collate([item]))
                 for i, item in enumerate(items)]
    assert (together - torch.cat(alone)).abs().max().item() < 1e-5


def test_tread_is_refused_where_tokens_carry_their_own_modulation(adapter):
    from diffusers import QwenImageTransformer2DModel

    edit_like = QwenImageTransformer2DModel(num_layers=3, attention_head_dim=16, num_attention_heads=2,
                                            joint_attention_dim=32, axes_dims_rope=(4, 6, 6), zero_cond_t=True)
    assert adapter.tread_layout(edit_like) is None
    assert adapter.tread_layout(adapter.load_transformer()) is not None


def test_tread_routes_the_same_tokens_under_gradient_checkpointing(adapter):
    """Checkpointed blocks get their arguments positionally, and recompute in backward: the layout's positions
    must find the image tokens and the rotary table there, so both runs give the same loss and gradients."""
    from simpletuner.training.tread import apply_tread

    text = TextEmbedding.collate(adapter.encode_prompts(["a red circle", "a blue square"]))
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.4, 0.6])
    results = []
    for checkpointing in (False, True):
        transformer = adapter.load_transformer().train()
        if checkpointing:
            transformer.enable_gradient_checkpointing()
        handle = apply_tread(transformer, [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 1}],
                             adapter.tread_layout(transformer), generator=torch.Generator().manual_seed(1))
        loss = adapter.predict(transformer, latents, t, text).pow(2).mean()
        loss.backward()
        results.append((loss.item(), transformer.transformer_blocks[1].attn.to_q.weight.grad.clone(),
                        handle.last_selection[0].shape[1]))
    (plain, grad_plain, kept_plain), (ckpt, grad_ckpt, kept_ckpt) = results
    assert kept_plain == kept_ckpt == 8  # half of the 16 image tokens
    assert abs(plain - ckpt) < 1e-6 and torch.allclose(grad_plain, grad_ckpt, atol=1e-6)


# ---- Qwen-Image-Edit (edit-v1): the tiny weights loaded as the edit flavour ----------------------------------------
@pytest.fixture(scope="module")
def edit(adapter):
    edit = QwenImageAdapter(family_config("qwen_image", model_flavour="edit-v1",
                                          pretrained_model_name_or_path=str(adapter.ensure_tiny_checkpoint())))
    assert edit.references and edit.prompt_takes_reference
    return edit


def _pixels(name: str, width: int, height: int) -> torch.Tensor:
    from simpletuner.data.discovery import load_pixels_at
    from tests.conftest import REPO

    return load_pixels_at(REPO / "datasets" / "edit" / "reference" / name, width, height)


def test_the_edit_template_is_cut_where_the_pipeline_cuts_it(edit):
    """QwenImageEditPipeline drops its 64-token system prompt; the tiny tokenizer splits it into exactly that many,
    as the real one does, so the cached embedding starts at the reference's vision tokens."""
    pipe = edit.text_pipeline()
    system = pipe.prompt_template_encode.split("<|vision_start|>")[0]
    assert len(pipe.tokenizer(system).input_ids) == pipe.prompt_template_encode_start_idx == 64
    caption = "make the purple circle red"
    embedding = edit.encode_text([caption], [_pixels("00_circle.png", 64, 64)])[0].tensors["prompt_embeds"]
    # the processor turns the 1024x1024 reference into 112x112 pixels: 8x8 patches, merged 2x2 into 16 tokens
    vision = 1 + 16 + 1
    suffix = len(pipe.tokenizer("<|im_end|>\n<|im_start|>assistant\n").input_ids)
    assert embedding.shape[0] == vision + len(pipe.tokenizer(caption).input_ids) + suffix


def test_prompts_are_encoded_and_cached_with_their_reference(edit, tmp_path):
    """One caption edits two references: two embeddings, cached under two keys, each the one its reference makes."""
    from simpletuner.data.cache import TensorCache, fill_text_cache, text_key
    from simpletuner.data.discovery import reference_sample
    from tests.conftest import REPO

    folder = REPO / "datasets" / "edit" / "reference"
    samples = [reference_sample(folder / name, 64, 64) for name in ("00_circle.png", "01_square.png")]
    cache = TensorCache(tmp_path / "text")
    caption = "make it red"
    assert fill_text_cache([caption, caption], edit, cache, 4, show_progress=False, references=samples) == 2
    assert fill_text_cache([caption, caption], edit, cache, 4, show_progress=False, references=samples) == 0
    identity = edit.text_cache_identity()
    cached = [cache.load(text_key(caption, identity, s))["prompt_embeds"] for s in samples]
    assert (cached[0] - cached[1]).abs().max() > 1e-4
    direct = edit.encode_text([caption], [_pixels("01_square.png", 64, 64)])[0].tensors["prompt_embeds"]
    assert torch.equal(cached[1], direct)
    with pytest.raises(ValueError, match="encodes each prompt with the reference image it edits"):
        edit.encode_text([caption])


def test_a_wide_reference_is_resized_and_placed_as_the_pipeline_does(edit):
    """A 64x32 target with its 64x32 reference: the pipeline resizes the reference to 1440x736 (1024x1024's area at
    2:1, sides multiples of 32) and gives it its own token grid after the target's; the adapter's prediction is the
    pipeline's first step."""
    from PIL import Image

    from tests.models.contract import _capture_scheduler_input

    edit.load_vae()
    pixels = _pixels("02_triangle.png", 64, 32)
    reference = edit.encode_references(pixels.unsqueeze(0))
    assert edit.edit_reference_size(64, 32) == (1440, 736) and reference.shape == (1, 4, 736 // 8, 1440 // 8)
    text = TextEmbedding.collate(edit.encode_text(["make it red"], [pixels]))
    text.update(reference_latents=reference, reference_pixels=pixels.unsqueeze(0))
    transformer = edit.load_transformer().eval()
    latents = torch.randn(1, 4, 4, 8, generator=torch.Generator().manual_seed(0))
    pipe = edit.build_pipeline(transformer)
    pipe.set_progress_bar_config(disable=True)
    captured = _capture_scheduler_input(pipe)
    image = Image.fromarray(((pixels + 1) * 127.5).round().byte().permute(1, 2, 0).numpy())
    with torch.no_grad():
        pipe(prompt="make it red", **edit.reference_pipeline_kwargs(image), height=32, width=64, true_cfg_scale=1.0,
             num_inference_steps=2, latents=edit.pipeline_latents(latents), output_type="latent",
             generator=torch.Generator().manual_seed(0))
        t = edit.objective.pipeline_timestep(pipe.scheduler, 0)
        ours = edit.pipeline_latents(edit.predict(transformer, latents, t, text))
    assert ours.shape == captured[0].shape and (ours - captured[0]).abs().max().item() < 1e-5


def test_masked_target_tokens_are_kept_by_tread_reference_tokens_are_not_forced(edit):
    mask = torch.zeros(1, 1, 8, 8)
    mask[0, 0, 0, 0] = 1.0  # one latent: the first 2x2 token
    reference = torch.zeros(1, 4, 8, 12)
    keep = edit.image_token_mask(mask > 0, {"reference_latents": reference})
    assert keep.shape == (1, 16 + 24)
    assert keep[0].nonzero().flatten().tolist() == [0]
