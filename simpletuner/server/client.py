"""``simpletuner jobs``: a small REST client for a SimpleTuner server (local or remote).

    simpletuner jobs submit --config config/config.json [--wait]
    simpletuner jobs submit --config-name tiny-flux --set max_train_steps=10
    simpletuner jobs list | show ID | cancel ID | logs ID [--follow] | watch ID
    simpletuner jobs retry ID [--start-over] [--wait]

``--server`` (or $SIMPLETUNER_SERVER, default http://127.0.0.1:8001); the token from $SIMPLETUNER_API_TOKEN or
``--token-file`` (never on the command line, where ``ps`` shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

DEFAULT_SERVER = "http://127.0.0.1:8001"
FINISHED = ("succeeded", "failed", "cancelled")


class ClientError(Exception):
    pass


class Client:
    """Thin typed-ish wrapper over the REST API (httpx)."""

    def __init__(self, server: str = DEFAULT_SERVER, token: str | None = None, timeout: float = 30.0):
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.server = server.rstrip("/")
        self.http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def _check(self, response) -> Any:
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {"detail": response.text}
            lines = [f"HTTP {response.status_code}: {body.get('detail', body)}"]
            lines += [f"  {e['path']}: {e['message']}" for e in body.get("errors", []) if isinstance(e, dict)]
            raise ClientError("\n".join(lines))
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    def get(self, path: str, **params) -> Any:
        return self._check(self.http.get(path, params={k: v for k, v in params.items() if v is not None}))

    def post(self, path: str, body: Any = None) -> Any:
        return self._check(self.http.post(path, json=body))

    def submit(self, body: dict) -> dict:
        return self.post("/api/jobs", body)

    def cancel(self, job_id: int) -> dict:
        return self.post(f"/api/jobs/{job_id}/cancel")

    def log(self, job_id: int, tail: int | None = None, offset: int | None = None) -> tuple[str, int]:
        r = self.http.get(f"/api/jobs/{job_id}/log", params={k: v for k, v in
                                                             {"tail": tail, "offset": offset}.items() if v is not None})
        text = self._check(r)
        return text, int(r.headers.get("x-log-offset", "0"))

    def stream(self, job_id: int | None = None, after: int | None = None, until_done: bool = True) -> Iterator[dict]:
        """Yield events (dicts) from the SSE stream; resumes with Last-Event-ID if the connection drops."""
        import httpx

        path = f"/api/jobs/{job_id}/stream" if job_id is not None else "/api/stream"
        last = after
        while True:
            headers = {"Last-Event-ID": str(last)} if last is not None else {}
            params = {"until_done": "true"} if (until_done and job_id is not None) else {}
            try:
                with self.http.stream("GET", path, headers=headers, params=params, timeout=None) as r:
                    if r.status_code >= 400:
                        r.read()
                        self._check(r)
                    for event in parse_sse(r.iter_lines()):
                        if event.get("event") == "end":
                            return
                        if event.get("id"):
                            last = int(event["id"])
                        if event.get("data"):
                            yield json.loads(event["data"])
                return
            except (httpx.TransportError, httpx.RemoteProtocolError):
                time.sleep(1.0)  # reconnect; Last-Event-ID replays what was missed


def parse_sse(lines: Iterator[str]) -> Iterator[dict]:
    """Parse a text/event-stream into {"id", "event", "data"} dicts (comments skipped)."""
    event: dict[str, str] = {}
    for line in lines:
        if line == "":
            if event:
                yield event
            event = {}
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            event["data"] = event["data"] + "\n" + value if "data" in event else value
        elif name in ("id", "event", "retry"):
            event[name] = value
    if event:
        yield event


# ---- CLI ---------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=os.environ.get("SIMPLETUNER_SERVER", DEFAULT_SERVER),
                        help=f"server URL (default $SIMPLETUNER_SERVER or {DEFAULT_SERVER})")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="read the API token from this file (default $SIMPLETUNER_API_TOKEN)")
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)  # refused: ps would show it
    parser.add_argument("--json", action="store_true", help="print raw JSON")
    # The same options after the action (``jobs list --token T``); SUPPRESS keeps the values given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--server", default=argparse.SUPPRESS, help="server URL")
    common.add_argument("--token-file", type=Path, default=argparse.SUPPRESS, help="read the API token from this file")
    common.add_argument("--token", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print raw JSON")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    p = sub.add_parser("submit", parents=[common], help="queue a job from a stored config or local config files")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config-name", help="a config stored on the server")
    src.add_argument("--config", type=Path, help="a local config.json (sent inline)")
    p.add_argument("--config-version", type=int, help="with --config-name: that version (default newest)")
    p.add_argument("--data-backends", type=Path,
                   help="local multidatabackend.json (default: the file the config names, if it exists here)")
    p.add_argument("--prompt-library", type=Path, help="local user_prompt_library.json")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (value parsed as JSON if it can be); repeatable")
    p.add_argument("--name", default="")
    p.add_argument("--priority", type=int, default=0, help="higher runs first")
    p.add_argument("--num-processes", type=int, default=1, help="processes over all machines (default 1)")
    p.add_argument("--num-machines", type=int, default=1,
                   help="machines the job spans: that many workers run it at once (default 1)")
    p.add_argument("--retry-on-restart", action="store_true",
                   help="re-queue instead of failing if the server restarts mid-run")
    p.add_argument("--max-retries", type=int, default=0,
                   help="retry automatically after a trainer crash, resuming from the newest checkpoint (default 0)")
    p.add_argument("--kind", choices=("train", "cache"), default="train",
                   help="cache: split training's stage 1 (simpletuner cache) as a job")
    p.add_argument("--depends-on", type=int, default=None, metavar="JOB_ID",
                   help="a train job: the cache job it waits for (set train_from_cache to train from its cache)")
    p.add_argument("--wait", action="store_true", help="follow events until the job ends; exit 0 if it succeeded")

    p = sub.add_parser("list", parents=[common], help="list jobs")
    p.add_argument("--status", action="append", choices=("queued", "running", "succeeded", "failed", "cancelled"))
    p.add_argument("--limit", type=int, default=50)

    for name, help_text in (("show", "show one job"), ("cancel", "cancel a job"), ("watch", "follow a job's events")):
        p = sub.add_parser(name, parents=[common], help=help_text)
        p.add_argument("job_id", type=int)

    p = sub.add_parser("retry", parents=[common],
                       help="retry a finished job: it continues from its newest checkpoint (same run dir)")
    p.add_argument("job_id", type=int)
    p.add_argument("--start-over", action="store_true",
                   help="start from step 0 instead (the previous output is kept aside in the run dir)")
    p.add_argument("--wait", action="store_true", help="follow events until the job ends; exit 0 if it succeeded")

    p = sub.add_parser("logs", parents=[common], help="print a job's log")
    p.add_argument("job_id", type=int)
    p.add_argument("--tail", type=int, default=None, help="last N lines")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ClientError(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ClientError(f"{what}: {path} not found") from None
    except ValueError as exc:
        raise ClientError(f"{what}: {path} is not valid JSON ({exc})") from None


def build_submit_body(args: argparse.Namespace) -> dict:
    body: dict[str, Any] = {"name": args.name, "priority": args.priority, "num_processes": args.num_processes,
                            "num_machines": args.num_machines,
                            "retry_on_restart": args.retry_on_restart, "max_retries": args.max_retries}
    if getattr(args, "kind", "train") != "train":
        body["kind"] = args.kind
    if getattr(args, "depends_on", None) is not None:
        body["depends_on"] = args.depends_on
    overrides = _parse_set(args.set)
    if args.config_name:
        body["config_name"] = args.config_name
        if args.config_version:
            body["config_version"] = args.config_version
        if overrides:
            body["overrides"] = overrides
    else:
        cfg = _read_json(args.config, "--config")
        if not isinstance(cfg, dict):
            raise ClientError(f"--config: {args.config} must hold a JSON object")
        merged = dict(cfg)  # the config as --set leaves it (any spelling of a key is replaced)
        for key, value in overrides.items():
            _drop_key(merged, _canon(key))
            merged[key] = value
        backends_path = args.data_backends
        if backends_path is None:
            named = _value(merged, "data_backend_config")
            if isinstance(named, str) and Path(named).exists():
                backends_path = Path(named)
            elif not named:
                from simpletuner.config import data_backend_beside, found_beside_message

                beside = data_backend_beside(args.config)
                if beside:
                    print(found_beside_message(beside, args.config), file=sys.stderr)
                    backends_path = Path(beside)
        if backends_path is not None:
            body["data_backends"] = _read_json(backends_path, "--data-backends")
            for where in (cfg, overrides):  # sent inline; a path on this machine means nothing there
                _drop_key(where, "data_backend_config")
        library = args.prompt_library
        named = _value(merged, "user_prompt_library")
        if library is None and isinstance(named, str) and Path(named).exists():
            library = Path(named)
        if library is not None:
            body["prompt_library"] = _read_json(library, "--prompt-library")
            for where in (cfg, overrides):
                _drop_key(where, "user_prompt_library")
        body["train_config"] = cfg
        if overrides:  # applied by the server after every spelling in the file, as on the command line
            body["overrides"] = overrides
    if args.prompt_library is not None and "prompt_library" not in body:
        body["prompt_library"] = _read_json(args.prompt_library, "--prompt-library")
    return body


def _canon(key: str) -> str:
    return key.lstrip("-").replace("-", "_")


def _value(cfg: dict, key: str) -> Any:
    return next((v for k, v in cfg.items() if _canon(k) == key), None)


def _drop_key(cfg: dict, key: str) -> None:
    for k in list(cfg):
        if _canon(k) == key:
            del cfg[k]


def _ts(value: float | None) -> str:
    return datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _print_job_line(job: dict) -> None:
    progress = job.get("progress") or {}
    step = f"{progress.get('step')}/{progress.get('total_steps')}" if progress.get("step") is not None else ""
    loss = (job.get("results") or {}).get("final_loss", progress.get("loss"))
    loss_text = f"{loss:.4g}" if isinstance(loss, (int, float)) else ""
    print(f"{job['id']:>5}  {job['status']:<10} {job['priority']:>4}  {_ts(job['submitted_at'])}  "
          f"{step:>9}  {loss_text:>8}  {job.get('name') or job.get('config_name') or ''}")


def _describe_event(ev: dict) -> str | None:
    d = ev.get("data", {})
    kind = ev.get("type")
    if kind == "progress":
        return (f"step {d.get('step')}/{d.get('total_steps')}  loss {d.get('loss')}  lr {d.get('lr')}  "
                f"{d.get('it_per_s')} it/s  eta {d.get('eta_s')}s")
    if kind == "job":
        extra = f" ({d['reason']})" if d.get("reason") else ""
        return f"job {ev['job_id']}: {d.get('status')}{extra}"
    if kind == "checkpoint":
        return f"checkpoint at step {d.get('step')}: {d.get('path')}"
    if kind == "image":
        return f"{d.get('kind')} image at step {d.get('step')}: {d.get('image_url') or d.get('path')}"
    if kind == "scores":
        return f"scores at step {d.get('step')}: {d.get('metrics')}"
    if kind == "error":
        return f"error: {d.get('message')}"
    if kind == "status":
        return f"trainer: {d.get('status')}"
    if kind == "log":
        return str(d.get("message"))
    return None


def _follow(client: Client, job_id: int, as_json: bool) -> int:
    for ev in client.stream(job_id, until_done=True):
        if as_json:
            print(json.dumps(ev), flush=True)
        else:
            text = _describe_event(ev)
            if text:
                print(text, flush=True)
    job = client.get(f"/api/jobs/{job_id}")
    if not as_json:
        print(f"job {job_id} {job['status']}" + (f": {job['reason']}" if job.get("reason") else ""))
        if job["status"] == "failed" and job.get("log_tail"):
            print(job["log_tail"], file=sys.stderr)
    return 0 if job["status"] == "succeeded" else 1


def resolve_token(args: argparse.Namespace) -> str | None:
    """$SIMPLETUNER_API_TOKEN or --token-file; --token is refused (ps shows command lines to every user)."""
    if getattr(args, "token", None) is not None:
        raise ClientError("--token puts the token on the command line, where `ps` shows it to every user of this "
                          "machine; set $SIMPLETUNER_API_TOKEN or use --token-file FILE instead")
    if getattr(args, "token_file", None) is not None:
        try:
            return Path(args.token_file).expanduser().read_text().strip() or None
        except OSError as exc:
            raise ClientError(f"--token-file {args.token_file}: cannot be read ({exc.strerror or exc})") from None
    return os.environ.get("SIMPLETUNER_API_TOKEN") or None


def run(args: argparse.Namespace) -> int:
    try:
        token = resolve_token(args)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    client = Client(args.server, token)
    try:
        return _run(client, args)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # connection refused etc.
        import httpx

        if isinstance(exc, httpx.TransportError):
            print(f"error: cannot reach {args.server}: {exc}", file=sys.stderr)
            return 2
        raise
    finally:
        client.close()


def _run(client: Client, args: argparse.Namespace) -> int:
    if args.action == "submit":
        job = client.submit(build_submit_body(args))
        if args.json:
            print(json.dumps(job, indent=2))
        else:
            where = f", position {job['queue_position']} in queue" if job.get("queue_position") else ""
            print(f"job {job['id']} {job['status']}{where}")
            for w in job.get("warnings", []):
                print(f"warning: {w}", file=sys.stderr)
        return _follow(client, job["id"], args.json) if args.wait else 0
    if args.action == "list":
        data = client.get("/api/jobs", status=args.status, limit=args.limit)
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            print(f"{'id':>5}  {'status':<10} {'prio':>4}  {'submitted':<19}  {'step':>9}  {'loss':>8}  name")
            for job in data["jobs"]:
                _print_job_line(job)
        return 0
    if args.action == "show":
        job = client.get(f"/api/jobs/{args.job_id}")
        if args.json:
            print(json.dumps(job, indent=2))
        else:
            for key in ("id", "name", "status", "reason", "priority", "config_name", "config_version",
                        "num_processes", "attempt", "exit_code", "run_dir", "error"):
                if job.get(key) not in (None, ""):
                    print(f"{key:>15}: {job[key]}")
            for key in ("submitted_at", "started_at", "finished_at"):
                print(f"{key:>15}: {_ts(job.get(key))}")
            if job.get("progress"):
                print(f"{'progress':>15}: {_describe_event({'type': 'progress', 'data': job['progress']})}")
            for key, value in (job.get("results") or {}).items():
                print(f"{'results.' + key:>15}: {value}")
            if job.get("log_tail"):
                print("--- log tail ---\n" + job["log_tail"])
        return 0
    if args.action == "cancel":
        job = client.cancel(args.job_id)
        print(json.dumps(job, indent=2) if args.json else
              f"job {job['id']} {job['status']}" + (" (stopping)" if job.get("cancel_requested") else ""))
        return 0
    if args.action == "retry":
        job = client.post(f"/api/jobs/{args.job_id}/retry", {"start_over": args.start_over})
        if args.json:
            print(json.dumps(job, indent=2))
        else:
            print(f"job {job['id']} {job['status']}: {job.get('reason') or ''}".rstrip(": "))
        return _follow(client, job["id"], args.json) if args.wait else 0
    if args.action == "logs":
        text, offset = client.log(args.job_id, tail=args.tail)
        sys.stdout.write(text)
        sys.stdout.flush()
        while args.follow:
            job = client.get(f"/api/jobs/{args.job_id}")
            text, offset = client.log(args.job_id, offset=offset)
            sys.stdout.write(text)
            sys.stdout.flush()
            if job["status"] in FINISHED and not text:
                break
            time.sleep(1.0)
        return 0
    if args.action == "watch":
        return _follow(client, args.job_id, args.json)
    raise ClientError(f"unknown action {args.action}")
