"""Training-server benchmark: start time, idle memory, submit -> subprocess-started latency, webhook ingestion rate.

    python benchmarks/server_bench.py [--jobs 10] [--events 2000] [--senders 4]

Starts the real ``simpletuner server`` (a uvicorn subprocess on a free loopback port, SQLite in a temp dir)
with the job command replaced by tiny stand-ins, so nothing here needs torch: the numbers are the server's own.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

FLOOD_JOB = r'''
import sys, time
from simpletuner.training.webhooks import WebhookReporter
n = int(sys.argv[1])
r = WebhookReporter.from_env(max_queue=n + 10)
t0 = time.perf_counter()
for step in range(1, n + 1):
    r.progress(step, n, 0.1, 1e-4, 100.0, 0.0)
ok = r.close(600)
dt = time.perf_counter() - t0
open(sys.argv[2], "w").write(f"{r.sent} {dt} {ok}")
'''

STARTED_JOB = r'''
import sys, time
open(sys.argv[1], "w").write(repr(time.time()))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    def __init__(self, workdir: Path, job_command: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIMPLETUNER_")}
        env["SIMPLETUNER_SERVER_JOB_COMMAND"] = json.dumps(job_command)
        self.cmd = [sys.executable, "-m", "simpletuner.cli", "server", "--port", str(self.port), "--data-dir",
                    str(workdir / "data"), "--token", "bench", "--log-level", "warning", "--max-concurrent", "1"]
        self.env = env
        self.workdir = workdir

    def start(self) -> float:
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, cwd=self.workdir, env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while True:
            try:
                if httpx.get(f"{self.url}/api/health", timeout=0.5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit("server exited during start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def job_body(**extra) -> dict:
    return {
        "train_config": {"model_family": "flux", "model_flavour": "tiny", "max_train_steps": 1},
        "data_backends": [
            {"id": "d", "type": "local", "instance_data_dir": "imgs", "resolution": 64, "resolution_type": "pixel"},
            {"id": "te", "dataset_type": "text_embeds", "type": "local", "default": True, "cache_dir": "cache"},
        ],
        **extra,
    }


def wait_finished(http: httpx.Client, job_id: int, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = http.get(f"/api/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.02)
    raise SystemExit(f"job {job_id} did not finish")


def bench_latency(workdir: Path, jobs: int) -> dict:
    script = workdir / "started_job.py"
    script.write_text(STARTED_JOB)
    server = Server(workdir, ["{python}", str(script), "{run_dir}/started"])
    start_s = server.start()
    time.sleep(2.0)
    idle_rss = rss_mib(server.proc.pid)
    http = httpx.Client(base_url=server.url, timeout=30)
    http.post("/api/jobs", json=job_body())  # warm-up (first request, first claim)
    wait_finished(http, 1)
    to_popen, to_running_code = [], []
    try:
        for _ in range(jobs):
            t0 = time.time()
            job = http.post("/api/jobs", json=job_body()).json()
            done = wait_finished(http, job["id"])
            started = float((Path(done["run_dir"]) / "started").read_text())
            events = http.get(f"/api/jobs/{job['id']}/events", params={"type": "job"}).json()["events"]
            launched = next(e["time"] for e in events if e["data"].get("pid"))
            to_popen.append((launched - t0) * 1000)
            to_running_code.append((started - t0) * 1000)
    finally:
        http.close()
        server.stop()
    return {"start_s": start_s, "idle_rss_mib": idle_rss,
            "submit_to_popen_ms": statistics.median(to_popen),
            "submit_to_child_code_ms": statistics.median(to_running_code)}


def bench_ingest(workdir: Path, events: int, senders: int) -> dict:
    script = workdir / "flood_job.py"
    script.write_text(FLOOD_JOB)
    server = Server(workdir, ["{python}", str(script), str(events), "{run_dir}/flood"])
    server.start()
    http = httpx.Client(base_url=server.url, timeout=60)
    try:
        # 1) one trainer's WebhookReporter (sequential, signed, as in training)
        job = http.post("/api/jobs", json=job_body()).json()
        done = wait_finished(http, job["id"])
        sent, seconds, ok = (Path(done["run_dir"]) / "flood").read_text().split()
        single = int(sent) / float(seconds)
        stored = len(http.get(f"/api/jobs/{job['id']}/events", params={"type": "progress", "limit": 5000})
                     .json()["events"])
        # 2) several senders at once (direct signed POSTs with the job's secret, read from the database)
        from sqlalchemy import create_engine, text

        job2 = http.post("/api/jobs", json=job_body()).json()
        wait_finished(http, job2["id"])
        engine = create_engine(f"sqlite:///{workdir / 'data' / 'simpletuner.db'}")
        with engine.connect() as conn:
            secret = conn.execute(text("SELECT webhook_secret FROM jobs WHERE id=:i"), {"i": job2["id"]}).scalar()
        engine.dispose()
        from simpletuner.training.webhooks import SIGNATURE_HEADER, sign

        per = events // senders
        errors = []

        def send(k: int) -> None:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                for i in range(per):
                    seq = 100000 + k * per + i
                    body = json.dumps({"job_id": job2["id"], "seq": seq, "type": "progress", "time": time.time(),
                                       "data": {"step": seq, "total_steps": events, "loss": 0.1}}).encode()
                    r = c.post(f"/api/jobs/{job2['id']}/events", content=body,
                               headers={SIGNATURE_HEADER: sign(secret, body), "Content-Type": "application/json"})
                    if r.status_code != 200:
                        errors.append(r.status_code)

        threads = [threading.Thread(target=send, args=(k,)) for k in range(senders)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        parallel = per * senders / (time.perf_counter() - t0)
    finally:
        http.close()
        server.stop()
    return {"single_reporter_eps": single, "single_reporter_stored": stored, "single_reporter_sent": int(sent),
            "parallel_eps": parallel, "parallel_errors": len(errors), "senders": senders}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10, help="jobs for the latency median")
    parser.add_argument("--events", type=int, default=2000, help="webhook events to send")
    parser.add_argument("--senders", type=int, default=4, help="concurrent senders for the parallel rate")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        lat = bench_latency(Path(tmp) / "latency", args.jobs) if (Path(tmp) / "latency").mkdir() is None else None
        ing = bench_ingest(Path(tmp) / "ingest", args.events, args.senders) if (Path(tmp) / "ingest").mkdir() is None else None
    print(f"server start (spawn -> /api/health 200):   {lat['start_s']:.2f} s")
    print(f"idle RSS (2 s after start):                 {lat['idle_rss_mib']:.1f} MiB")
    print(f"submit -> trainer process spawned (median): {lat['submit_to_popen_ms']:.1f} ms  (n={args.jobs})")
    print(f"submit -> trainer code running (median):    {lat['submit_to_child_code_ms']:.1f} ms  "
          "(includes the child's Python start-up)")
    print(f"webhook ingestion, one WebhookReporter:     {ing['single_reporter_eps']:.0f} events/s  "
          f"({ing['single_reporter_sent']} sent, {ing['single_reporter_stored']} stored)")
    print(f"webhook ingestion, {ing['senders']} concurrent senders:   {ing['parallel_eps']:.0f} events/s  "
          f"({ing['parallel_errors']} errors)")
    print(f"ratio parallel/single ingestion:            {ing['parallel_eps'] / ing['single_reporter_eps']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
