"""The optimizer registry, optimizer_config, per-group learning rates, schedule-free weights, device refusals and
the EMA helper, on their own (tests/e2e/test_options_e2e.py trains with each)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from simpletuner.config import ConfigError
from simpletuner.config.requirements import OPTIMIZERS as CONFIG_OPTIMIZERS
from simpletuner.training.optimizers import (OPTIMIZERS, build_optimizer, evaluation_weights, optimizer_class,
                                             optimizer_kwargs, param_groups)
from tests.helpers import flux_config


def test_every_config_optimizer_name_has_a_class():
    assert list(OPTIMIZERS) == list(CONFIG_OPTIMIZERS)


def test_optimizer_config_reaches_the_optimizer_and_unknown_keys_are_named():
    config = flux_config(optimizer="prodigy", learning_rate=1.0, optimizer_config="d_coef=0.5,safeguard_warmup=true")
    kwargs = optimizer_kwargs(config, optimizer_class("prodigy"))
    assert kwargs["d_coef"] == 0.5 and kwargs["safeguard_warmup"] is True and kwargs["lr"] == 1.0
    bad = flux_config(optimizer="optimi-lion", optimizer_config="d_coef=0.5")
    with pytest.raises(ValueError, match=r"optimizer_config\.d_coef: 'optimi-lion' \(optimi.*takes no such argument"):
        optimizer_kwargs(bad, optimizer_class("optimi-lion"))
    # adam_* settings go where the optimizer takes them; AdEMAMix gets its third beta
    ademamix = optimizer_kwargs(flux_config(optimizer="ademamix", adam_beta1=0.8), optimizer_class("ademamix"))
    assert ademamix["betas"] == (0.8, 0.999, 0.9999)


def test_preflight_refuses_bitsandbytes_and_bad_kwargs_before_caching(tiny_adapter):
    from simpletuner.training.trainer import preflight

    with pytest.raises(ConfigError, match="optimizer: 'bnb-adamw8bit' uses bitsandbytes' CUDA kernels and this run "
                                          "is on cpu"):
        preflight(flux_config(optimizer="bnb-adamw8bit"), tiny_adapter, torch.device("cpu"))
    with pytest.raises(ValueError, match="optimizer_config.nope"):
        preflight(flux_config(optimizer_config="nope=1"), tiny_adapter, torch.device("cpu"))
    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(ImportError, match=r"pip install 'simpletuner\[bnb\]'"):
            optimizer_class("bnb-lion8bit")


def test_per_group_learning_rates_from_the_family_row():
    model = torch.nn.ModuleDict({"embed": torch.nn.Linear(2, 2), "block": torch.nn.Linear(2, 2)})
    config = flux_config(learning_rate=1e-3)
    groups = param_groups(model, config, lr_scale=(("embed.*", 0.1),))
    assert [g["lr"] for g in groups] == [1e-3, pytest.approx(1e-4)]
    assert [len(g["params"]) for g in groups] == [2, 2]
    optimizer = build_optimizer(flux_config(optimizer="optimi-adamw", learning_rate=1e-3), groups)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, pytest.approx(1e-4)]
    assert len(param_groups(model, config)) == 1  # Flux's row has no multipliers


def test_schedule_free_validates_and_exports_its_averaged_weights():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = build_optimizer(flux_config(optimizer="adamw_schedulefree", learning_rate=0.1), [param])
    optimizer.train()
    for _ in range(3):
        param.grad = torch.ones(3)
        optimizer.step()
    training = param.detach().clone()
    with evaluation_weights(optimizer):
        averaged = param.detach().clone()
    assert not torch.equal(training, averaged)
    assert torch.equal(param.detach(), training)  # back to the training iterate


def test_ema_decay_interval_and_exact_state_round_trip():
    from simpletuner.training.ema import TrainedWeightsEMA

    param = torch.nn.Parameter(torch.zeros(4))
    ema = TrainedWeightsEMA([param], decay=0.5, update_interval=2)
    with torch.no_grad():
        param.fill_(1.0)
    assert not ema.update(1) and torch.equal(ema.ema.shadow_params[0], torch.zeros(4))  # not on an odd step
    assert ema.update(2)
    assert torch.equal(ema.ema.shadow_params[0], torch.ones(4))  # diffusers' warm-up: the first update copies
    with torch.no_grad():
        param.fill_(3.0)
    assert ema.update(4)
    first = ema.ema.shadow_params[0].clone()
    assert 1 < first[0] < 3  # moved part of the way (decay min(0.5, 2/11))
    with ema.swapped_in():
        assert torch.equal(param.detach(), first)
    assert torch.equal(param.detach(), torch.full((4,), 3.0))
    again = TrainedWeightsEMA([param], decay=0.5, update_interval=2)
    again.load_state_dict(ema.state_dict(), "test")
    assert again.ema.optimization_step == 2 and torch.equal(again.ema.shadow_params[0], first)
    with pytest.raises(ValueError, match="do not match"):
        TrainedWeightsEMA([torch.nn.Parameter(torch.zeros(5))], decay=0.5).load_state_dict(ema.state_dict(), "x")
