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
