"""Server settings: one plain object built by the CLI (or a test) and handed to ``create_app``."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8001
TOKEN_ENV = "SIMPLETUNER_API_TOKEN"


def default_data_dir() -> Path:
    """``$SIMPLETUNER_DATA_DIR`` or ``./.simpletuner`` (the server's database, run dirs and token live here)."""
    return Path(os.environ.get("SIMPLETUNER_DATA_DIR") or (Path.cwd() / ".simpletuner"))


def detect_accelerators() -> list[str]:
    """GPU ids from ``nvidia-smi -L`` (no torch import); empty on a CPU-only machine."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


@dataclass
class ServerSettings:
    """Everything the server needs; nothing is read from the environment after ``create_app``."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    data_dir: Path = field(default_factory=default_data_dir)
    db_url: str | None = None  # default: sqlite file under data_dir
    db_busy_timeout: float = 10.0  # seconds a request waits for a locked SQLite database before a 503
    # None: one slot per detected accelerator, 1 on CPU.
    max_concurrent: int | None = None
    # Accelerator ids to hand out (CUDA_VISIBLE_DEVICES); None: detect with nvidia-smi.
    accelerators: list[str] | None = None
    token: str | None = None  # None: token_file, else $SIMPLETUNER_API_TOKEN, else generated into data_dir/api_token
    token_file: Path | None = None  # read the token from this file (never from the command line: ps shows it)
    require_token: bool = False  # also ask loopback clients for the token
    # Host names besides localhost/127.0.0.1/[::1] that loopback clients may use and still be trusted
    allowed_hosts: list[str] = field(default_factory=list)
    # Origins (scheme://host:port) besides the server's own that may send state-changing requests
    allowed_origins: list[str] = field(default_factory=list)
    trust_loopback: bool = True  # tests set False to act as an off-machine client
    allowed_roots: list[Path] | None = None  # None: data_dir + workdir
    workdir: Path = field(default_factory=Path.cwd)  # jobs run here; relative config paths resolve here
    public_url: str | None = None  # base URL the trainer posts webhooks to; None: http://127.0.0.1:port
    # Job command override (tests, benchmarks): list of strings formatted with {python}, {config},
    # {run_dir}, {num_processes}, {job_id}. None: accelerate launch -m simpletuner.train.
    job_command: list[str] | None = None
    launcher: str = "accelerate"  # "accelerate" or "python" (single process, no accelerate)
    poll_interval: float = 0.5
    heartbeat_interval: float = 5.0
    orphan_timeout: float = 60.0  # a running job whose server stopped heart-beating this long is orphaned
    cancel_grace: float = 15.0  # SIGTERM -> SIGKILL
    stop_jobs_on_shutdown: bool = False  # False: jobs keep running and are adopted on next start
    log_tail_lines: int = 60
    max_event_bytes: int = 32 * 1024 * 1024  # a trainer webhook (validation images ride in it)
    max_request_bytes: int = 8 * 1024 * 1024  # any other request body
    max_upload_bytes: int = 1024 * 1024 * 1024  # one dataset upload request (and any one file in it)
    sse_keepalive: float = 15.0
    run_scheduler: bool = True
    # The server's own machine runs jobs too (one worker among the others); off: only `simpletuner worker`s do.
    local_worker: bool = True
    # Run dirs (config, checkpoints, outputs, logs); workers on other machines must reach the same path
    # (shared storage). None: DATA_DIR/runs.
    runs_dir: Path | None = None
    worker_lease: float = 30.0  # a worker that has not heart-beaten this long is lost; its jobs are re-queued
    gang_start_timeout: float = 120.0  # a multi-machine job whose machines have not all started by then re-queues

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser().resolve()
        self.workdir = Path(self.workdir).expanduser().resolve()
        self.allowed_hosts = [h.lower().strip("[]") for h in self.allowed_hosts]

    # ---- derived values -------------------------------------------------------------------
    def resolved_db_url(self) -> str:
        return self.db_url or f"sqlite:///{self.data_dir / 'simpletuner.db'}"

    def resolved_runs_dir(self) -> Path:
        return Path(self.runs_dir).expanduser().resolve() if self.runs_dir else self.data_dir / "runs"

    def resolved_accelerators(self) -> list[str]:
        if self.accelerators is None:
            self.accelerators = detect_accelerators()
        return self.accelerators

    def resolved_max_concurrent(self) -> int:
        if self.max_concurrent is not None:
            return max(1, int(self.max_concurrent))
        return max(1, len(self.resolved_accelerators()))

    def resolved_allowed_roots(self) -> list[Path]:
        """The folders jobs may read and write; the data dir's ``datasets/`` (uploads) is always one of them."""
        roots = self.allowed_roots if self.allowed_roots is not None else [self.data_dir, self.workdir]
        resolved = [Path(r).expanduser().resolve() for r in roots]
        uploads = (self.data_dir / "datasets").resolve()
        if not any(uploads == r or r in uploads.parents for r in resolved):
            resolved.append(uploads)
        return resolved

    def webhook_base_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def resolve_token(self) -> tuple[str, bool]:
        """The API token and whether it was generated just now (so the CLI prints it once)."""
        if self.token:
            return self.token, False
        if self.token_file is not None:
            try:
                self.token = Path(self.token_file).expanduser().read_text().strip()
            except OSError as exc:
                raise ValueError(f"--token-file {self.token_file}: cannot be read ({exc.strerror or exc})") from None
            if not self.token:
                raise ValueError(f"--token-file {self.token_file}: the file is empty")
            return self.token, False
        env = os.environ.get(TOKEN_ENV)
        if env:
            self.token = env
            return env, False
        path = self.data_dir / "api_token"
        if path.exists():
            self.token = path.read_text().strip()
            if self.token:
                return self.token, False
        self.data_dir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
        self.token = token
        return token, True


def hostname() -> str:
    return socket.gethostname()
