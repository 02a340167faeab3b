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
