"""Helpers shared by tests (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import types
from pathlib import Path


def flux_config(**overrides):
    """A TrainConfig for the tiny Flux, validated by the real config schema."""
    from simpletuner.config import load_train_config

    values = {"model_family": "flux", "model_flavour": "tiny", "mixed_precision": "no", "seed": 0,
              "max_train_steps": 10, "data_backend_config": "unused.json"}
    values.update(overrides)
    return load_train_config(values).config


@contextlib.contextmanager
def left_unchanged(adapter=None, model=None, what: str = "a shared fixture"):
    """Around a shared (module- or session-scoped) fixture's ``yield``: fails when a test changed the adapter's
    config or the model's weights, since later tests would then run on what that test left behind."""
    config = adapter.config.model_dump() if adapter is not None else None
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()} if model is not None else None
    yield
    if adapter is not None:
        changed = {k: v for k, v in adapter.config.model_dump().items() if config.get(k) != v}
        assert not changed, f"a test changed {what}'s config (later tests share it): {changed}"
    if model is not None:
        now = model.state_dict()
        changed = sorted(k for k in set(weights) | set(now)
                         if k not in weights or k not in now or not weights[k].equal(now[k]))
        assert not changed, f"a test changed {what}'s weights (later tests share them): {changed[:5]}"


def sample_run(tmp: Path, *, eval_dataset: bool = True, dataset: dict | None = None, **overrides):
    """(config, backends) for a tiny-Flux run in ``tmp``: a copy of the sample dataset at 32 px (its entry updated
    with ``dataset``), an eval dataset of two of its images, caches under ``tmp/cache``; ``overrides`` go to the
    config."""
    import json
    import shutil

    from simpletuner.config import load_data_backends

    repo = Path(__file__).resolve().parents[1]
    images = tmp / "sample"
    if not images.exists():
        shutil.copytree(repo / "datasets" / "sample", images)
        (tmp / "eval").mkdir()
        for name in ("00_orange_circle", "01_red_square"):
            for ext in (".png", ".txt"):
                shutil.copy(images / f"{name}{ext}", tmp / "eval" / f"{name}{ext}")
    values = {"output_dir": str(tmp / "output"), "validation_resolution": "32",
              "validation_num_inference_steps": 2, **overrides}
    config = flux_config(**values)
    backends = [{"id": "sample", "instance_data_dir": str(images), "caption_strategy": "textfile",
                 "resolution": 32, "resolution_type": "pixel", "cache_dir_vae": str(tmp / "cache/vae"),
                 **(dataset or {})},
                {"id": "text", "dataset_type": "text_embeds", "cache_dir": str(tmp / "cache/text")}]
    if eval_dataset:
        backends.insert(1, {"id": "held-out", "dataset_type": "eval", "instance_data_dir": str(tmp / "eval"),
                            "caption_strategy": "textfile", "resolution": 32, "resolution_type": "pixel",
                            "cache_dir_vae": str(tmp / "cache/vae-eval")})
    (tmp / "multidatabackend.json").write_text(json.dumps(backends))
    return config, load_data_backends(backends, config=config)


def namespace(**kwargs):
    return types.SimpleNamespace(**kwargs)


def tiny_flux_transformer(seed: int = 0):
    """A randomly initialised Flux-shaped transformer (2 double + 4 single blocks), built in memory."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )


def flux_transformer_inputs(seed: int = 1, batch: int = 2, img: int = 64, txt: int = 8):
    """Keyword inputs for ``tiny_flux_transformer()``'s forward."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, img, 16, generator=g),
        encoder_hidden_states=torch.randn(batch, txt, 32, generator=g),
        pooled_projections=torch.randn(batch, 32, generator=g),
        timestep=torch.rand(batch, generator=g),
        img_ids=torch.randint(0, 8, (img, 3), generator=g).float(),
        txt_ids=torch.zeros(txt, 3),
        guidance=torch.full((batch,), 3.5),
    )


def free_port() -> int:
    """A TCP port that is free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    """Poll ``url``/api/health until it answers 200; RuntimeError with the log's tail if the server exits or
    ``timeout`` seconds pass first."""
    import httpx

    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(f"{url}/api/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"server did not start; see {log_path}:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)


def get_json_despite_drops(http, path: str, proc: subprocess.Popen, deadline: float, pause: float = 0.05):
    """GET ``path``'s JSON from a test server, asking again when the connection drops as the request goes out (a
    stalled machine can outlast a keep-alive), unless the server process has exited or ``deadline`` has passed."""
    import httpx

    while True:
        try:
            return http.get(path).json()
        except httpx.TransportError:
            if proc.poll() is not None or time.time() > deadline:
                raise
            time.sleep(pause)


class RecordingReporter:
    """Stands in for WebhookReporter: records image and scores events."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.events: list[tuple] = []

    def image(self, kind, step, path, prompt=None, nickname=None, resolution=None, inference_step=None,
              video_path=None, seed=None):
        self.events.append(("image", kind, step, Path(path), nickname, inference_step))
        if video_path is not None:
            self.events.append(("video", kind, step, Path(video_path), nickname))

    def scores(self, step, metrics):
        self.events.append(("scores", step, dict(metrics)))


class CpuAccelerator:
    """The few Accelerator members the evaluator uses, for one CPU process."""

    is_main_process = True
    device = "cpu"

    def unwrap_model(self, model):
        return model

    def wait_for_everyone(self):
        pass

    def autocast(self):
        return contextlib.nullcontext()
