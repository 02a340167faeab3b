"""Queue benchmark on PostgreSQL: claim throughput and submit -> start latency with 1, 2 and 4 workers, as ratios to
the server's own machine running the jobs (its local worker), all measured in this one run.

    python benchmarks/queue_bench.py [--jobs 40] [--workers 1,2,4] [--db-url postgresql+psycopg://...]

Each scenario starts the real ``simpletuner server`` (and ``simpletuner worker`` processes, one job slot each) on a
fresh database (a throwaway PostgreSQL cluster unless ``--db-url`` is given), submits ``--jobs`` jobs at once, and
times them. The job is a stand-in that writes the time it started and exits, so the numbers are the queue's own:
claim (an atomic UPDATE), run-dir writing, launch, and the end-of-job report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TOKEN = "bench-token"
STARTED = ["{python}", "-c", "import sys, time; open(sys.argv[1] + '/started', 'w').write(repr(time.time()))",
           "{run_dir}"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/api/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"server did not start:\n{log.read_text()[-2000:]}")


def _reset(db_url: str) -> None:
    from sqlalchemy import create_engine

    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    engine.dispose()


@contextmanager
def _fleet(tmp: Path, db_url: str, workers: int):
    """A server (its local worker on when ``workers`` is 0) and ``workers`` worker processes."""
    _reset(db_url)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIMPLETUNER_")}
    env.update(SIMPLETUNER_API_TOKEN=TOKEN, SIMPLETUNER_SERVER_JOB_COMMAND=json.dumps(STARTED),
               SIMPLETUNER_WORKER_JOB_COMMAND=json.dumps(STARTED))
    data = tmp / f"server-{workers}"
    cmd = [sys.executable, "-m", "simpletuner.cli", "server", "--port", str(port), "--data-dir", str(data),
           "--db-url", db_url, "--launcher", "python", "--max-concurrent", "1", "--log-level", "warning",
           "--allowed-root", str(REPO), "--allowed-root", str(tmp)]
    if workers:
        cmd.append("--no-local-worker")
    procs = []
    with ExitStack() as stack:
        log = tmp / f"server-{workers}.log"
        server = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stack.enter_context(open(log, "ab")),
                                  stderr=subprocess.STDOUT)
        procs.append(server)
        try:
            _wait_healthy(url, server, log)
            http = stack.enter_context(httpx.Client(base_url=url, timeout=60,
                                                    headers={"Authorization": f"Bearer {TOKEN}"}))
            if workers:
                token_file = tmp / "worker-token"
                token_file.write_text(http.post("/api/worker-tokens", json={"name": "bench"}).json()["token"])
                for i in range(workers):
                    wlog = tmp / f"worker-{workers}-{i}.log"
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "simpletuner.cli", "worker", "--server", url, "--token-file",
                         str(token_file), "--name", f"bench-{i}", "--devices", "none", "--poll-interval", "0.05",
                         "--data-dir", str(tmp / f"w{workers}-{i}"), "--log-level", "warning"],
                        cwd=REPO, env=env, stdout=stack.enter_context(open(wlog, "ab")), stderr=subprocess.STDOUT))
                deadline = time.time() + 60
                while sum(w["status"] == "online" and not w["local"] for w in http.get("/api/workers").json()) \
                        < workers:
                    if time.time() > deadline:
                        raise RuntimeError("workers did not register")
                    time.sleep(0.1)
            yield http
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def _body(i: int) -> dict:
    return {"name": f"bench-{i}", "train_config": {"model_family": "flux", "model_flavour": "tiny",
                                                    "max_train_steps": 1},
            "data_backends": json.loads((REPO / "config" / "multidatabackend.json").read_text())}


def run_scenario(tmp: Path, db_url: str, workers: int, jobs: int) -> dict:
    with _fleet(tmp, db_url, workers) as http:
        t0 = time.time()
        ids = [http.post("/api/jobs", json=_body(i)).json()["id"] for i in range(jobs)]
        deadline = time.time() + 600
        while True:
            listed = http.get("/api/jobs", params={"limit": 1000}).json()["jobs"]
            done = [j for j in listed if j["id"] in ids and j["status"] in ("succeeded", "failed", "cancelled")]
            if len(done) == jobs or time.time() > deadline:
                break
            time.sleep(0.05)
        bad = [j for j in done if j["status"] != "succeeded"]
        if len(done) != jobs or bad:
            raise RuntimeError(f"{workers} worker(s): {len(done)}/{jobs} finished, failed: {bad[:1]}")
        details = [http.get(f"/api/jobs/{i}").json() for i in ids]
        starts = [float((Path(j["run_dir"]) / "started").read_text()) for j in details]
        latency = [s - j["submitted_at"] for s, j in zip(starts, details)]
        return {"workers": workers, "jobs": jobs, "claims_per_s": jobs / (max(starts) - t0),
                "latency_median_s": statistics.median(latency), "latency_p90_s": sorted(latency)[int(0.9 * jobs)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--db-url", default=None, help="an empty PostgreSQL database (default: a throwaway cluster)")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="queue-bench-") as tmp, ExitStack() as stack:
        db_url = args.db_url
        if db_url is None:
            from tests.server.postgres import running_postgres

            db_url = stack.enter_context(running_postgres())
        results = [run_scenario(Path(tmp), db_url, 0, args.jobs)]  # the server's own machine
        results += [run_scenario(Path(tmp), db_url, n, args.jobs) for n in counts]
    base = results[0]
    print(f"{args.jobs} jobs per scenario, PostgreSQL; ratios against the server's local worker (1 slot)")
    print(f"{'scenario':<16} {'claims/s':>9} {'x local':>8} {'median submit->start':>21} {'x local':>8} {'p90':>7}")
    for r in results:
        name = "local worker" if r["workers"] == 0 else f"{r['workers']} worker(s)"
        print(f"{name:<16} {r['claims_per_s']:>9.2f} {r['claims_per_s'] / base['claims_per_s']:>7.2f}x "
              f"{r['latency_median_s']:>20.3f}s {r['latency_median_s'] / base['latency_median_s']:>7.2f}x "
              f"{r['latency_p90_s']:>6.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
