"""Flux-specific checks beyond the family contract (tests/models/contract.py): the transformer inputs one by
one, packing, guidance, presets, single-file checkpoints, text-encoder precision."""

from __future__ import annotations


import pytest
import torch

from simpletuner.models.base import TextEmbedding
from simpletuner.models.flux import FluxAdapter
from tests.helpers import flux_config, left_unchanged


@pytest.fixture(scope="module")
def adapter(tiny_flux_path):
    """Shared by this module's tests: a test that needs other settings builds its own adapter."""
    a = FluxAdapter(flux_config())
    a.load_text_encoders()
    a.load_vae()
    with left_unchanged(adapter=a, what="test_flux's adapter"):
        yield a


@pytest.fixture(scope="module")
def transformer(adapter):
    t = adapter.load_transformer().eval()
    with left_unchanged(model=t, what="test_flux's transformer"):
        yield t


def test_prediction_matches_what_fluxpipeline_feeds_its_transformer(adapter, transformer):
    """Capture the transformer call FluxPipeline makes, then ask the adapter for the same prediction."""
    pipe = adapter.build_pipeline(transformer)
    generator = torch.Generator().manual_seed(0)
    height = width = 128
    latents = torch.randn(1, 4, height // 8, width // 8, generator=generator)
    captured = {}

    def hook(module, args, kwargs, output):
        if not captured:
            captured.update(kwargs=kwargs, output=output[0].detach().clone())

    handle = transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe(
            prompt="a red circle on a blue background", height=height, width=width, num_inference_steps=2,
            guidance_scale=3.5, latents=adapter.pack_latents(latents), max_sequence_length=adapter.t5_max_length,
            output_type="latent",
        )
    finally:
        handle.remove()

    sigma = captured["kwargs"]["timestep"]
    # the pipeline's guidance 3.5 is what training feeds with guidance_value 3.5 (a fresh adapter: the shared
    # fixture's config stays as it is for the other tests)
    guided = FluxAdapter(flux_config(guidance_value=3.5))
    guided.text_encoders, guided.tokenizers = adapter.text_encoders, adapter.tokenizers
    text = TextEmbedding.collate(guided.encode_prompts(["a red circle on a blue background"]))
    with torch.no_grad():
        ours = guided.predict(transformer, latents, sigma, text)
        inputs = guided.model_inputs(transformer, latents, sigma, text)
    for key in ("hidden_states", "encoder_hidden_states", "pooled_projections", "img_ids", "txt_ids", "guidance"):
        assert torch.allclose(inputs[key].float(), captured["kwargs"][key].float(), atol=1e-6), key
    theirs = FluxAdapter.unpack_latents(captured["output"], latents.shape[2], latents.shape[3])
    assert (ours - theirs).abs().max().item() < 1e-5


def test_preset_shapes(adapter, transformer):
    from peft import LoraConfig, inject_adapter_in_model

    for preset, check in (("mmdit", lambda names: all(n.startswith("transformer_blocks.") for n in names)),
                          ("nano", lambda names: len(names) == 1)):
        model = adapter.load_transformer()
        inject_adapter_in_model(LoraConfig(r=2, target_modules=adapter.lora_target_modules(transformer, preset)),
                                model)
        assert check([n for n, _ in model.named_modules() if n.endswith("lora_A")]), preset


def test_pack_unpack_roundtrip():
    x = torch.randn(2, 4, 12, 16)
    packed = FluxAdapter.pack_latents(x)
    assert packed.shape == (2, 6 * 8, 16)
    assert torch.equal(FluxAdapter.unpack_latents(packed, 12, 16), x)


def test_vae_latents_decode_back(adapter):
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    latents = adapter.encode_images(pixels)
    assert latents.shape == (1, 4, 8, 8)
    assert adapter.decode_latents(latents).shape == (1, 3, 64, 64)


def test_unknown_preset_names_the_field(adapter, transformer):
    with pytest.raises(ValueError, match="lora_target"):
        adapter.lora_target_modules(transformer, "everything")


def test_schnell_has_no_guidance_vector(adapter):
    from diffusers import FluxTransformer2DModel

    t = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                               attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                               pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    assert adapter.guidance_vector(t, 2, "cpu", torch.float32) is None


def test_registry_imports_family_only_on_use():
    import subprocess
    import sys

    code = ("import sys; from simpletuner.models import registry; "
            "assert 'simpletuner.models.flux' not in sys.modules; assert 'torch' not in sys.modules; "
            "registry.get_adapter_class('flux'); assert 'simpletuner.models.flux' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_text_encoder_precision_quantizes_the_encoders(tiny_flux_path):
    from simpletuner.models.quantize import count_quantized

    plain = FluxAdapter(flux_config())
    plain.load_text_encoders()
    quantized = FluxAdapter(flux_config(text_encoder_1_precision="int8-quanto", text_encoder_2_precision="int8-quanto"))
    quantized.load_text_encoders()
    assert [count_quantized(e) for e in plain.text_encoders] == [0, 0]
    assert all(count_quantized(e) > 0 for e in quantized.text_encoders)
    a = plain.encode_prompts(["a red circle"])[0].tensors["prompt_embeds"]
    b = quantized.encode_prompts(["a red circle"])[0].tensors["prompt_embeds"]
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=0.1)  # int8 is close, not identical


def test_text_cache_identity_changes_with_encoder_precision(tiny_flux_path):
    a = FluxAdapter(flux_config()).text_cache_identity()
    b = FluxAdapter(flux_config(text_encoder_2_precision="int8-quanto")).text_cache_identity()
    assert a != b and a == FluxAdapter(flux_config()).text_cache_identity()


def test_transformer_depth_from_a_single_file_reads_only_tensor_names(tiny_flux_path, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(next((tiny_flux_path / "transformer").glob("*.safetensors")))
    save_file(weights, tmp_path / "flux.safetensors")  # diffusers key names
    bfl = {k.replace("single_transformer_blocks.", "single_blocks.").replace("transformer_blocks.", "double_blocks."): v
           for k, v in weights.items()}
    save_file(bfl, tmp_path / "flux-bfl.safetensors")  # the original release's key names
    for name in ("flux.safetensors", "flux-bfl.safetensors"):
        adapter = FluxAdapter(flux_config(pretrained_transformer_model_name_or_path=str(tmp_path / name)))
        assert adapter.transformer_depth() == 2 + 4
