import numpy as np
import pytest
from PIL import Image

from simpletuner.evaluation.trackers import Trackers, logging_dir, tracker_names
from tests.evaluation.readers import tensorboard_image_tags, tensorboard_scalars, wandb_history, wandb_scalars
from tests.helpers import flux_config


def test_names():
    assert tracker_names("none") == [] and tracker_names(None) == []
    assert tracker_names("all") == ["wandb", "tensorboard"]
    assert tracker_names("tensorboard") == ["tensorboard"]
    with pytest.raises(ValueError, match="report_to: 'comet'"):
        tracker_names("comet")


def test_logging_dir_is_under_output_dir_unless_absolute(tmp_path):
    assert logging_dir(flux_config(output_dir=str(tmp_path))) == tmp_path / "logs"
    assert logging_dir(flux_config(output_dir=str(tmp_path), logging_dir="/abs/logs")).as_posix() == "/abs/logs"


def test_none_writes_nothing(tmp_path):
    trackers = Trackers(flux_config(output_dir=str(tmp_path / "out"), report_to="none"))
    trackers.log({"train/loss": 1.0}, 1)
    trackers.close()
    assert not trackers.enabled and not (tmp_path / "out").exists()


def test_tensorboard_and_wandb_offline_hold_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = flux_config(output_dir=str(tmp_path), report_to="all", tracker_run_name="unit",
                         webhook_config={"webhook_type": "raw", "callback_url": "http://127.0.0.1:1/x",
                                         "secret": "do-not-leak"})
    trackers = Trackers(config)
    trackers.log({"train/loss": 0.5, "train/lr": 1e-3}, 1)
    trackers.log({"train/loss": 0.25, "eval/loss": 0.75, "skipped": None}, 2)
    image = Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8))
    trackers.log_images({"validation/a_16x16": image}, 2, captions={"validation/a_16x16": "a prompt"})
    trackers.close()

    tb = tensorboard_scalars(tmp_path / "logs" / "tensorboard" / "unit")
    assert tb["train/loss"] == {1: 0.5, 2: 0.25} and tb["eval/loss"] == {2: 0.75}
    assert "skipped" not in tb
    assert tensorboard_image_tags(tmp_path / "logs") == {"validation/a_16x16"}

    (run,) = (tmp_path / "logs" / "wandb").glob("offline-run-*")
    wb = wandb_scalars(run)
    assert wb["train/loss"] == {1: 0.5, 2: 0.25} and wb["train/lr"] == {1: 1e-3} and wb["eval/loss"] == {2: 0.75}
    assert any("validation/a_16x16" in key for row in wandb_history(run) for key in row)
    assert b"do-not-leak" not in (run / next(p.name for p in run.glob("run-*.wandb"))).read_bytes()


def test_wandb_failing_to_start_says_how_to_go_offline(tmp_path, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(RuntimeError, match=r"report_to: wandb could not start \(WANDB_MODE=online\): No API key "
                                           r"configured.*set WANDB_MODE=offline"):
        Trackers(flux_config(output_dir=str(tmp_path), report_to="wandb"))
