"""Shared values and request builders for the server tests (import from ``tests.server.helpers``)."""

from __future__ import annotations

from pathlib import Path

from simpletuner.server.settings import ServerSettings

FAKE_TRAINER = Path(__file__).with_name("fake_trainer.py")
LOOPBACK = ("127.0.0.1", 50000)
REMOTE = ("203.0.113.7", 50000)
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
)


def train_config(**extra):
    return {"model_family": "flux", "model_flavour": "tiny", "max_train_steps": 3, **extra}


def data_backends(folder: str = "imgs"):
    return [
        {"id": "d", "type": "local", "instance_data_dir": folder, "caption_strategy": "textfile",
         "resolution": 64, "resolution_type": "pixel", "cache_dir_vae": "cache/vae"},
        {"id": "te", "dataset_type": "text_embeds", "type": "local", "default": True, "cache_dir": "cache/text"},
    ]


def job_body(**extra):
    body = {"train_config": train_config(**extra.pop("train", {})), "data_backends": data_backends()}
    body.update(extra)
    return body


def make_settings(tmp_path: Path, workdir: Path, **overrides) -> ServerSettings:
    values = dict(
        data_dir=tmp_path / "data",
        workdir=workdir,
        token="test-token",
        accelerators=[],
        job_command=["{python}", str(FAKE_TRAINER), "--config", "{config}"],
        poll_interval=0.05,
        heartbeat_interval=0.5,
        cancel_grace=30.0,  # SIGTERM to SIGKILL: the fake trainer flushes its webhooks first, slowly on a busy machine
        stop_jobs_on_shutdown=True,
    )
    values.update(overrides)
    return ServerSettings(**values)
