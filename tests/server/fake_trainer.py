"""A stand-in for ``python -m simpletuner.train`` in server tests: reads the frozen config the server wrote,
reports through the real WebhookReporter, and behaves as ``tracker_run_name`` says:

- ``ok`` (default): ``max_train_steps`` progress events, a checkpoint, an image, scores, then success (a cache
  job, ``SIMPLETUNER_JOB_KIND=cache``: a finished manifest and its summary, then success)
- ``fail``: an error event and exit 3
- ``hang``: report running, then sleep until killed (ignores nothing; SIGTERM exits 143 like the trainer)
- ``stubborn``: like hang but ignores SIGTERM (needs SIGKILL), and starts a child in its process group
- ``flood``: ``max_train_steps`` progress events as fast as possible (benchmarks)
- ``resume``: checkpoints like the trainer (each step takes ``$SIMPLETUNER_FAKE_STEP_SECONDS``) (``checkpoint-N`` every ``checkpointing_steps``, continues from the
  newest one when ``resume_from_checkpoint`` is "latest") and kills itself (SIGKILL) at the step that
  ``tracker_project_name`` names: ``crash-at-5`` once per run, ``crash-always-at-5`` on every attempt
"""

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from simpletuner.training.webhooks import WebhookReporter

PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
)


EMPTY_SAFETENSORS = (2).to_bytes(8, "little") + b"{}"  # a whole safetensors file holding no tensors


def resumable(cfg: dict, out: Path, steps: int, reporter) -> int:
    every = int(cfg.get("checkpointing_steps") or 2)
    plan = str(cfg.get("tracker_project_name") or "")
    crash_at = int(plan.rsplit("-", 1)[1]) if plan.startswith("crash-") else None
    done = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "training_state.json").exists())
    start = done[-1] if done and cfg.get("resume_from_checkpoint") == "latest" else 0
    print(f"fake trainer: starting at step {start}", flush=True)
    pause = float(os.environ.get("SIMPLETUNER_FAKE_STEP_SECONDS") or 0)  # e2e drills: time to kill mid-run
    for step in range(start + 1, steps + 1):
        time.sleep(pause)
        with (out / "steps.log").open("a") as fh:
            fh.write(f"{step}\n")
        reporter.progress(step, steps, 1.0 / step, 1e-4, 50.0, 0.0)
        marker = out.parent / f"crashed-{step}"  # beside the output, which a start-over moves aside
        if step == crash_at and (plan.startswith("crash-always") or not marker.exists()):
            marker.write_text("1")
            reporter.close(5)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % every == 0:
            ckpt = out / f"checkpoint-{step}"
            ckpt.mkdir(exist_ok=True)
            (ckpt / "training_state.json").write_text(json.dumps({"global_step": step}))
            reporter.checkpoint(step, ckpt)
    lora = out / "pytorch_lora_weights.safetensors"
    lora.write_bytes(EMPTY_SAFETENSORS)
    summary = {"lora_path": str(lora), "output_dir": str(out), "steps": steps, "started_at_step": start}
    (out / "run_summary.json").write_text(json.dumps(summary))
    reporter.status("succeeded", **summary)
    reporter.close(10)
    return 0


def main() -> int:
    config_path = Path(sys.argv[sys.argv.index("--config") + 1])
    cfg = json.loads(config_path.read_text())
    mode = cfg.get("tracker_run_name") or "ok"
    steps = int(cfg.get("max_train_steps") or 3)
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    reporter = WebhookReporter.from_env(cfg.get("webhook_config"), backoff=0.05)
    print(f"fake trainer: mode={mode} steps={steps} backends={cfg['data_backend_config']}", flush=True)

    def on_term(signum, frame):
        print("fake trainer: SIGTERM, stopping at step boundary", flush=True)
        reporter.status("cancelled")
        reporter.close(5)
        sys.exit(143)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else on_term)
    reporter.status("running", pid=__import__("os").getpid())
    if mode in ("hang", "stubborn"):
        if mode == "stubborn":
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        (out / "started").write_text("1")
        reporter.progress(1, steps, 0.5, 1e-4, 10.0, 100.0)
        while True:
            time.sleep(0.05)
    if mode == "flood":
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            reporter.progress(step, steps, 0.1, 1e-4, 100.0, 0.0)
        reporter.close(120)
        print(f"fake trainer: sent {reporter.sent} in {time.perf_counter() - t0:.3f}s", flush=True)
        return 0
    if mode == "resume":
        return resumable(cfg, out, steps, reporter)
    if mode == "fail":
        try:
            raise RuntimeError("CUDA out of memory (pretend)")
        except RuntimeError as exc:
            reporter.error(str(exc), traceback.format_exc())
            print(traceback.format_exc(), flush=True)
        reporter.status("failed")
        reporter.close(10)
        return 3
    if os.environ.get("SIMPLETUNER_JOB_KIND") == "cache":  # split training's stage 1: a manifest, no model
        manifest = out / "cache_manifest.json"
        manifest.write_text(json.dumps({"format": 1, "complete": True}))
        (out / "cache_summary.json").write_text(json.dumps({"cache_manifest": str(manifest)}))
        reporter.status("succeeded", cache_manifest=str(manifest), output_dir=str(out))
        reporter.close(10)
        return 0
    loss = 1.0
    for step in range(1, steps + 1):
        loss *= 0.9
        time.sleep(0.02)
        reporter.progress(step, steps, loss, 1e-4, 50.0, (steps - step) * 0.02, epoch=1)
        print(f"step {step}/{steps} loss {loss:.4f}", flush=True)
    ckpt = out / f"checkpoint-{steps}"
    ckpt.mkdir(exist_ok=True)
    reporter.checkpoint(steps, ckpt)
    img = out / "validation.png"
    img.write_bytes(PNG)
    reporter.image("validation", steps, img, prompt="a cat", nickname="cat", resolution=(1, 1))
    reporter.scores(steps, {"clip_score": 0.31})
    lora = out / "pytorch_lora_weights.safetensors"
    lora.write_bytes(EMPTY_SAFETENSORS)
    summary = {"final_loss": loss, "lora_path": str(lora), "output_dir": str(out), "steps": steps}
    (out / "run_summary.json").write_text(json.dumps(summary))
    reporter.status("succeeded", **summary)
    reporter.close(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
