"""Flux options the quickstart documents, each shown to change what the adapter does: T5 attention masking
(LibreFlux), tokenizer_max_length, VAE tiling, model CPU offload hooks, and offload_during_startup."""

from __future__ import annotations

import torch

from simpletuner.models.flux import FluxAdapter
from tests.helpers import flux_config


def test_attention_masking_keeps_padded_t5_tokens_out_of_attention(tiny_flux_path, tiny_transformer):
    masked = FluxAdapter(flux_config(attention_masked_training=True, tokenizer_max_length=32))
    plain = FluxAdapter(flux_config(tokenizer_max_length=32))
    [emb] = masked.encode_prompts(["a red circle"])
    mask = emb.tensors["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (32,) and 0 < mask.sum() < 32
    assert (emb.tensors["prompt_embeds"][~mask] == 0).all()  # padding zeroed as well as masked
    assert masked.text_cache_identity() != plain.text_cache_identity()  # old caches lack the mask: re-encoded

    text = {k: v.unsqueeze(0) for k, v in emb.tensors.items()}
    junk = dict(text, prompt_embeds=text["prompt_embeds"] + (~mask)[None, :, None] * 5.0)  # change padding only
    latents, t = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0.5])
    with torch.no_grad():
        a = masked.predict(tiny_transformer, latents, t, text)
        b = masked.predict(tiny_transformer, latents, t, junk)
        c = plain.predict(tiny_transformer, latents, t, {k: v for k, v in text.items() if k != "attention_mask"})
        d = plain.predict(tiny_transformer, latents, t, {k: v for k, v in junk.items() if k != "attention_mask"})
    assert torch.allclose(a, b, atol=1e-6)  # masked: what sits in the padded positions cannot matter
    assert (c - d).abs().max() > 1e-4  # unmasked: it does

    kwargs = masked.validation_attention_kwargs(text, None, width=64, height=32)
    assert kwargs["joint_attention_kwargs"]["attention_mask"].shape == (1, 1, 1, 32 + 8)
    assert plain.validation_attention_kwargs(text, None, width=64, height=32) == {}


def test_tokenizer_max_length_sets_the_t5_length(tiny_flux_path):
    adapter = FluxAdapter(flux_config(tokenizer_max_length=24))
    [emb] = adapter.encode_prompts(["a blue square"])
    assert emb.tensors["prompt_embeds"].shape[0] == 24 and adapter.t5_max_length == 24
    assert adapter.text_cache_identity() != FluxAdapter(flux_config()).text_cache_identity()


def test_vae_tiling_is_switched_on_and_keys_the_latent_cache(tiny_flux_path):
    tiled = FluxAdapter(flux_config(vae_enable_tiling=True))
    assert tiled.load_vae().use_tiling
    plain = FluxAdapter(flux_config())
    assert not plain.load_vae().use_tiling
    assert tiled.vae_cache_identity() != plain.vae_cache_identity()


def test_model_cpu_offload_hooks_the_encoders_onto_the_accelerator(tiny_flux_path, monkeypatch):
    """On an accelerator the VAE and text encoders stay on the CPU with accelerate's offload hook (moved over for
    their forward, back by offload_idle). The device is faked here: only the placement decision is under test."""
    adapter = FluxAdapter(flux_config(enable_model_cpu_offload=True))
    moved = []
    import accelerate

    monkeypatch.setattr(accelerate, "cpu_offload_with_hook",
                        lambda module, execution_device: (module, type("H", (), {"offload": lambda s: moved.append(1)})()))
    adapter.device = torch.device("cuda")
    adapter.load_vae()
    adapter.load_text_encoders()
    assert len(adapter._offload_hooks) == 3 and next(adapter.vae.parameters()).device.type == "cpu"
    adapter.offload_idle()
    assert len(moved) == 3


def test_offload_during_startup_drops_the_vae_before_the_text_encoders_load(make_setup, monkeypatch, tmp_path):
    from simpletuner.training import trainer

    events = []
    real_load_vae, real_load_te = FluxAdapter.load_vae, FluxAdapter.load_text_encoders
    monkeypatch.setattr(FluxAdapter, "load_vae", lambda self: events.append("vae") or real_load_vae(self))
    monkeypatch.setattr(FluxAdapter, "load_text_encoders",
                        lambda self: events.append(f"text (vae held: {self.vae is not None})") or real_load_te(self))
    from tests.helpers import CpuAccelerator

    accelerator = CpuAccelerator()
    accelerator.is_local_main_process = True
    accelerator.main_process_first = lambda: __import__("contextlib").nullcontext()
    for offload in (False, True):
        config, backends = make_setup(eval_dataset=False, offload_during_startup=offload,
                                      output_dir=f"out-{offload}")
        backends.datasets[0].cache_dir_vae = str(tmp_path / f"vae-{offload}")  # cold caches: both encoders run
        backends.text_embeds.cache_dir = str(tmp_path / f"text-{offload}")
        events.clear()
        trainer.prepare_data(config, backends, FluxAdapter(config), accelerator)
        assert events[:2] == ["vae", f"text (vae held: {not offload})"]
