import random

import numpy as np
import pytest
import torch

from simpletuner.evaluation.prompts import ValidationPrompt
from simpletuner.evaluation.validation import ValidationRunner, inference_mode, preserve_rng_state, to_pil
from tests.helpers import flux_config


def test_preserve_rng_state_restores_every_stream():
    generator = torch.Generator().manual_seed(9)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=generator).item())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    generator.manual_seed(9)
    with preserve_rng_state(generator):
        random.random(), np.random.rand(10), torch.randn(100), torch.rand(5, generator=generator)
    assert (random.random(), np.random.rand(), torch.rand(1).item(),
            torch.rand(1, generator=generator).item()) == expected


def test_inference_mode_restores_each_module_flag_and_tread(tiny_adapter, tiny_transformer):
    from simpletuner.training.tread import apply_tread

    model = tiny_transformer
    model.train()
    model.time_text_embed.eval()  # a module the trainer keeps in eval mode stays so
    handle = apply_tread(model, [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}],
                         tiny_adapter.tread_layout(model))
    try:
        with inference_mode(model):
            assert not any(m.training for m in model.modules())
            assert not handle.enabled and not torch.is_grad_enabled()
        assert model.training and model.transformer_blocks[0].training
        assert not model.time_text_embed.training
        assert handle.enabled and torch.is_grad_enabled()
        with pytest.raises(RuntimeError), inference_mode(model):
            raise RuntimeError("generation failed")
        assert model.training and handle.enabled
    finally:
        handle.remove()
        model.eval()


def test_to_pil_maps_minus_one_to_one_onto_bytes():
    pixels = torch.tensor([-1.0, 0.0, 1.0, 2.0]).view(1, 1, 4).expand(3, 1, 4)
    assert np.asarray(to_pil(pixels))[0, :, 0].tolist() == [0, 128, 255, 255]


def _runner(tiny_adapter, tmp_path, previews=None, **overrides):
    config = flux_config(output_dir=str(tmp_path), validation_num_inference_steps=overrides.pop("steps", 2),
                         validation_seed=7, **overrides)
    decoder = tiny_adapter.load_preview_decoder() if previews is not None else None
    return ValidationRunner(config, tiny_adapter, lambda p: tiny_adapter.encode_prompts([p])[0].tensors,
                            preview_decoder=decoder, on_preview=previews)


def test_previews_every_n_inference_steps(tiny_adapter, tiny_transformer, tmp_path):
    seen = []
    runner = _runner(tiny_adapter, tmp_path, previews=lambda p, step: seen.append((p, step)), steps=20,
                     validation_preview_steps=5)
    images = runner.run(tiny_transformer, [ValidationPrompt("sq", "a red square")], [(32, 48)], step=3)
    assert [(p.inference_step, step) for p, step in seen] == [(5, 3), (10, 3), (15, 3), (20, 3)]
    folder = tmp_path / "validation" / "step_3"
    assert [p.path for p, _ in seen] == [folder / "previews" / f"sq_32x48_{i}.png" for i in (5, 10, 15, 20)]
    assert all(p.path.is_file() and p.resolution == (32, 48) for p, _ in seen)
    assert images[0].path == folder / "sq_32x48.png" and images[0].image.size == (32, 48)


def _pipeline_image(tiny_adapter, transformer, **kwargs):
    pipe = tiny_adapter.build_pipeline(transformer)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(height=32, width=32, num_inference_steps=2, generator=torch.Generator().manual_seed(7),
               max_sequence_length=tiny_adapter.t5_max_length, **kwargs)
    return np.asarray(out.images[0])


@pytest.mark.parametrize("real_cfg", [False, True])
def test_image_is_the_diffusers_pipeline_image_from_cached_embeddings(tiny_adapter, tiny_transformer, tmp_path,
                                                                      real_cfg):
    extra = {"validation_guidance_real": 2.5, "validation_negative_prompt": "blurry"} if real_cfg else {}
    runner = _runner(tiny_adapter, tmp_path, validation_guidance=2.0, **extra)
    (image,) = runner.run(tiny_transformer, [ValidationPrompt("c", "a blue circle")], [(32, 32)], step=0)
    pipe_kwargs = {"negative_prompt": "blurry", "true_cfg_scale": 2.5} if real_cfg else {}
    expected = _pipeline_image(tiny_adapter, tiny_transformer, prompt="a blue circle", guidance_scale=2.0,
                               **pipe_kwargs)
    np.testing.assert_array_equal(np.asarray(image.image), expected)
    if real_cfg:  # true CFG really ran: without it the image differs
        plain = _pipeline_image(tiny_adapter, tiny_transformer, prompt="a blue circle", guidance_scale=2.0)
        assert not np.array_equal(np.asarray(image.image), plain)


def test_pipeline_wraps_the_training_transformer_without_text_encoders(tiny_adapter, tiny_transformer):
    pipe = tiny_adapter.build_validation_pipeline(tiny_transformer)
    assert pipe.transformer is tiny_transformer
    assert pipe.text_encoder is None and pipe.text_encoder_2 is None


def test_validation_pipeline_kwargs():
    from simpletuner.models.flux import FluxAdapter

    adapter = FluxAdapter(flux_config())
    text = {"prompt_embeds": "p", "pooled_prompt_embeds": "pp"}
    negative = {"prompt_embeds": "n", "pooled_prompt_embeds": "np"}
    # the T5 length travels too, so a call with prompt= instead of embeddings encodes like the cache did
    assert adapter.validation_pipeline_kwargs(text, negative, guidance=3.5, guidance_real=1.0) == {
        "prompt_embeds": "p", "pooled_prompt_embeds": "pp", "guidance_scale": 3.5, "max_sequence_length": 64}
    assert adapter.validation_pipeline_kwargs(text, negative, guidance=3.5, guidance_real=4.0) == {
        "prompt_embeds": "p", "pooled_prompt_embeds": "pp", "guidance_scale": 3.5, "negative_prompt_embeds": "n",
        "negative_pooled_prompt_embeds": "np", "true_cfg_scale": 4.0, "max_sequence_length": 64}


def test_preview_latents_match_the_pipeline_decode_path(tiny_adapter):
    from diffusers import FluxPipeline

    tiny_adapter.load_vae()
    latents = torch.randn(1, 4, 4, 4)
    packed = FluxPipeline._pack_latents(latents, 1, 4, 4, 4)
    cfg = tiny_adapter.vae.config
    expected = latents / cfg.scaling_factor + cfg.shift_factor
    torch.testing.assert_close(tiny_adapter.preview_latents(packed, 32, 32), expected)
    decoder = tiny_adapter.load_preview_decoder()
    assert type(decoder).__name__ == "AutoencoderTiny"
    assert decoder.decode(expected).sample.shape == (1, 3, 32, 32)



def test_an_edit_model_validates_by_editing_each_prompts_reference(tiny_transformer, tmp_path, monkeypatch):
    """With references, each prompt's image is the edit pipeline's edit of that prompt's reference image, as
    FluxKontextPipeline makes it from the image file itself."""
    from PIL import Image

    from simpletuner.data.discovery import load_pixels_at
    from simpletuner.models.flux import FluxAdapter
    from tests.conftest import REPO

    adapter = FluxAdapter(flux_config(), references=True)
    folder = REPO / "datasets" / "edit" / "reference"
    names = ("00_circle.png", "01_square.png")
    latents = {name: adapter.encode_images(load_pixels_at(folder / name, 32, 32).unsqueeze(0))[0] for name in names}
    config = flux_config(output_dir=str(tmp_path), validation_num_inference_steps=2, validation_seed=7)
    runner = ValidationRunner(config, adapter, lambda p: adapter.encode_prompts([p])[0].tensors,
                              references=lambda item, w, h: latents[item.reference_image])
    handed = []
    kwargs_of = adapter.validation_pipeline_kwargs
    monkeypatch.setattr(adapter, "validation_pipeline_kwargs",
                        lambda text, *a, **k: handed.append(text["reference_latents"]) or kwargs_of(text, *a, **k))
    images = runner.run(tiny_transformer, [ValidationPrompt(n[:2], "make it red", n) for n in names], [(32, 32)],
                        step=0)
    assert [torch.equal(h[0], latents[n]) for h, n in zip(handed, names)] == [True, True]

    pipe = adapter.build_pipeline(tiny_transformer)
    pipe.set_progress_bar_config(disable=True)
    for image, name in zip(images, names):
        reference = Image.open(folder / name).convert("RGB").resize((32, 32), Image.Resampling.LANCZOS)
        expected = pipe(prompt="make it red", height=32, width=32, num_inference_steps=2, max_sequence_length=64,
                        generator=torch.Generator().manual_seed(7), guidance_scale=config.validation_guidance,
                        **adapter.reference_pipeline_kwargs(reference)).images[0]
        # the pipeline encodes the file itself (float rounding can move a pixel by one level)
        assert np.abs(np.asarray(image.image).astype(int) - np.asarray(expected).astype(int)).max() <= 1
