"""attention_mechanism, per-block torch.compile and gradient_checkpointing_interval on a tiny Flux transformer."""

import logging

import pytest
import torch
import torch.utils.checkpoint

from simpletuner.training import compile as compile_mod
from simpletuner.training.compile import (
    apply_gradient_checkpointing_interval,
    compile_transformer_blocks,
    remove_block_compilation,
    set_attention_mechanism,
    transformer_blocks,
)
from simpletuner.training.tread import TreadLayout, apply_tread
from tests.helpers import tiny_flux_transformer as tiny_flux, flux_transformer_inputs as flux_inputs


def grads_of(model, tread_seed=None):
    if tread_seed is not None:
        layout = TreadLayout(blocks=transformer_blocks(model))
        apply_tread(model, [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}], layout,
                    generator=torch.Generator().manual_seed(tread_seed))
    x = flux_inputs()["hidden_states"].requires_grad_(True)
    loss = model(**{**flux_inputs(), "hidden_states": x}).sample.square().mean()
    loss.backward()
    return loss.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def assert_same(a, b):
    assert torch.allclose(a[0], b[0], atol=1e-6)
    assert torch.allclose(a[1], b[1], atol=1e-6)
    for name, grad in a[2].items():
        assert torch.allclose(grad, b[2][name], atol=1e-5), name


@pytest.mark.parametrize("interval", [1, 2, 4])
@pytest.mark.parametrize("tread", [None, 3])
def test_checkpointing_interval_matches_no_checkpointing(interval, tread, monkeypatch):
    reference = grads_of(tiny_flux(), tread)
    calls = []
    original = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = tiny_flux()
    apply_gradient_checkpointing_interval(model, interval)
    assert_same(reference, grads_of(model, tread))
    assert len(calls) == len(range(0, 6, interval))  # blocks 0, interval, ... of the 6 were checkpointed


def test_checkpointing_interval_rejects_bad_values():
    with pytest.raises(ValueError, match="gradient_checkpointing_interval: 0 must be an integer >= 1"):
        apply_gradient_checkpointing_interval(tiny_flux(), 0)


def test_default_attention_is_sdpa_and_unavailable_ones_are_named():
    model = tiny_flux()
    inputs = flux_inputs()
    reference = model(**inputs).sample
    assert set_attention_mechanism(model, "sdpa") is None
    assert set_attention_mechanism(model, "diffusers") is None
    assert torch.equal(model(**inputs).sample, reference)
    with pytest.raises(ValueError, match="attention_mechanism: 'flash3' is not one of"):
        set_attention_mechanism(model, "flash3")
    with pytest.raises(ValueError, match="sageattention has no backward pass"):
        set_attention_mechanism(model, "sageattention")
    for mechanism, package in (("xformers", "xformers"), ("flash-attn", "flash_attn")):
        if compile_mod.importlib.util.find_spec(package) is None:
            with pytest.raises(ValueError, match=f"attention_mechanism: {mechanism} needs the {package} package"):
                set_attention_mechanism(model, mechanism)


def test_compiled_blocks_match_and_keep_tread_hooks_eager():
    reference = grads_of(tiny_flux(), tread_seed=4)
    model = tiny_flux()
    assert compile_transformer_blocks(model, backend="eager") == 6
    assert_same(reference, grads_of(model, tread_seed=4))
    remove_block_compilation(model)
    assert "forward" not in vars(model.transformer_blocks[0])


def test_compile_falls_back_with_a_message_when_unsupported(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    model = tiny_flux()
    with caplog.at_level(logging.WARNING, logger="simpletuner.training.compile"):
        assert compile_transformer_blocks(model) == 0
    assert "compile: torch.compile is not supported here (RuntimeError: no C++ compiler found)" in caplog.text
    assert "forward" not in vars(model.transformer_blocks[0])
