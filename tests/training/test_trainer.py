"""Pieces of trainer.py that are worth checking on their own."""

from __future__ import annotations

import pytest
import torch

from simpletuner.models.base import TextEmbedding
from simpletuner.models.flux import FluxAdapter
from simpletuner.training.lora import add_lora
from simpletuner.training.trainer import compute_loss, total_train_steps, weight_dtype_for
from tests.helpers import flux_config, namespace


@pytest.fixture(scope="module")
def setup(tiny_flux_path):
    config = flux_config(lora_dropout=0.0)
    adapter = FluxAdapter(config)
    transformer = adapter.load_transformer()
    add_lora(transformer, adapter, config)
    text = TextEmbedding.collate(adapter.encode_prompts(["a red circle", "a blue square"]))
    return config, adapter, transformer, text


def test_regularisation_samples_train_towards_the_base_model(setup):
    config, adapter, transformer, text = setup
    latents = torch.randn(2, 4, 8, 8)
    # a fresh LoRA (B = 0) predicts exactly what the base does, so a regularisation batch has zero loss ...
    reg = compute_loss(config, adapter, transformer, latents, text, torch.tensor([True, True]),
                       torch.Generator().manual_seed(0))
    assert reg.item() == 0.0
    # ... while the same batch as ordinary data is trained towards the flow-matching velocity
    plain = compute_loss(config, adapter, transformer, latents, text, torch.tensor([False, False]),
                         torch.Generator().manual_seed(0))
    assert plain.item() > 0.1
    assert transformer.active_adapters()  # adapters are switched back on afterwards


REGULARISATION = namespace(image_datasets=[namespace(is_regularisation_data=True)])


@pytest.fixture(scope="module")
def full_setup(setup):
    """A full fine-tune of the tiny Flux: its frozen base copy, and the trained transformer a few updates away."""
    from simpletuner.training.trainer import build_regularisation_base

    _, _, _, text = setup
    config = flux_config(model_type="full")
    adapter = FluxAdapter(config)
    base = build_regularisation_base(config, adapter, REGULARISATION, torch.device("cpu"))
    trained = adapter.load_transformer().requires_grad_(True)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return config, adapter, trained, base, text


def test_full_fine_tune_regularisation_targets_the_frozen_base(full_setup):
    """A regularisation sample's target in a full fine-tune is the frozen base model's prediction for the same noisy
    latents and timestep; an ordinary sample's is the objective's; only the trained copy gets gradients."""
    config, adapter, trained, base, text = full_setup
    assert not any(p.requires_grad for p in base.parameters()) and not base.training
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    is_reg = torch.tensor([True, False])
    trained.zero_grad(set_to_none=True)
    loss = compute_loss(config, adapter, trained, latents, text, is_reg, torch.Generator().manual_seed(3),
                        base_model=base)
    loss.backward()
    assert all(p.grad is None for p in base.parameters())
    assert all(p.grad is not None for p in trained.parameters() if p.requires_grad)

    # the same draws by hand: noise, then timesteps, from the step's generator
    objective, g = adapter.objective, torch.Generator().manual_seed(3)
    noise = torch.randn(latents.shape, generator=g)
    t = objective.sample_timesteps(2, generator=g, image_seq_len=adapter.image_seq_len(latents.shape))
    noisy = objective.add_noise(latents, noise, t)
    with torch.no_grad():
        pred = adapter.predict(trained, noisy, t, text)
        base_pred = adapter.predict(base, noisy, t, text)
    target = torch.stack([base_pred[0], objective.target(latents, noise, t)[1]])
    assert torch.allclose(loss.detach(), objective.loss(pred, target, t), rtol=1e-6, atol=1e-7)
    # the base's prediction is not what an ordinary sample is trained towards
    as_data = objective.loss(pred, objective.target(latents, noise, t), t)
    assert (as_data - loss.detach()).abs() > 1e-3


def test_full_fine_tune_regularisation_at_the_base_has_zero_loss(full_setup):
    """Before any update the trained copy is the base: regularisation samples have nothing to learn (zero loss),
    the same samples as ordinary data do."""
    config, adapter, _, base, text = full_setup
    fresh = adapter.load_transformer().requires_grad_(True)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    reg = compute_loss(config, adapter, fresh, latents, text, torch.tensor([True, True]),
                       torch.Generator().manual_seed(0), base_model=base)
    assert reg.item() == 0.0
    plain = compute_loss(config, adapter, fresh, latents, text, torch.tensor([False, False]),
                         torch.Generator().manual_seed(0), base_model=base)
    assert plain.item() > 0.1


def test_full_fine_tune_never_trains_regularisation_data_as_ordinary_data(full_setup):
    config, adapter, trained, _, text = full_setup
    with pytest.raises(ValueError, match="is_regularisation_data: a full fine-tune"):
        compute_loss(config, adapter, trained, torch.randn(2, 4, 8, 8), text, torch.tensor([True, False]),
                     torch.Generator().manual_seed(0))


def test_regularisation_base_is_built_only_where_it_acts(full_setup):
    from simpletuner.training.trainer import build_regularisation_base

    _, adapter, _, base, text = full_setup
    plain = namespace(image_datasets=[namespace(is_regularisation_data=False)])
    assert build_regularisation_base(flux_config(model_type="full"), adapter, plain, torch.device("cpu")) is None
    assert build_regularisation_base(flux_config(), adapter, REGULARISATION, torch.device("cpu")) is None  # LoRA


def test_regularisation_base_offloaded_to_the_cpu_predicts_the_same(full_setup):
    """``regularisation_base_device: cpu`` keeps the copy behind diffusers' group-offload hooks (each block onloaded
    while it runs); its prediction is the resident copy's."""
    from simpletuner.training.offload import group_offload_enabled
    from simpletuner.training.trainer import build_regularisation_base

    _, adapter, _, base, text = full_setup
    config = flux_config(model_type="full", regularisation_base_device="cpu")
    offloaded = build_regularisation_base(config, adapter, REGULARISATION, torch.device("cpu"))
    assert group_offload_enabled(offloaded) and not group_offload_enabled(base)
    latents, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(6)), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        assert torch.equal(adapter.predict(offloaded, latents, t, text), adapter.predict(base, latents, t, text))


def test_lora_gradients_flow_only_into_lora_weights(setup):
    config, adapter, transformer, text = setup
    transformer.zero_grad(set_to_none=True)
    loss = compute_loss(config, adapter, transformer, torch.randn(2, 4, 8, 8), text, torch.tensor([False, False]),
                        torch.Generator().manual_seed(1))
    loss.backward()
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in n for n in with_grad)


def test_steps_from_epochs_or_steps():
    cfg = namespace(max_train_steps=0, num_train_epochs=3, gradient_accumulation_steps=2)
    assert total_train_steps(cfg, batches_per_epoch=10, world_size=1) == (15, 3)
    cfg = namespace(max_train_steps=7, num_train_epochs=0, gradient_accumulation_steps=1)
    assert total_train_steps(cfg, batches_per_epoch=5, world_size=1) == (7, 2)
    assert total_train_steps(cfg, batches_per_epoch=5, world_size=2) == (7, 4)


def test_weight_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert weight_dtype_for(namespace(mixed_precision="no", base_model_default_dtype="bf16"), cuda) == torch.float32
    assert weight_dtype_for(namespace(mixed_precision="bf16", base_model_default_dtype="bf16"), cuda) == torch.bfloat16
    assert weight_dtype_for(namespace(mixed_precision="bf16", base_model_default_dtype="fp32"), cuda) == torch.float32
    assert weight_dtype_for(namespace(mixed_precision="fp16", base_model_default_dtype="bf16"), cpu) == torch.float32


def test_init_lora_starts_from_an_existing_lora(setup, tmp_path):
    from simpletuner.training.lora import lora_state_dict

    config, adapter, transformer, _ = setup
    state = {k: torch.randn_like(v) for k, v in lora_state_dict(transformer).items()}
    adapter.save_lora(state, tmp_path)
    fresh = adapter.load_transformer()
    add_lora(fresh, adapter, flux_config(lora_dropout=0.0, init_lora=str(tmp_path / "pytorch_lora_weights.safetensors")))
    loaded = lora_state_dict(fresh)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def test_init_lora_of_another_shape_is_refused(setup, tmp_path):
    config, adapter, transformer, _ = setup
    from simpletuner.training.lora import lora_state_dict

    state = {k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in lora_state_dict(transformer).items()}
    adapter.save_lora(state, tmp_path)
    with pytest.raises(Exception, match="size|shape"):
        add_lora(adapter.load_transformer(), adapter,
                 flux_config(init_lora=str(tmp_path / "pytorch_lora_weights.safetensors")))


def test_init_lora_is_never_unpickled(setup, tmp_path):
    """A pickled "LoRA" (which could run code when loaded) is refused by name; only safetensors are read."""
    import os

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    planted = tmp_path / "lora.safetensors"
    torch.save({"transformer.x.lora_A.weight": RunsCode()}, planted)
    _, adapter, _, _ = setup
    with pytest.raises(ValueError, match=f"init_lora: {planted} is not a readable .safetensors file"):
        add_lora(adapter.load_transformer(), adapter, flux_config(init_lora=str(planted)))
    assert not (tmp_path / "pwned").exists()


def _spy_predictions(adapter, monkeypatch) -> list[torch.Tensor]:
    """Record every prediction ``adapter.predict`` returns, keeping its gradient."""
    preds = []
    original = adapter.predict

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        if out.requires_grad:
            out.retain_grad()
        preds.append(out)
        return out

    monkeypatch.setattr(adapter, "predict", spy)
    return preds


def test_masked_loss_gives_latents_outside_the_mask_no_gradient(setup, monkeypatch):
    config, adapter, transformer, text = setup
    mask = torch.zeros(2, 1, 8, 8)
    mask[0, :, :4, :4] = 1.0
    mask[1, :, 4:, 2:] = 1.0
    preds = _spy_predictions(adapter, monkeypatch)
    transformer.zero_grad(set_to_none=True)
    loss = compute_loss(config, adapter, transformer, torch.randn(2, 4, 8, 8), text, torch.tensor([False, False]),
                        torch.Generator().manual_seed(2), mask=mask)
    loss.backward()
    grad = preds[-1].grad
    outside = (mask == 0).expand_as(grad)
    assert torch.all(grad[outside] == 0) and torch.all(grad[~outside] != 0)
    # the LoRA still learns (from the masked-in latents only)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in transformer.named_parameters() if "lora_" in n)


def test_tread_never_routes_masked_tokens_out(setup):
    from simpletuner.training.tread import apply_tread

    config, adapter, transformer, text = setup
    handle = apply_tread(transformer, [{"selection_ratio": 0.75, "start_layer_idx": 1, "end_layer_idx": 4}],
                         adapter.tread_layout(transformer), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(3)
    dropped_without_force = 0
    try:
        transformer.train()
        for _ in range(6):
            mask = (torch.rand(2, 1, 8, 8, generator=g) > 0.9).float()
            forced = set(adapter.image_token_mask(mask > 0, text).any(0).nonzero().flatten().tolist())
            assert forced  # the draw masked something in
            for with_mask in (True, False):
                compute_loss(config, adapter, transformer, torch.randn(2, 4, 8, 8, generator=g), text,
                             torch.tensor([False, False]), torch.Generator().manual_seed(4),
                             mask=mask if with_mask else None)
                kept = set(handle.last_selection[0][0].tolist())
                assert len(kept) < 16  # the route did drop tokens
                if with_mask:
                    assert forced <= kept
                else:
                    dropped_without_force += not forced <= kept
        assert dropped_without_force  # without the mask the router does drop some of those tokens
    finally:
        handle.remove()
        transformer.eval()


@pytest.mark.parametrize("extra", [{}, {"lora_type": "lycoris", "lycoris_config": {"algo": "lokr", "factor": 4}}],
                         ids=["lora", "lycoris"])
def test_the_initial_adapter_is_the_seeds_whatever_drew_before(tiny_flux_path, extra):
    """The same seed gives the same initial LoRA (LyCORIS) even when something drew from torch's global generator
    in between (imports and loaders do, once per process), and the run's own draws after it are not shifted."""
    from simpletuner.training.trainer import build_transformer

    accelerator = namespace(device=torch.device("cpu"))

    def initial(seed: int) -> dict[str, torch.Tensor]:
        config = flux_config(seed=seed, lora_dropout=0.0, **extra)
        model = build_transformer(config, FluxAdapter(config), accelerator, torch.Generator().manual_seed(0))
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    torch.manual_seed(123)
    untouched = torch.rand(4)
    torch.manual_seed(123)
    first = initial(0)
    assert torch.equal(torch.rand(4), untouched)  # attaching it drew nothing from the global generator
    torch.rand(1000)  # what a first-time import or loader would draw
    second = initial(0)
    assert first.keys() == second.keys() and first
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = initial(1)
    assert any(not torch.equal(first[k], other[k]) for k in first)
