"""SDXL and Kolors beyond the family contract: micro-conditioning from the crop actually used, the v-prediction
flavours, what validation samples with, and the ``all`` LoRA preset in the pipeline."""

from __future__ import annotations

import pytest
import torch

from simpletuner.config import load_train_config
from simpletuner.models.base import TextEmbedding
from simpletuner.models.registry import get_adapter_class
from tests.models.contract import PROMPT, _first_step_output, family_config


@pytest.fixture(scope="module", params=["sdxl", "kolors"])
def unet_family(request, tiny_dir):
    family = request.param
    adapter = get_adapter_class(family)(family_config(family))
    return adapter, adapter.load_transformer().eval().requires_grad_(False)


@pytest.fixture
def cropped_sample(sample_dataset):
    """A sample that was resized and randomly cropped: original size, crop corner and bucket all differ."""
    from simpletuner.config import load_data_backends
    from simpletuner.data.discovery import discover

    backends = load_data_backends([
        {"id": "s", "instance_data_dir": str(sample_dataset), "caption_strategy": "textfile", "crop": True,
         "crop_style": "random", "crop_aspect": "square", "resolution": 64, "resolution_type": "pixel"},
        {"id": "t", "dataset_type": "text_embeds"}])
    samples = discover(backends.datasets[0], family_config("sdxl"), 32).samples
    sample = next(s for s in samples if s.crop_box[0] or s.crop_box[1])
    assert sample.original_size != sample.target_size
    return sample


def test_micro_conditioning_is_the_original_size_the_crop_and_the_bucket(unet_family, cropped_sample):
    import types

    from diffusers import StableDiffusionXLPipeline

    adapter, unet = unet_family
    s = cropped_sample
    (ow, oh), (tw, th), (left, top) = s.original_size, s.target_size, s.crop_box[:2]
    ours = adapter.sample_conditioning([s, s])["time_ids"]
    theirs = StableDiffusionXLPipeline._get_add_time_ids(types.SimpleNamespace(unet=unet), (oh, ow), (top, left),
                                                         (th, tw), dtype=torch.float32, text_encoder_projection_dim=32)
    assert torch.equal(ours, theirs.expand(2, 6))


def test_prediction_with_micro_conditioning_matches_the_pipeline(unet_family, cropped_sample):
    """The pipeline called with a sample's original_size / crops_coords_top_left / target_size computes what the
    adapter predicts from that sample's conditioning; other conditioning gives another prediction."""
    adapter, unet = unet_family
    s = cropped_sample
    text = TextEmbedding.collate(adapter.encode_prompts([PROMPT]))
    cond = {**text, **adapter.sample_conditioning([s])}
    latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    (ow, oh), (tw, th), (left, top) = s.original_size, s.target_size, s.crop_box[:2]
    pipe = adapter.build_pipeline(unet)
    kwargs = adapter.validation_pipeline_kwargs(text, None, guidance=1.0, guidance_real=1.0)
    theirs, t = _first_step_output(pipe, adapter, latents, original_size=(oh, ow), crops_coords_top_left=(top, left),
                                   target_size=(th, tw), **kwargs)
    with torch.no_grad():
        ours = adapter.predict(unet, latents, t, cond)
        uncropped = adapter.predict(unet, latents, t, text)
    assert (ours - theirs).abs().max().item() < 1e-5
    assert (ours - uncropped).abs().max().item() > 1e-5


def test_v_prediction_flavours_train_and_sample_on_a_zero_terminal_snr_schedule(tiny_dir):
    config = load_train_config({"model_family": "sdxl", "model_flavour": "noobai-vpred-1.0"}).config
    assert config.prediction_type == "v_prediction" and config.rescale_betas_zero_snr is True
    # what a config says wins over what the flavour implies
    mine = load_train_config({"model_family": "sdxl", "model_flavour": "terminus-xl-velocity-v2",
                              "rescale_betas_zero_snr": False}).config
    assert mine.prediction_type == "v_prediction" and mine.rescale_betas_zero_snr is False
    assert load_train_config({"model_family": "sdxl"}).config.prediction_type == "epsilon"

    # the tiny weights trained as a v-prediction model: the validation pipeline samples v on the rescaled schedule
    adapter = get_adapter_class("sdxl")(family_config("sdxl", prediction_type="v_prediction",
                                                      rescale_betas_zero_snr=True))
    assert adapter.objective.scheduler.alphas_cumprod[-1] == 0
    pipe = adapter.build_pipeline(adapter.load_transformer())
    cfg = pipe.scheduler.config
    assert (cfg.prediction_type, cfg.rescale_betas_zero_snr, cfg.timestep_spacing) == ("v_prediction", True,
                                                                                      "trailing")
    pipe.scheduler.set_timesteps(4)
    assert int(pipe.scheduler.timesteps[0]) == 999  # sampling starts from pure noise, as training ends there
    plain = get_adapter_class("sdxl")(family_config("sdxl")).build_pipeline(adapter.load_transformer())
    assert plain.scheduler.config.prediction_type == "epsilon" and not plain.scheduler.config.rescale_betas_zero_snr


def test_the_all_preset_loads_into_the_pipeline_and_reproduces(unet_family, tmp_path):
    from simpletuner.training.lora import add_lora, lora_state_dict

    adapter, _ = unet_family
    config = family_config(adapter.family, lora_target="all", lora_rank=2)
    trained = adapter.load_transformer()
    add_lora(trained, adapter, config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    names = {n for n, _ in trained.named_modules()}
    assert any(n.endswith("resnets.0.conv1") for n in names) and any(n.endswith("ff.net.2") for n in names)
    adapter.save_lora(lora_state_dict(trained), tmp_path)
    pipe = adapter.pipeline_class.from_pretrained(adapter.ensure_tiny_checkpoint())
    adapter.load_lora(pipe, tmp_path / "pytorch_lora_weights.safetensors")
    text = TextEmbedding.collate(adapter.encode_prompts([PROMPT]))
    latents = torch.randn(1, 4, 8, 8, generator=g)
    t = torch.tensor([400])
    with torch.no_grad():
        assert (adapter.predict(trained.eval(), latents, t, text)
                - adapter.predict(pipe.unet, latents, t, text)).abs().max().item() < 1e-5


def test_init_lora_starts_a_unet_from_an_exported_lora(unet_family, tmp_path):
    from simpletuner.training.lora import add_lora, lora_state_dict

    adapter, _ = unet_family
    first = adapter.load_transformer()
    add_lora(first, adapter, family_config(adapter.family, lora_rank=2))
    state = {k: torch.randn_like(v) for k, v in lora_state_dict(first).items()}
    path = adapter.save_lora(state, tmp_path)
    second = adapter.load_transformer()
    add_lora(second, adapter, family_config(adapter.family, lora_rank=2, init_lora=str(path)))
    loaded = lora_state_dict(second)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
