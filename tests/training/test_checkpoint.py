from __future__ import annotations

import json

import pytest
import torch

from simpletuner.training import checkpoint as ckpt


def _parts():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def test_save_rotate_and_resolve_latest(tmp_path):
    model, opt, sched = _parts()
    g = torch.Generator().manual_seed(1)
    for step in (5, 10, 15):
        ckpt.save_checkpoint(tmp_path, step, trainable=dict(model.named_parameters()), optimizer=opt,
                             lr_scheduler=sched, generator=g, training_state={"epoch": 0, "batch_in_epoch": step},
                             total_limit=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-15"]
    assert ckpt.resolve_resume(tmp_path, "latest").name == "checkpoint-15"
    assert ckpt.resolve_resume(tmp_path, "checkpoint-10").name == "checkpoint-10"
    assert ckpt.resolve_resume(tmp_path / "empty", "latest") is None
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint"):
        ckpt.resolve_resume(tmp_path, "checkpoint-99")


def test_incomplete_folders_are_ignored(tmp_path):
    (tmp_path / "checkpoint-50").mkdir()  # no training_state.json: a crash mid-write in an older version
    (tmp_path / ".checkpoint-60-abc").mkdir()
    assert ckpt.list_checkpoints(tmp_path) == []


def test_restore_brings_back_optimizer_rng_and_state(tmp_path):
    model, opt, sched = _parts()
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(9)
    path = ckpt.save_checkpoint(tmp_path, 7, trainable=dict(model.named_parameters()), optimizer=opt,
                                lr_scheduler=sched, generator=g, training_state={"epoch": 2, "batch_in_epoch": 1},
                                total_limit=None)
    expected = (torch.rand(3), torch.rand(3, generator=g))
    model2, opt2, sched2 = _parts()
    g2 = torch.Generator().manual_seed(0)
    weights, state = ckpt.load_checkpoint(path, optimizer=opt2, lr_scheduler=sched2, generator=g2)
    assert state == {"epoch": 2, "batch_in_epoch": 1, "global_step": 7}
    assert torch.equal(weights["weight"], model.weight.detach())
    assert torch.equal(torch.rand(3), expected[0]) and torch.equal(torch.rand(3, generator=g2), expected[1])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert json.loads((path / "training_state.json").read_text())["global_step"] == 7
