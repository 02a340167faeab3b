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


# ---- damaged state (issue 15) ------------------------------------------------------------------------------
def _save(root, step, model, opt, sched, g):
    return ckpt.save_checkpoint(root, step, trainable=dict(model.named_parameters()), optimizer=opt,
                                lr_scheduler=sched, generator=g, training_state={"epoch": 0, "batch_in_epoch": step},
                                total_limit=None)


def _resume(root, which="latest"):
    model, opt, sched = _parts()
    return ckpt.resume(root, which, optimizer=opt, lr_scheduler=sched, generator=torch.Generator())


def _truncate(path, keep=40):
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("damage", [
    lambda c: _truncate(c / "trainable.safetensors"),
    lambda c: _truncate(c / "optimizer.pt"),
    lambda c: (c / "scheduler.pt").write_bytes(b""),
    lambda c: (c / "rng.pt").unlink(),
    lambda c: (c / "training_state.json").write_text(""),
    lambda c: (c / "training_state.json").write_text("{not json"),
], ids=["truncated-weights", "truncated-optimizer", "empty-scheduler", "missing-rng", "empty-state", "corrupt-state"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, damage):
    model, opt, sched = _parts()
    g = torch.Generator().manual_seed(1)
    _save(tmp_path, 5, model, opt, sched, g)
    newest = _save(tmp_path, 10, model, opt, sched, g)
    damage(newest)
    with caplog.at_level("WARNING"):
        path, weights, state = _resume(tmp_path)
    assert path.name == "checkpoint-5" and state["global_step"] == 5
    assert str(newest) in caplog.text  # the warning names the damaged file


def test_a_damaged_named_checkpoint_is_an_error_naming_the_file(tmp_path):
    model, opt, sched = _parts()
    path = _save(tmp_path, 5, model, opt, sched, torch.Generator())
    (path / "training_state.json").write_text("")
    with pytest.raises(ckpt.CheckpointDamaged, match=str(path / "training_state.json")):
        _resume(tmp_path, str(path))


def test_every_checkpoint_damaged_means_a_fresh_start(tmp_path):
    model, opt, sched = _parts()
    _truncate(_save(tmp_path, 5, model, opt, sched, torch.Generator()) / "trainable.safetensors")
    assert _resume(tmp_path) is None


class _RunsCode:
    """A pickle that runs code when loaded (what weights_only=False would do with a planted optimizer.pt)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_resume_never_unpickles_code(tmp_path):
    model, opt, sched = _parts()
    path = _save(tmp_path, 5, model, opt, sched, torch.Generator())
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [], "x": _RunsCode(marker)}, path / "optimizer.pt")
    with pytest.raises(ckpt.CheckpointDamaged, match="optimizer.pt"):
        _resume(tmp_path, str(path))
    assert _resume(tmp_path) is None  # 'latest' skips it as damaged
    assert not marker.exists()


def test_a_crash_during_save_leaves_nothing_after_the_next_start(tmp_path):
    model, opt, sched = _parts()
    _save(tmp_path, 5, model, opt, sched, torch.Generator())
    (tmp_path / ".checkpoint-10-abc123").mkdir()
    (tmp_path / ".checkpoint-10-abc123" / "trainable.safetensors").write_bytes(b"half")
    (tmp_path / ".rng-step10-rank1.pt").write_bytes(b"x")
    path, _, state = _resume(tmp_path)
    assert path.name == "checkpoint-5"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-5"]


def test_write_json_is_atomic(tmp_path):
    target = tmp_path / "run_summary.json"
    ckpt.write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run_summary.json"]


def test_the_save_failpoint_dies_mid_save_and_the_next_start_recovers(tmp_path):
    """A real SIGKILL halfway through writing checkpoint-10 (the crash drill's failpoint) in a child process."""
    import os
    import subprocess
    import sys

    code = f"""
import torch
from simpletuner.training import checkpoint as ckpt
model = torch.nn.Linear(3, 2)
opt = torch.optim.AdamW(model.parameters())
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
for step in (5, 10):
    ckpt.save_checkpoint({str(tmp_path)!r}, step, trainable=dict(model.named_parameters()), optimizer=opt,
                         lr_scheduler=sched, generator=torch.Generator(), training_state={{"epoch": 0, "batch_in_epoch": 0}},
                         total_limit=None)
"""
    env = {**os.environ, "SIMPLETUNER_FAILPOINT": "checkpoint.save:10",
           "SIMPLETUNER_FAILPOINT_ONCE": str(tmp_path / "fired")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".checkpoint-10-")]
    assert len(leftovers) == 1 and not (tmp_path / "checkpoint-10").exists()
    path, _, state = _resume(tmp_path)
    assert path.name == "checkpoint-5" and state["global_step"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-5", "fired"]


def test_loading_a_named_checkpoint_never_unpickles_code(tmp_path):
    """load_checkpoint, the function every resume goes through, with a planted optimizer.pt."""
    model, opt, sched = _parts()
    path = _save(tmp_path, 5, model, opt, sched, torch.Generator())
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [], "x": _RunsCode(marker)}, path / "optimizer.pt")
    with pytest.raises(Exception, match="optimizer.pt"):
        ckpt.load_checkpoint(path, optimizer=opt, lr_scheduler=sched, generator=torch.Generator())
    assert not marker.exists()
