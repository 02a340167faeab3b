"""What an oversized submit costs the server: its peak memory (VmHWM) before and after a 100 MB POST /api/jobs,
sent once with Content-Length and once chunked.

    python benchmarks/request_limit_bench.py [--mb 100] [--limit-mb 8]

Starts the real ``simpletuner server`` (a uvicorn subprocess, SQLite in a temp dir, scheduler idle). With the
request size limit (8 MiB by default) the body is answered 413 unread; ``--limit-mb 1000`` shows what the same
request cost before there was a limit.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/api/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"server did not start:\n{log.read_text()[-2000:]}")


def peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100, help="size of the oversized body")
    parser.add_argument("--limit-mb", type=int, default=8, help="the server's --max-request-bytes, in MiB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        log = Path(tmp) / "server.log"
        env = {**os.environ, "SIMPLETUNER_API_TOKEN": "bench"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "simpletuner.cli", "server", "--port", str(port), "--data-dir", tmp,
             "--max-request-bytes", str(args.limit_mb * 1024 * 1024), "--log-level", "warning"],
            cwd=tmp, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_healthy(proc, url, log, timeout=60)
            body = {"train_config": {"model_family": "flux", "model_flavour": "tiny", "max_train_steps": 1,
                                     "validation_prompt": "x" * (args.mb * 1024 * 1024)},
                    "data_backends": [{"id": "d", "instance_data_dir": "."},
                                      {"id": "te", "dataset_type": "text_embeds"}]}
            raw = json.dumps(body).encode()
            before = peak_mib(proc.pid)
            with httpx.Client(base_url=url, timeout=600, headers={"Authorization": "Bearer bench"}) as http:
                t0 = time.perf_counter()
                sized = http.post("/api/jobs", content=raw, headers={"Content-Type": "application/json"})
                t_sized = time.perf_counter() - t0
                after_sized = peak_mib(proc.pid)
                try:
                    chunked = http.post("/api/jobs", headers={"Content-Type": "application/json"},
                                        content=(raw[i:i + 262144] for i in range(0, len(raw), 262144))).status_code
                except httpx.TransportError as exc:
                    chunked = f"connection closed by the server ({type(exc).__name__})"
                after_chunked = peak_mib(proc.pid)
                stored = http.get("/api/jobs").json()["total"]
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"{args.mb} MB body, limit {args.limit_mb} MiB")
    print(f"  with Content-Length: HTTP {sized.status_code} in {t_sized:.2f}s; "
          f"server peak RSS {before:.0f} -> {after_sized:.0f} MiB (+{after_sized - before:.0f})")
    print(f"  chunked:             {chunked}; server peak RSS -> {after_chunked:.0f} MiB "
          f"(+{after_chunked - before:.0f} over the start)")
    print(f"  jobs stored: {stored}")


if __name__ == "__main__":
    main()
