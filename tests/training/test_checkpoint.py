from __future__ import annotations

import json
import threading

import pytest
import torch

from simpletuner.training import checkpoint as ckpt
from simpletuner.training.state import RunState


def _parts(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def _state(step, seed=1, **position):
    state = RunState(generator=torch.Generator().manual_seed(seed), global_step=step, **position)
    return state


def test_save_rotate_and_resolve_latest(tmp_path):
    model, opt, sched = _parts()
    for step in (5, 10, 15):
        ckpt.save_checkpoint(tmp_path, _state(step, batch_in_epoch=step), trainable=dict(model.named_parameters()),
                             optimizer=opt, lr_scheduler=sched, total_limit=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-15"]
    assert ckpt.resolve_resume(tmp_path, "latest").name == "checkpoint-15"
    assert ckpt.resolve_resume(tmp_path, "checkpoint-10").name == "checkpoint-10"
    assert ckpt.resolve_resume(tmp_path / "empty", "latest") is None
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint"):
        ckpt.resolve_resume(tmp_path, "checkpoint-99")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_incomplete_folders_are_ignored_and_removed_at_start(tmp_path):
    (tmp_path / "checkpoint-50").mkdir()  # no training_state.json: a crash mid-write in an older version
    (tmp_path / ".checkpoint-60-abc").mkdir()  # an older version's temp folder
    (tmp_path / ".checkpoint-70.tmp").mkdir()
    (tmp_path / ".checkpoint-70.tmp" / "rng.pt").write_bytes(b"half")
    assert ckpt.list_checkpoints(tmp_path) == []
    removed = ckpt.remove_incomplete(tmp_path)
    assert sorted(p.name for p in removed) == [".checkpoint-60-abc", ".checkpoint-70.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-50"]


def test_restore_brings_back_optimizer_rng_and_position(tmp_path):
    model, opt, sched = _parts()
    state = _state(7, seed=3, epoch=2, batch_in_epoch=1)
    state.record_step(0.5)  # step 8, last/best loss recorded
    torch.manual_seed(9)
    path = ckpt.save_checkpoint(tmp_path, state, trainable=dict(model.named_parameters()), optimizer=opt,
                                lr_scheduler=sched, total_limit=None)
    expected = (torch.rand(3), torch.rand(3, generator=state.generator))
    model2, opt2, sched2 = _parts(seed=1)
    resumed = _state(0, seed=0)
    weights = ckpt.load_checkpoint(path, resumed, optimizer=opt2, lr_scheduler=sched2)
    assert (resumed.global_step, resumed.epoch, resumed.batch_in_epoch) == (8, 2, 1)
    assert resumed.last_loss == 0.5 and resumed.best_loss == 0.5
    assert torch.equal(weights["weight"], model.weight.detach())
    assert torch.equal(torch.rand(3), expected[0]) and torch.equal(torch.rand(3, generator=resumed.generator),
                                                                   expected[1])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    meta = json.loads((path / "training_state.json").read_text())
    assert meta["global_step"] == 8 and meta["world_size"] == 1 and "sharding" not in meta


def test_damaged_training_state_names_the_file(tmp_path):
    model, opt, sched = _parts()
    path = ckpt.save_checkpoint(tmp_path, _state(3), trainable=dict(model.named_parameters()), optimizer=opt,
                                lr_scheduler=sched, total_limit=None)
    (path / "training_state.json").write_text("")
    with pytest.raises(ckpt.CheckpointDamaged, match=r"checkpoint-3/training_state.json: empty or damaged"):
        ckpt.load_checkpoint(path, _state(0), optimizer=opt, lr_scheduler=sched)


class PerRankOptimizer:
    """Stands in for sharding.FsdpRun in the checkpoint protocol: each rank writes its own optimizer state (the
    real one is proven across gloo processes in test_sharding.py)."""

    kind = "fsdp"

    def __init__(self, opt, rank, world):
        self.opt, self.rank, self.world = opt, rank, world

    def save(self, folder):
        torch.save(self.opt.state_dict(), folder / f"optimizer-rank{self.rank}.pt")

    def describe(self, folder):
        files = {p.name: p.stat().st_size for p in folder.iterdir() if p.name.startswith("optimizer-rank")}
        return {"kind": self.kind, "state_dict_type": "SHARDED_STATE_DICT", "world_size": self.world, "files": files}


def _as_ranks(world, save):
    """``save(rank, barrier)`` on every rank together: threads standing in for processes, a barrier for
    accelerate's; a rank that fails aborts the barrier, and its error is raised here."""
    barrier = threading.Barrier(world)
    errors = []

    def rank(r):
        try:
            save(r, barrier.wait)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _save_as_ranks(tmp_path, world, sharded):
    """Every rank saves together."""
    parts = [_parts(seed=r) for r in range(world)]
    states = [_state(4, seed=10 + r, batch_in_epoch=2) for r in range(world)]

    def save(r, barrier):
        model, opt, sched = parts[r]
        ckpt.save_checkpoint(tmp_path, states[r], trainable=dict(model.named_parameters()) if r == 0 else None,
                             optimizer=opt, lr_scheduler=sched, total_limit=None, rank=r, world_size=world,
                             barrier=barrier, shards=PerRankOptimizer(opt, r, world) if sharded else None)

    _as_ranks(world, save)
    return parts, states


def test_sharded_state_is_written_by_every_rank_and_recorded(tmp_path):
    _save_as_ranks(tmp_path, world=2, sharded=True)
    path = tmp_path / "checkpoint-4"
    # each rank wrote its part; the main process wrote no whole weights or optimizer beside them
    assert sorted(p.name for p in path.iterdir()) == [
        "optimizer-rank0.pt", "optimizer-rank1.pt", "rng-rank1.pt", "rng.pt", "scheduler.pt", "training_state.json"]
    sharding = json.loads((path / "training_state.json").read_text())["sharding"]
    assert sharding["world_size"] == 2
    assert sharding["files"] == {f"optimizer-rank{r}.pt": (path / f"optimizer-rank{r}.pt").stat().st_size
                                 for r in range(2)}
    _, opt, sched = _parts()
    with pytest.raises(ValueError, match="shards of 2 processes; resume it with 2 processes"):
        ckpt.load_checkpoint(path, _state(0), optimizer=opt, lr_scheduler=sched, world_size=1,
                             shards=PerRankOptimizer(opt, 0, 1))
    with pytest.raises(ValueError, match="sharded state of a fsdp run with 2 processes.*simpletuner consolidate"):
        ckpt.load_checkpoint(path, _state(0), optimizer=opt, lr_scheduler=sched, world_size=2)


def test_an_unsharded_checkpoint_is_refused_by_a_sharded_run(tmp_path):
    model, opt, sched = _parts()
    path = ckpt.save_checkpoint(tmp_path, _state(3), trainable=dict(model.named_parameters()), optimizer=opt,
                                lr_scheduler=sched, total_limit=None)
    with pytest.raises(ValueError, match="written by a run without sharding"):
        ckpt.load_checkpoint(path, _state(0), optimizer=opt, lr_scheduler=sched, shards=PerRankOptimizer(opt, 0, 1))


def test_replicated_optimizer_is_saved_once(tmp_path):
    _save_as_ranks(tmp_path, world=2, sharded=False)
    names = sorted(p.name for p in (tmp_path / "checkpoint-4").iterdir())
    assert "optimizer.pt" in names and not any(n.startswith("optimizer-rank") for n in names)
    with pytest.raises(FileNotFoundError, match="no RNG state for process 2"):
        ckpt.load_checkpoint(tmp_path / "checkpoint-4", _state(0), optimizer=_parts()[1], lr_scheduler=_parts()[2],
                             rank=2, world_size=3)


def _save(root, step, model, opt, sched, seed=1):
    return ckpt.save_checkpoint(root, _state(step, seed=seed, batch_in_epoch=step), trainable=dict(model.named_parameters()),
                                optimizer=opt, lr_scheduler=sched, total_limit=None)


def _resume(root, which="latest"):
    model, opt, sched = _parts()
    state = _state(0)
    found = ckpt.resume(root, which, state, optimizer=opt, lr_scheduler=sched)
    return None if found is None else (*found, state)


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
    _save(tmp_path, 5, model, opt, sched)
    newest = _save(tmp_path, 10, model, opt, sched)
    damage(newest)
    with caplog.at_level("WARNING"):
        path, weights, state = _resume(tmp_path)
    assert path.name == "checkpoint-5" and state.global_step == 5 and state.batch_in_epoch == 5
    assert str(newest) in caplog.text  # the warning names the damaged file


def test_a_damaged_rank_file_is_judged_alike_by_every_rank(tmp_path):
    """Rank 0 reads rank 1's RNG file too: a checkpoint one rank cannot resume is skipped by all."""
    model, opt, sched = _parts()
    _save_as_ranks(tmp_path, world=2, sharded=False)
    newest = max(ckpt.list_checkpoints(tmp_path), key=lambda p: int(p.name.split("-")[1]))
    _truncate(newest / "rng-rank1.pt")
    for rank in (0, 1):
        found = ckpt.resume(tmp_path, "latest", _state(0), optimizer=_parts()[1], lr_scheduler=_parts()[2],
                            rank=rank, world_size=2)
        assert found is None or found[0] != newest


def test_a_damaged_named_checkpoint_is_an_error_naming_the_file(tmp_path):
    model, opt, sched = _parts()
    path = _save(tmp_path, 5, model, opt, sched)
    (path / "training_state.json").write_text("")
    with pytest.raises(ckpt.CheckpointDamaged, match=str(path / "training_state.json")):
        _resume(tmp_path, str(path))


def test_every_checkpoint_damaged_means_a_fresh_start(tmp_path):
    model, opt, sched = _parts()
    _truncate(_save(tmp_path, 5, model, opt, sched) / "trainable.safetensors")
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
    path = _save(tmp_path, 5, model, opt, sched)
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [], "x": _RunsCode(marker)}, path / "optimizer.pt")
    with pytest.raises(ckpt.CheckpointDamaged, match="optimizer.pt"):
        _resume(tmp_path, str(path))
    with pytest.raises(ckpt.CheckpointDamaged, match="optimizer.pt"):  # the function every resume goes through
        ckpt.load_checkpoint(path, _state(0), optimizer=opt, lr_scheduler=sched)
    assert _resume(tmp_path) is None  # 'latest' skips it as damaged
    assert not marker.exists()


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
from simpletuner.training.state import RunState
model = torch.nn.Linear(3, 2)
opt = torch.optim.AdamW(model.parameters())
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
for step in (5, 10):
    ckpt.save_checkpoint({str(tmp_path)!r}, RunState(generator=torch.Generator(), global_step=step),
                         trainable=dict(model.named_parameters()), optimizer=opt, lr_scheduler=sched, total_limit=None)
"""
    env = {**os.environ, "SIMPLETUNER_FAILPOINT": "checkpoint.save:10",
           "SIMPLETUNER_FAILPOINT_ONCE": str(tmp_path / "fired")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr
    assert (tmp_path / ".checkpoint-10.tmp").is_dir() and not (tmp_path / "checkpoint-10").exists()
    assert [p.name for p in ckpt.remove_incomplete(tmp_path)] == [".checkpoint-10.tmp"]
    path, _, state = _resume(tmp_path)
    assert path.name == "checkpoint-5" and state.global_step == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-5", "fired"]


def test_extra_networks_and_states_round_trip_and_a_missing_one_is_named(tmp_path):
    """A recipe with a second network (distillation's critic) saves its weights, optimizer and schedule beside the
    first one's, and resume restores all of them, or none when one is missing."""
    model, opt, sched = _parts()
    critic, critic_opt, critic_sched = _parts(seed=4)
    path = ckpt.save_checkpoint(tmp_path, _state(3), trainable=dict(model.named_parameters()), optimizer=opt,
                                lr_scheduler=sched, total_limit=None,
                                extra_trainable={"critic": dict(critic.named_parameters())},
                                extra_states={"critic_optimizer": critic_opt.state_dict(),
                                              "critic_scheduler": critic_sched.state_dict()})
    assert {"trainable-critic.safetensors", "critic_optimizer.pt", "critic_scheduler.pt"} <= {
        p.name for p in path.iterdir()}
    loaded = {}
    fresh_model, fresh_opt, fresh_sched = _parts(seed=7)
    _, fresh_critic_opt, fresh_critic_sched = _parts(seed=8)
    state = _state(0)
    resumed = ckpt.resume(tmp_path, "latest", state, optimizer=fresh_opt, lr_scheduler=fresh_sched,
                          extra_trainable={"critic": lambda weights, source: loaded.update(weights=weights,
                                                                                            source=source)},
                          extra_states={"critic_optimizer": fresh_critic_opt, "critic_scheduler": fresh_critic_sched})
    assert resumed[0] == path and state.global_step == 3
    assert torch.equal(loaded["weights"]["weight"], critic.weight.detach())
    assert loaded["source"].endswith("trainable-critic.safetensors")
    saved = critic_opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_critic_opt.state_dict()["state"][0]["exp_avg"], saved)
    (path / "critic_optimizer.pt").unlink()
    with pytest.raises(ckpt.CheckpointDamaged, match="critic_optimizer.pt: missing"):
        ckpt.load_checkpoint(path, _state(0), optimizer=fresh_opt, lr_scheduler=fresh_sched,
                             extra_states={"critic_optimizer": fresh_critic_opt})
    with pytest.raises(ValueError, match="not a plain lowercase name"):
        ckpt.save_checkpoint(tmp_path, _state(4), trainable={}, optimizer=opt, lr_scheduler=sched, total_limit=None,
                             extra_states={"optimizer": {}})


# ---- edges the mutation run found unguarded (docs/testing.md) ------------------------------------------------
def test_python_and_numpy_random_continue_where_they_were_saved(tmp_path):
    """Every process's Python and NumPy RNG come back too (data order and augmentation draw from them)."""
    import random

    import numpy as np

    model, opt, sched = _parts()
    random.seed(11)
    np.random.seed(12)
    random.random(), np.random.normal()  # a cached Gaussian in NumPy's state, too
    path = _save(tmp_path, 5, model, opt, sched)
    expected = (random.random(), random.gauss(0, 1), np.random.rand(3), np.random.normal())
    random.seed(0)
    np.random.seed(0)
    ckpt.load_checkpoint(path, _state(0), optimizer=opt, lr_scheduler=sched)
    got = (random.random(), random.gauss(0, 1), np.random.rand(3), np.random.normal())
    assert got[:2] == expected[:2] and np.array_equal(got[2], expected[2]) and got[3] == expected[3]


def test_checkpoints_sort_by_step_number_not_by_name(tmp_path):
    model, opt, sched = _parts()
    for step in (9, 100, 20):
        _save(tmp_path, step, model, opt, sched)
    (tmp_path / "checkpoint-7").write_text("a file, not a checkpoint folder")
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / "checkpoint-300\n").mkdir()  # not ours: rotation must never delete it
    (tmp_path / "checkpoint-300\n" / "training_state.json").write_text("{}")
    (tmp_path / "not-checkpoint-500").mkdir()
    (tmp_path / "not-checkpoint-500" / "training_state.json").write_text("{}")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-9", "checkpoint-20", "checkpoint-100"]
    assert ckpt.resolve_resume(tmp_path, "latest").name == "checkpoint-100"
    assert ckpt.resolve_resume(tmp_path, "") is None and ckpt.resolve_resume(tmp_path, None) is None
    assert ckpt.resume(tmp_path, None, _state(0), optimizer=opt, lr_scheduler=sched) is None
    _save(tmp_path, 5, model, opt, sched)
    ckpt.save_checkpoint(tmp_path, _state(200), trainable=dict(model.named_parameters()), optimizer=opt,
                         lr_scheduler=sched, total_limit=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-100", "checkpoint-200"]
    assert (tmp_path / "checkpoint-300\n").is_dir()


def test_remove_incomplete_keeps_everything_else(tmp_path, caplog):
    assert ckpt.remove_incomplete(tmp_path / "missing") == []
    for name in ("checkpoint-5", ".checkpoint-6", ".checkpoint-x.tmp", "checkpoint-7.tmp", ".other"):
        (tmp_path / name).mkdir()
    (tmp_path / ".checkpoint-8.tmp").write_text("a file")
    (tmp_path / ".checkpoint-9.tmp").mkdir()
    with caplog.at_level("WARNING", logger="simpletuner.checkpoint"):
        assert [p.name for p in ckpt.remove_incomplete(tmp_path)] == [".checkpoint-9.tmp"]
    assert caplog.messages == [f"removed {tmp_path / '.checkpoint-9.tmp'}, left by a crash during a checkpoint save"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".checkpoint-6", ".checkpoint-8.tmp", ".checkpoint-x.tmp", ".other", "checkpoint-5", "checkpoint-7.tmp"]


def test_a_relative_checkpoint_is_read_from_the_working_dir_first(tmp_path, monkeypatch):
    model, opt, sched = _parts()
    here, out = tmp_path / "here", tmp_path / "out"
    _save(here, 5, model, opt, sched)
    _save(out, 5, model, opt, sched)
    _save(out, 6, model, opt, sched)
    monkeypatch.chdir(here)
    assert ckpt.resolve_resume(out, "checkpoint-5") == ckpt.Path("checkpoint-5")  # the one in the working dir
    assert ckpt.resolve_resume(out, "checkpoint-6") == out / "checkpoint-6"  # not there: output_dir's
    assert ckpt.resolve_resume(here, str(out / "checkpoint-6")) == out / "checkpoint-6"


def test_saving_the_same_step_again_replaces_it(tmp_path):
    model, opt, sched = _parts()
    _save(tmp_path, 5, model, opt, sched, seed=1)
    with torch.no_grad():
        model.weight.add_(1.0)
    path = _save(tmp_path, 5, model, opt, sched, seed=2)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-5"]
    assert torch.equal(ckpt.load_file(path / "trainable.safetensors")["weight"], model.weight.detach())


def test_a_save_that_fails_leaves_nothing_behind(tmp_path):
    model, opt, sched = _parts()

    def fails(folder):
        assert (folder / "scheduler.pt").is_file() and folder.name == ".checkpoint-5.tmp"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, _state(5), trainable=dict(model.named_parameters()), optimizer=opt,
                             lr_scheduler=sched, total_limit=None, extra=fails)
    assert list(tmp_path.iterdir()) == []


def test_extra_files_are_published_with_the_checkpoint(tmp_path):
    model, opt, sched = _parts()
    path = ckpt.save_checkpoint(tmp_path, _state(5), trainable=dict(model.named_parameters()), optimizer=opt,
                                lr_scheduler=sched, total_limit=None,
                                extra=lambda folder: (folder / "pytorch_lora_weights.safetensors").write_text("x"))
    assert (path / "pytorch_lora_weights.safetensors").read_text() == "x"


@pytest.mark.parametrize("name", ["optimizer", "scheduler", "rng", "ema", "trainable", "Critic", "1critic",
                                  "critic-opt", "../critic", "", "critic\n"])
def test_part_names_must_be_plain_and_their_own(tmp_path, name):
    model, opt, sched = _parts()
    for kwargs in ({"extra_states": {name: {}}}, {"extra_trainable": {name: {}}}):
        with pytest.raises(ValueError, match="not a plain lowercase name of its own"):
            ckpt.save_checkpoint(tmp_path, _state(4), trainable={}, optimizer=opt, lr_scheduler=sched,
                                 total_limit=None, **kwargs)
    assert list(tmp_path.iterdir()) == []
    ckpt.save_checkpoint(tmp_path, _state(4), trainable={}, optimizer=opt, lr_scheduler=sched, total_limit=None,
                         extra_states={"critic_2": {}})


class _Ema:
    def __init__(self):
        self.loaded = None

    def load_state_dict(self, state, source):
        self.loaded = (state, source)


def test_the_ema_round_trips_and_is_only_restored_when_asked(tmp_path):
    model, opt, sched = _parts()
    ema_state = {"shadow_params": [torch.ones(2, 3)], "optimization_step": 7}
    path = ckpt.save_checkpoint(tmp_path, _state(5), trainable=dict(model.named_parameters()), optimizer=opt,
                                lr_scheduler=sched, total_limit=None, ema_state=ema_state)
    ema = _Ema()
    ckpt.load_checkpoint(path, _state(0), optimizer=opt, lr_scheduler=sched, ema=ema)
    state, source = ema.loaded
    assert state["optimization_step"] == 7 and torch.equal(state["shadow_params"][0], torch.ones(2, 3))
    assert source == str(path / "ema.pt")
    ckpt.load_checkpoint(path, _state(0), optimizer=opt, lr_scheduler=sched)  # no ema: nothing to restore into
    plain = _save(tmp_path, 6, model, opt, sched)
    assert not (plain / "ema.pt").exists()
    ema = _Ema()
    ckpt.load_checkpoint(plain, _state(0), optimizer=opt, lr_scheduler=sched, ema=ema)
    assert ema.loaded is None
    (path / "ema.pt").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointDamaged, match="ema.pt"):
        ckpt.load_checkpoint(path, _state(0), optimizer=opt, lr_scheduler=sched, ema=_Ema())


@pytest.mark.parametrize("content", ['{"epoch": 0, "batch_in_epoch": 0}', '{"global_step": "x", "epoch": 0, '
                                     '"batch_in_epoch": 0}', '{"global_step": 1, "batch_in_epoch": 0}',
                                     '{"global_step": 1, "epoch": 0}', '{"global_step": null, "epoch": 0, '
                                     '"batch_in_epoch": 0}', '[]'])
def test_a_training_state_without_its_position_is_damaged(tmp_path, content):
    model, opt, sched = _parts()
    path = _save(tmp_path, 5, model, opt, sched)
    (path / "training_state.json").write_text(content)
    with pytest.raises(ckpt.CheckpointDamaged, match="training_state.json: empty or damaged"):
        ckpt.read_training_state(path)
    (path / "training_state.json").unlink()
    with pytest.raises(ckpt.CheckpointDamaged, match="training_state.json: empty or damaged"):
        ckpt.read_training_state(path)


def test_a_checkpoint_from_before_world_size_was_recorded_is_one_process(tmp_path):
    model, opt, sched = _parts()
    path = _save(tmp_path, 5, model, opt, sched)
    meta = json.loads((path / "training_state.json").read_text())
    del meta["world_size"]
    (path / "training_state.json").write_text(json.dumps(meta))
    state = _state(0)
    assert torch.equal(ckpt.load_checkpoint(path, state, optimizer=opt, lr_scheduler=sched)["weight"],
                       model.weight.detach())
    assert state.global_step == 5


def test_a_later_rank_reads_its_own_rng_and_every_file_is_named_when_missing(tmp_path):
    parts, states = _save_as_ranks(tmp_path, world=2, sharded=False)
    path = tmp_path / "checkpoint-4"
    saved = ckpt.load_pt(path / "rng-rank1.pt")
    resumed = _state(0, seed=99)
    ckpt.load_checkpoint(path, resumed, optimizer=_parts()[1], lr_scheduler=_parts()[2], rank=1, world_size=2)
    assert torch.equal(resumed.generator.get_state(), saved["generator"])
    assert not torch.equal(saved["generator"], ckpt.load_pt(path / "rng.pt")["generator"])
    for name in ("trainable.safetensors", "optimizer.pt", "scheduler.pt", "rng-rank1.pt"):
        moved = path / name
        moved.rename(tmp_path / name)
        with pytest.raises(ckpt.CheckpointDamaged, match=f"{moved}"):
            ckpt.read_checkpoint(path, rank=0, world_size=2)
        (tmp_path / name).rename(moved)
    with pytest.raises(ckpt.CheckpointDamaged, match=r"optimizer.pt: cannot be read safely \(\w+"):
        (path / "optimizer.pt").write_bytes(b"not a zip")
        ckpt.read_checkpoint(path)


def test_a_damaged_extra_network_is_named(tmp_path):
    model, opt, sched = _parts()
    critic, _, _ = _parts(seed=4)
    path = ckpt.save_checkpoint(tmp_path, _state(3), trainable=dict(model.named_parameters()), optimizer=opt,
                                lr_scheduler=sched, total_limit=None,
                                extra_trainable={"critic": dict(critic.named_parameters())})
    read = ckpt.read_checkpoint(path, extra_trainable=("critic",))
    assert torch.equal(read["extra_trainable"]["critic"]["bias"], critic.bias.detach())
    assert "critic" not in ckpt.read_checkpoint(path)["extra_trainable"]
    _truncate(path / "trainable-critic.safetensors")
    with pytest.raises(ckpt.CheckpointDamaged, match="trainable-critic.safetensors: damaged"):
        ckpt.read_checkpoint(path, extra_trainable=("critic",))
    (path / "trainable-critic.safetensors").unlink()
    with pytest.raises(ckpt.CheckpointDamaged, match="trainable-critic.safetensors: missing"):
        ckpt.read_checkpoint(path, extra_trainable=("critic",))


# ---- what the mutation run of 2026-11-28 found unguarded (docs/testing.md) -----------------------------------
class PerRankEngine(PerRankOptimizer):
    """A sharded run whose engine reads its own files (as sharding.DeepSpeedRun): ``load`` restores this rank's
    optimizer from its own file and records what it was given."""

    kind = "deepspeed"

    def load(self, folder, parts):
        self.loaded = (folder, parts)
        self.opt.load_state_dict(torch.load(folder / f"optimizer-rank{self.rank}.pt", weights_only=True))


def _save_everything_as_ranks(root, world):
    """A sharded checkpoint of ``world`` ranks with an EMA, a critic network and a critic optimizer."""
    parts = [_parts(seed=r) for r in range(world)]
    critic, critic_opt, _ = _parts(seed=5)

    def save(r, barrier):
        _, opt, sched = parts[r]
        extras = {} if r else {"ema_state": {"shadow_params": [torch.full((2,), 3.0)]},
                               "extra_trainable": {"critic": dict(critic.named_parameters())},
                               "extra_states": {"critic_optimizer": critic_opt.state_dict()}}
        ckpt.save_checkpoint(root, _state(4, seed=20 + r, batch_in_epoch=1), trainable=None, optimizer=opt,
                             lr_scheduler=sched, total_limit=None, rank=r, world_size=world, barrier=barrier,
                             shards=PerRankEngine(opt, r, world), **extras)

    _as_ranks(world, save)
    return parts, critic, critic_opt


@pytest.mark.parametrize("which", ["latest", "checkpoint-4"])
def test_resume_hands_every_part_to_its_owner(tmp_path, which):
    """Rank 1 of a sharded two-process run resumes ``latest`` and a named checkpoint alike: its own RNG, the
    engine's shards, the scheduler, the EMA, the critic's weights and optimizer, and the position."""
    parts, critic, critic_opt = _save_everything_as_ranks(tmp_path, world=2)
    path = tmp_path / "checkpoint-4"
    _, opt, sched = _parts(seed=9)
    opt.step()
    sched.step()  # a scheduler that must be put back
    shards, ema, loaded = PerRankEngine(opt, 1, 2), _Ema(), {}
    _, fresh_critic_opt, _ = _parts(seed=8)
    state = _state(0, seed=99)
    found = ckpt.resume(tmp_path, which, state, optimizer=opt, lr_scheduler=sched, rank=1, world_size=2, ema=ema,
                        shards=shards, extra_trainable={"critic": lambda w, source: loaded.update(w=w, source=source)},
                        extra_states={"critic_optimizer": fresh_critic_opt})
    assert found == (path, None)  # a sharded run's weights come back through its shards, not as a dict
    folder, shard_parts = shards.loaded
    assert folder == path and shard_parts == {"kind": "deepspeed", "state_dict_type": "SHARDED_STATE_DICT"}
    saved_opt = parts[1][1].state_dict()["state"][0]["exp_avg"]  # rank 1's own optimizer, not rank 0's
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_opt)
    assert sched.state_dict()["last_epoch"] == parts[1][2].state_dict()["last_epoch"] == 0
    assert torch.equal(state.generator.get_state(), ckpt.load_pt(path / "rng-rank1.pt")["generator"])
    assert (state.global_step, state.batch_in_epoch) == (4, 1)
    assert torch.equal(ema.loaded[0]["shadow_params"][0], torch.full((2,), 3.0)) and ema.loaded[1] == str(
        path / "ema.pt")
    assert torch.equal(loaded["w"]["weight"], critic.weight.detach())
    assert loaded["source"] == f"{path}/trainable-critic.safetensors"
    assert torch.equal(fresh_critic_opt.state_dict()["state"][0]["exp_avg"],
                       critic_opt.state_dict()["state"][0]["exp_avg"])


def test_a_one_process_sharded_run_resumes_with_the_default_world_size(tmp_path):
    _, opt, sched = _parts()
    path = ckpt.save_checkpoint(tmp_path, _state(3), trainable=None, optimizer=opt, lr_scheduler=sched,
                                total_limit=None, shards=PerRankEngine(opt, 0, 1))
    assert ckpt.read_checkpoint(path, shards=PerRankEngine(opt, 0, 1))["state"]["global_step"] == 3
    state = _state(0)
    assert ckpt.load_checkpoint(path, state, optimizer=opt, lr_scheduler=sched, shards=PerRankEngine(opt, 0, 1)) \
        is None and state.global_step == 3
    state = _state(0)
    assert ckpt.resume(tmp_path, "latest", state, optimizer=opt, lr_scheduler=sched,
                       shards=PerRankEngine(opt, 0, 1)) == (path, None) and state.global_step == 3


def test_a_rank_beyond_the_saved_world_and_damaged_files_are_named_whole(tmp_path, caplog):
    model, opt, sched = _parts()
    path = _save(tmp_path, 5, model, opt, sched)
    with pytest.raises(FileNotFoundError) as missing:
        ckpt.read_checkpoint(path, rank=1, world_size=2)
    assert str(missing.value) == (f"resume_from_checkpoint: {path} has no RNG state for process 1 (it was saved by "
                                  "a run with fewer processes)")
    (path / "optimizer.pt").write_bytes(b"not a zip")
    try:
        torch.load(path / "optimizer.pt", weights_only=True)
    except Exception as exc:  # what torch says, first line only
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    with pytest.raises(ckpt.CheckpointDamaged) as damaged:
        ckpt.read_checkpoint(path)
    assert str(damaged.value) == f"{path / 'optimizer.pt'}: cannot be read safely ({why})"
    _truncate(path / "trainable.safetensors")
    with pytest.raises(ckpt.CheckpointDamaged, match=r"/checkpoint-5/trainable\.safetensors: damaged \("):
        ckpt.read_checkpoint(path)
    older = _save(tmp_path, 4, model, opt, sched)
    with caplog.at_level("WARNING", logger="simpletuner.checkpoint"):
        assert ckpt.resume(tmp_path, "latest", _state(0), optimizer=opt, lr_scheduler=sched)[0] == older
    assert caplog.messages == [f"{path / 'trainable.safetensors'}: damaged (" + caplog.messages[0].split(
        ": damaged (", 1)[1]]
    assert caplog.messages[0].endswith("; resuming from the checkpoint before it")


def test_a_save_makes_missing_parents_and_replaces_a_crashed_save_of_its_step(tmp_path):
    model, opt, sched = _parts()
    root = tmp_path / "runs" / "one"
    (root / ".checkpoint-3.tmp").mkdir(parents=True)  # a crash at this step, before
    (root / ".checkpoint-3.tmp" / "stale.pt").write_text("half")
    path = _save(root, 3, model, opt, sched)
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-3"] and not (path / "stale.pt").exists()
    nested = tmp_path / "a" / "b" / "c"
    assert _save(nested, 1, model, opt, sched).parent == nested


def test_the_crash_drill_failpoint_fires_with_the_checkpoint_half_written(tmp_path, monkeypatch):
    """The failpoint the kill -9 drills arm (they SIGKILL there); here it records where it was hit."""
    model, opt, sched = _parts()
    hits = []
    monkeypatch.setattr(ckpt.failpoints, "hit", lambda name, step: hits.append(
        (name, step, sorted(p.name for p in (tmp_path / f".checkpoint-{step}.tmp").iterdir()))))
    _save(tmp_path, 7, model, opt, sched)
    assert hits == [("checkpoint.save", 7, ["optimizer.pt", "rng.pt", "trainable.safetensors"])]


def test_numpy_state_is_saved_as_int64_keys(tmp_path):
    """The RNG file's format: NumPy's 624 uint32 keys as an int64 tensor (what older checkpoints hold too)."""
    keys = ckpt.rng_state(torch.Generator())["numpy"][1]
    assert keys.dtype == torch.int64 and keys.shape == (624,)


def test_a_named_checkpoint_restores_the_optimizer(tmp_path):
    model, opt, sched = _parts()
    _save(tmp_path, 5, model, opt, sched)
    _, fresh_opt, fresh_sched = _parts(seed=3)
    ckpt.resume(tmp_path, "checkpoint-5", _state(0), optimizer=fresh_opt, lr_scheduler=fresh_sched)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
