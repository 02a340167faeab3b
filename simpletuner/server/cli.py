"""``simpletuner server``: run the training server (FastAPI + uvicorn) on http://127.0.0.1:8001."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .settings import DEFAULT_HOST, DEFAULT_PORT, TOKEN_ENV, ServerSettings, default_data_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"interface to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="database, run dirs and token live here (default $SIMPLETUNER_DATA_DIR or ./.simpletuner)")
    parser.add_argument("--db-url", default=None,
                        help="any SQLAlchemy URL (default: sqlite file in the data dir)")
    parser.add_argument("--max-concurrent", type=int, default=None,
                        help="jobs run at once (default: one per detected GPU, 1 on CPU)")
    parser.add_argument("--token-file", type=Path, default=None,
                        help=f"read the API token from this file (default ${TOKEN_ENV}, else generated into "
                             "DATA_DIR/api_token)")
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)  # refused: ps would show it
    parser.add_argument("--require-token", action="store_true",
                        help="ask loopback clients for the token too")
    parser.add_argument("--allowed-root", action="append", type=Path, default=None, dest="allowed_roots",
                        help="folder configs may read/write under (repeatable; default: data dir + working dir)")
    parser.add_argument("--public-url", default=None,
                        help="base URL jobs post their webhooks to (default http://127.0.0.1:PORT); its origin may "
                             "also send state-changing requests")
    parser.add_argument("--allowed-host", action="append", default=[], dest="allowed_hosts", metavar="NAME",
                        help="a host name (besides localhost/127.0.0.1/[::1]) that loopback clients may use "
                             "without a token (repeatable)")
    parser.add_argument("--allowed-origin", action="append", default=[], dest="allowed_origins", metavar="ORIGIN",
                        help="another origin (scheme://host:port) allowed to send state-changing requests, e.g. "
                             "a reverse proxy's (repeatable)")
    parser.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                        help="largest request body accepted (default 8 MiB; trainer webhooks: 32 MiB)")
    parser.add_argument("--max-upload-bytes", type=int, default=1024 * 1024 * 1024,
                        help="largest dataset upload (one request, and any one file in it; default 1 GiB)")
    parser.add_argument("--launcher", choices=("accelerate", "python"), default="accelerate",
                        help="how jobs start: accelerate launch (default) or plain python for one process")
    parser.add_argument("--cancel-grace", type=float, default=15.0,
                        help="seconds between SIGTERM and SIGKILL when cancelling (default 15)")
    parser.add_argument("--stop-jobs-on-exit", action="store_true",
                        help="cancel running jobs when the server stops (default: they keep running and the "
                             "next start adopts them)")
    parser.add_argument("--no-local-worker", dest="local_worker", action="store_false",
                        help="run no jobs on this machine: only `simpletuner worker`s claim them")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="where run dirs live (default DATA_DIR/runs); with workers on other machines, a path "
                             "on shared storage that every worker mounts at the same place")
    parser.add_argument("--worker-lease", type=float, default=30.0,
                        help="seconds a worker may go without a heartbeat before its jobs are re-queued (default 30)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    if args.token is not None:
        raise SystemExit(f"error: --token puts the token on the command line, where `ps` shows it to every user "
                         f"of this machine; set ${TOKEN_ENV} or use --token-file FILE instead")
    return ServerSettings(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir or default_data_dir(),
        db_url=args.db_url,
        max_concurrent=args.max_concurrent,
        token_file=args.token_file,
        require_token=args.require_token,
        allowed_hosts=args.allowed_hosts,
        allowed_origins=args.allowed_origins,
        max_request_bytes=args.max_request_bytes,
        max_upload_bytes=args.max_upload_bytes,
        allowed_roots=args.allowed_roots,
        public_url=args.public_url,
        launcher=args.launcher,
        cancel_grace=args.cancel_grace,
        stop_jobs_on_shutdown=args.stop_jobs_on_exit,
        job_command=_job_command_from_env(),
        local_worker=args.local_worker,
        runs_dir=args.runs_dir,
        worker_lease=args.worker_lease,
    )


def _job_command_from_env() -> list[str] | None:
    # For tests and benchmarks only: a JSON list replacing the trainer command (see ServerSettings.job_command).
    raw = os.environ.get("SIMPLETUNER_SERVER_JOB_COMMAND")
    if not raw:
        return None
    import json

    value = json.loads(raw)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SystemExit("SIMPLETUNER_SERVER_JOB_COMMAND must be a JSON list of strings")
    return value


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .auth import is_loopback

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    try:
        app = create_app(settings)
    except ValueError as exc:  # an unreadable token file, a damaged database
        print(f"error: {exc}", file=sys.stderr)
        return 2
    url = f"http://{settings.host if ':' not in settings.host else '[' + settings.host + ']'}:{settings.port}"
    print(f"SimpleTuner server on {url}  (API docs {url}/docs)", file=sys.stderr)
    print(f"  data dir {settings.data_dir}; database {settings.resolved_db_url()}; "
          f"{app.state.manager.max_concurrent} job slot(s)", file=sys.stderr)
    if app.state.token_generated:
        print(f"  API token (saved in {settings.data_dir / 'api_token'}): {app.state.token}", file=sys.stderr)
    if not is_loopback(settings.host) and settings.host != "localhost":
        print("  listening beyond loopback: remote clients need 'Authorization: Bearer <token>'", file=sys.stderr)
    # an idle keep-alive connection is closed after 30 s (uvicorn's 5 s let a poller whose machine stalled for a few
    # seconds send its next request into a connection being closed: "disconnected without sending a response")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=False,
                timeout_keep_alive=30)
    return 0
