"""diffusers group offload around LoRA training of a tiny Flux transformer (onload device: cpu).

On CPU nothing actually moves between devices; these tests prove the hooks leave training's math untouched (same
losses, same gradients, same updates) and that refused / downgraded options behave as documented.
"""

import logging

import pytest
import torch
from diffusers.hooks import apply_group_offloading
from peft import LoraConfig, inject_adapter_in_model

from simpletuner.training.offload import check_offload_options, enable_group_offload, group_offload_enabled
from simpletuner.models.quantize import quantize_model
from simpletuner.training.tread import TreadLayout, apply_tread
from tests.helpers import tiny_flux_transformer as tiny_flux, flux_transformer_inputs as flux_inputs


def lora_flux(quantize=None):
    model = tiny_flux()
    if quantize:
        quantize_model(model, quantize)
    model.requires_grad_(False)
    torch.manual_seed(2)
    cfg = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "proj_mlp", "ff.net.2"],
                     init_lora_weights="gaussian")
    return inject_adapter_in_model(cfg, model)


def train(model, steps=2):
    inputs = flux_inputs()
    target = torch.randn_like(inputs["hidden_states"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(**inputs).sample, target)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        opt.step()
    return losses, grads


def prepare(quantize, checkpointing):
    model = lora_flux(quantize)
    if checkpointing:
        model.enable_gradient_checkpointing()
    return model


@pytest.mark.parametrize(
    "offload_type, per_group, quantize, checkpointing",
    [
        ("block_level", 1, None, False),
        ("block_level", 2, None, False),
        ("leaf_level", 1, None, False),
        ("block_level", 1, "int8-quanto", True),
        ("leaf_level", 1, "int4-quanto", True),
    ],
)
def test_training_with_group_offload_matches_training_without(offload_type, per_group, quantize, checkpointing):
    reference_losses, reference_grads = train(prepare(quantize, checkpointing))
    model = enable_group_offload(prepare(quantize, checkpointing), onload_device="cpu", offload_type=offload_type,
                                 blocks_per_group=per_group)
    assert group_offload_enabled(model)
    losses, grads = train(model)
    assert losses == pytest.approx(reference_losses, abs=1e-6)
    assert reference_losses[-1] < reference_losses[0]
    for step, step_grads in enumerate(grads):
        assert step_grads.keys() == reference_grads[step].keys()
        for name, grad in step_grads.items():
            assert torch.allclose(grad, reference_grads[step][name], atol=1e-6), (step, name)


def test_quantized_base_without_checkpointing_is_refused():
    with pytest.raises(ValueError, match="enable_group_offload: training a quanto-quantized base .* gradient_checkp"):
        enable_group_offload(lora_flux("int8-quanto"), onload_device="cpu")
    model = lora_flux("int8-quanto")
    model.enable_gradient_checkpointing()
    model._gradient_checkpointing_interval = 2
    with pytest.raises(ValueError, match="interval 1"):
        enable_group_offload(model, onload_device="cpu")
    inference = enable_group_offload(lora_flux("int8-quanto"), onload_device="cpu", training=False)
    with torch.no_grad():
        inference(**flux_inputs())


def test_upstream_offload_of_quanto_weights_held_by_autograd_still_fails():
    """Why the refusal above exists. If this starts failing, diffusers/torch fixed it: lift the refusal."""
    model = lora_flux("int8-quanto")
    apply_group_offloading(model, onload_device="cpu", offload_type="block_level", num_blocks_per_group=1)
    with pytest.raises(RuntimeError, match="Couldn't swap"):
        model(**flux_inputs())


def test_tread_and_group_offload_compose():
    def routed_step(offload):
        model = lora_flux()
        if offload:
            enable_group_offload(model, onload_device="cpu", offload_type="block_level")
        layout = TreadLayout(blocks=list(model.transformer_blocks) + list(model.single_transformer_blocks))
        apply_tread(model, [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}], layout,
                    generator=torch.Generator().manual_seed(0))
        loss = model(**flux_inputs()).sample.square().mean()
        loss.backward()
        return loss.item(), model.transformer_blocks[0].attn.to_q.lora_B.default.weight.grad

    plain, offloaded = routed_step(False), routed_step(True)
    assert plain[0] == pytest.approx(offloaded[0], abs=1e-6)
    assert torch.allclose(plain[1], offloaded[1], atol=1e-6)


def test_streams_are_disabled_off_cuda_with_a_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="simpletuner.training.offload"):
        model = enable_group_offload(lora_flux(), onload_device="cpu", use_stream=True, blocks_per_group=2)
    assert "group_offload_use_stream: CUDA streams need a CUDA device; disabled on cpu" in caplog.text
    assert group_offload_enabled(model)
    model(**flux_inputs())


def test_disk_offload_is_refused_for_training_and_allowed_for_inference(tmp_path):
    with pytest.raises(ValueError, match="group_offload_to_disk_path: not supported for training"):
        enable_group_offload(lora_flux(), onload_device="cpu", to_disk_path=str(tmp_path))
    reference = tiny_flux().eval()
    model = enable_group_offload(tiny_flux().eval(), onload_device="cpu", to_disk_path=str(tmp_path),
                                 training=False)
    inputs = flux_inputs()
    with torch.no_grad():
        expected = reference(**inputs).sample
        assert torch.equal(model(**inputs).sample, expected)
        assert torch.equal(model(**inputs).sample, expected)  # second pass reads the weights back from disk
    assert list(tmp_path.glob("*.safetensors"))


def test_upstream_disk_offload_still_loses_lora_updates(tmp_path):
    """Why the refusal above exists. If this starts failing, diffusers fixed it: lift the refusal."""
    model = lora_flux()
    apply_group_offloading(model, onload_device="cpu", offload_type="block_level", num_blocks_per_group=1,
                           offload_to_disk_path=str(tmp_path))
    losses, _ = train(model, steps=3)
    assert losses[0] == losses[1] == losses[2]  # the optimizer steps never reach the weights the model uses


def test_invalid_options_name_the_field():
    with pytest.raises(ValueError, match="group_offload_type: 'model_level' is not one of block_level, leaf_level"):
        enable_group_offload(tiny_flux(), onload_device="cpu", offload_type="model_level")
    with pytest.raises(ValueError, match="group_offload_blocks_per_group: 0 must be an integer >= 1"):
        enable_group_offload(tiny_flux(), onload_device="cpu", blocks_per_group=0)
    with pytest.raises(ValueError, match="enable_group_offload: cannot be combined with enable_model_cpu_offload"):
        check_offload_options(True, True)
    check_offload_options(True, False)
    check_offload_options(False, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: on CPU nothing moves")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_with_group_offload_to_cuda_matches_resident_training(checkpointing):
    reference_model = prepare(None, checkpointing).to("cuda")
    model = enable_group_offload(prepare(None, checkpointing), onload_device="cuda", use_stream=True)

    def run(m):
        inputs = {k: v.to("cuda") for k, v in flux_inputs().items()}
        target = torch.randn(inputs["hidden_states"].shape, generator=torch.Generator().manual_seed(5)).to("cuda")
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(**inputs).sample, target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    assert run(model) == pytest.approx(run(reference_model), rel=1e-4)
