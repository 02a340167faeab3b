"""Request and response models of the REST API (every route is typed; OpenAPI at /docs)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from simpletuner.config.events import EVENT_TYPES

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
EventType = Literal[EVENT_TYPES]  # the wire contract's event types
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
MAX_ID = 2**62  # keeps ids inside every SQL backend's 64-bit integer
Annotated_str = Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z0-9:._-]+$")]


class FieldErrorOut(BaseModel):
    path: str = Field(description="field path, e.g. train_config.learning_rate or data_backends[my-set].resolution")
    message: str


class ErrorOut(BaseModel):
    detail: str
    errors: list[FieldErrorOut] = []


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "missing or invalid API token"},
    422: {"model": ErrorOut, "description": "invalid request; errors name the field paths"},
}
NOT_FOUND = {404: {"model": ErrorOut, "description": "not found"}}
CONFLICT = {409: {"model": ErrorOut, "description": "conflicts with the current state"}}


# ---- configs -----------------------------------------------------------------------------------------
class ConfigBody(BaseModel):
    """A config: SimpleTuner's config.json (train_config), multidatabackend.json (data_backends) and an
    optional user prompt library ({nickname: prompt})."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "train_config": {"model_family": "flux", "model_flavour": "tiny", "max_train_steps": 5},
        "data_backends": [{"id": "sample", "type": "local", "instance_data_dir": "datasets/sample"},
                          {"id": "text-embeds", "dataset_type": "text_embeds", "type": "local", "default": True}],
    }]})
    train_config: dict[str, Any]
    data_backends: list[dict[str, Any]] = []
    prompt_library: dict[str, str] | None = None


class ConfigCreate(ConfigBody):
    name: str = Field(pattern=NAME_PATTERN, max_length=200)
    description: str = Field("", max_length=10_000)
    comment: str = Field("", max_length=10_000)


class ConfigImport(BaseModel):
    """A config.json on the server's disk (e.g. one ``simpletuner configure`` wrote), stored as a named config."""

    name: str = Field(pattern=NAME_PATTERN, max_length=200)
    path: str = Field(min_length=1, max_length=4096, description="the config.json, under the allowed roots; its "
                                                                 "data_backend_config (or a multidatabackend.json "
                                                                 "beside it) gives the datasets")
    description: str = Field("", max_length=10_000)


class ConfigFileOut(BaseModel):
    path: str
    suggested_name: str
    modified: float


class ConfigUpdate(ConfigBody):
    description: str | None = Field(None, max_length=10_000)
    comment: str = Field("", max_length=10_000)


class ConfigVersionOut(BaseModel):
    version: int
    schema_version: int | None = None
    comment: str = ""
    created_at: float
    train_config: dict[str, Any]
    data_backends: list[dict[str, Any]]
    prompt_library: dict[str, str] | None = None


class ConfigVersionSummary(BaseModel):
    version: int
    schema_version: int | None = None
    comment: str = ""
    created_at: float


class ConfigSummary(BaseModel):
    name: str
    description: str = ""
    current_version: int
    created_at: float
    updated_at: float
    model_family: str | None = None


class ConfigOut(ConfigSummary):
    latest: ConfigVersionOut
    warnings: list[str] = []


class ValidateOut(BaseModel):
    valid: bool
    errors: list[FieldErrorOut] = []
    warnings: list[str] = []
    data: dict[str, Any] | None = Field(None, description="what the dataset folders hold: per dataset its images, "
                                                          "videos, captions, too-small and unreadable files, aspect "
                                                          "buckets and batches per epoch, plus summary lines")


class DataBackendsBody(BaseModel):
    data_backends: list[dict[str, Any]]


# ---- jobs --------------------------------------------------------------------------------------------
class JobCreate(BaseModel):
    """Submit from a stored config (``config_name`` [+ ``config_version``], optional ``overrides``) or an
    inline one (``train_config`` + ``data_backends`` [+ ``prompt_library``])."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"config_name": "tiny-flux", "overrides": {"max_train_steps": 5}, "priority": 0},
    ]})
    name: str = Field("", max_length=200)
    config_name: str | None = Field(None, pattern=NAME_PATTERN, max_length=200)
    config_version: int | None = Field(None, ge=1, le=2**31)
    train_config: dict[str, Any] | None = None
    data_backends: list[dict[str, Any]] | None = None
    prompt_library: dict[str, str] | None = None
    overrides: dict[str, Any] | None = Field(None, description="keys merged over the train config")
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first; ties run in submission order")
    num_processes: int = Field(1, ge=1, le=512, description="processes for accelerate launch, over all machines")
    num_machines: int = Field(1, ge=1, le=64, description="machines the job spans: that many workers run it at "
                                                          "once (gang-scheduled), one machine rank each")
    retry_on_restart: bool = Field(False, description="re-queue (rather than fail) if the server restarts mid-run")
    max_retries: int = Field(0, ge=0, le=100, description="automatic retries after a trainer crash; each resumes "
                                                           "from the newest checkpoint")
    kind: Literal["train", "cache"] = Field("train", description="'cache': split training's stage 1 (`simpletuner "
                                                                 "cache`), which a train job can depend on")
    depends_on: int | None = Field(None, ge=1, le=MAX_ID, description="a train job: the cache job it waits for; it "
                                                                      "runs once that one succeeds, and fails if it "
                                                                      "fails")

    @model_validator(mode="after")
    def _one_source(self) -> "JobCreate":
        if (self.config_name is None) == (self.train_config is None):
            raise ValueError("give either config_name or train_config (not both)")
        if self.config_name is None and self.config_version is not None:
            raise ValueError("config_version needs config_name")
        if self.num_processes % self.num_machines:
            raise ValueError(f"num_processes: {self.num_processes} processes do not divide evenly over "
                             f"num_machines={self.num_machines} (each machine runs the same number)")
        return self


class JobRetry(BaseModel):
    start_over: bool = Field(False, description="start from step 0 (the previous output is kept aside) instead of "
                                                "resuming from the newest valid checkpoint")


class JobPatch(BaseModel):
    priority: int | None = Field(None, ge=-1000, le=1000)
    name: str | None = Field(None, max_length=200)


class JobOut(BaseModel):
    id: int
    name: str
    status: JobStatus
    priority: int
    config_name: str | None = None
    config_version: int | None = None
    num_processes: int
    num_machines: int = 1
    main_process_ip: str | None = None
    main_process_port: int | None = None
    retry_on_restart: bool
    max_retries: int = 0
    retries: int = Field(0, description="automatic retries used (after trainer crashes)")
    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    attempt: int
    run_dir: str | None = None
    pid: int | None = None
    devices: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    error: str | None = None
    log_tail: str | None = None
    cancel_requested: bool
    progress: dict[str, Any] | None = None
    results: dict[str, Any] | None = None
    queue_position: int | None = Field(None, description="1 = next to start (queued jobs only)")
    warnings: list[str] = []
    kind: Literal["train", "cache"] = "train"
    depends_on: int | None = Field(None, description="the cache job this train job waits for")


class JobDetail(JobOut):
    train_config: dict[str, Any]
    data_backends: list[dict[str, Any]]
    prompt_library: dict[str, str] | None = None


class JobList(BaseModel):
    jobs: list[JobOut]
    total: int


class FileOut(BaseModel):
    path: str
    size: int
    modified: float


# ---- events ------------------------------------------------------------------------------------------
class WebhookEvent(BaseModel):
    """What the trainer posts (signed: ``X-SimpleTuner-Signature: sha256=<hmac of the raw body>``). Numbers are
    finite: NaN and inf are not JSON, and a NaN time cannot be stored."""

    model_config = ConfigDict(allow_inf_nan=False)

    job_id: int | str | None = None
    seq: int = Field(ge=0, le=MAX_ID)
    type: EventType
    time: float
    data: dict[str, Any] = {}

    @field_validator("data")
    @classmethod
    def _finite(cls, data: dict[str, Any]) -> dict[str, Any]:
        def walk(value: Any, path: str) -> None:
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{path}: {value} is not a finite number (send null)")
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(v, f"{path}.{k}")
            elif isinstance(value, list):
                for i, v in enumerate(value):
                    walk(v, f"{path}[{i}]")

        walk(data, "data")
        return data


class EventOut(BaseModel):
    id: int = Field(description="global, increasing; the SSE event id")
    job_id: int
    attempt: int
    source: Literal["trainer", "server"]
    seq: int
    type: str
    time: float
    data: dict[str, Any]


class EventList(BaseModel):
    events: list[EventOut]
    last_id: int = Field(description="pass as ?after= to continue")


class IngestOut(BaseModel):
    accepted: bool
    duplicate: bool = False
    id: int | None = None


# ---- system / datasets --------------------------------------------------------------------------------
class HealthOut(BaseModel):
    status: Literal["ok", "error"] = "ok"
    detail: str | None = None


class SystemOut(BaseModel):
    version: str
    server_id: str
    host: str
    data_dir: str
    database: str
    max_concurrent: int
    accelerators: list[str]
    running: int
    queued: int
    running_here: list[int]
    uptime_s: float
    allowed_roots: list[str]
    torch_imported: bool


class DirEntry(BaseModel):
    name: str
    path: str
    is_dir: bool
    images: int | None = None


class DirListing(BaseModel):
    path: str
    parent: str | None = None
    entries: list[DirEntry]


class DatasetScan(BaseModel):
    path: str
    exists: bool
    images: int = 0
    videos: int = 0
    captions: int = 0
    images_with_captions: int = 0
    subdirs: int = 0
    examples: list[str] = []


class DatasetCreate(BaseModel):
    name: str = Field(pattern=NAME_PATTERN, max_length=200, description="the dataset's name (its folder's name "
                                                                         "when it holds uploads)")
    path: str | None = Field(None, max_length=4096, description="an existing folder under the server's allowed "
                                                                 "roots to use as it is; empty: a new folder for "
                                                                 "uploads in the server's data dir")


class DatasetOut(BaseModel):
    name: str
    path: str
    uploaded: bool = Field(description="True: a folder of uploads in the data dir; False: the user's own folder")
    exists: bool
    created_at: float
    files: int = Field(0, description="images and videos")
    captioned: int = Field(0, description="of them with a .txt caption beside them")


class DatasetFile(BaseModel):
    path: str = Field(description="relative to the dataset folder")
    kind: Literal["image", "video"]
    caption: str | None = Field(None, description="its .txt caption (null: none)")
    width: int | None = None
    height: int | None = None
    bytes: int = 0


class DatasetDetail(DatasetOut):
    items: list[DatasetFile]
    total: int
    offset: int
    scan: dict[str, Any] = Field(description="simpletuner.config.scan's report of the folder at the given "
                                             "resolution settings: captions, too-small images, buckets, batches")


class UploadOut(BaseModel):
    saved: list[str] = Field(description="paths written, relative to the dataset folder")
    skipped: list[dict[str, str]] = Field(description="{name, reason} of each file that was refused")


class CaptionBody(BaseModel):
    caption: str = Field(max_length=65_536)


# ---- workers ------------------------------------------------------------------------------------------
class WorkerTokenCreate(BaseModel):
    name: str = Field(pattern=NAME_PATTERN, max_length=200, description="who or what the token is for")


class WorkerTokenOut(BaseModel):
    id: int
    name: str
    created_at: float
    revoked_at: float | None = None
    last_used_at: float | None = None


class WorkerTokenCreated(WorkerTokenOut):
    token: str = Field(description="shown once: give it to `simpletuner worker --token-file`")


class WorkerRegister(BaseModel):
    name: str = Field(pattern=NAME_PATTERN, max_length=200)
    host: str = Field(max_length=200)
    address: str | None = Field(None, max_length=200, description="where other machines reach this one for a "
                                                                  "multi-machine job's rendezvous (default: the "
                                                                  "address the server sees)")
    devices: list[Annotated_str] = Field(default_factory=list, max_length=64, description="accelerator ids")
    slots: int | None = Field(None, ge=1, le=1024, description="jobs at once (default: one per device, 1 on CPU)")
    replaces: str | None = Field(None, pattern=r"^[0-9a-f]{32}$", description="this worker's id before a restart")
    info: dict[str, Any] | None = None


class WorkerRegistered(BaseModel):
    id: str
    lease_seconds: float
    heartbeat_interval: float
    address: str


class HeartbeatOut(BaseModel):
    lease_expires_at: float
    stop: list[dict[str, Any]] = Field(description="assignments to stop: {assignment_id, job_id, reason}")


class ClaimRequest(BaseModel):
    port: int | None = Field(None, ge=1, le=65535, description="a free port here, in case this worker leads a "
                                                              "multi-machine job's rendezvous")


class ClaimOut(BaseModel):
    assignment_id: int
    job_id: int
    attempt: int
    machine_rank: int
    num_machines: int
    num_processes: int
    main_process_ip: str | None = None
    main_process_port: int | None = None
    run_dir: str
    config: str
    module: str = Field("simpletuner.train", description="what the launcher runs: simpletuner.train, or "
                                                           "simpletuner.cache for a cache job")
    webhook_secret: str | None = None
    allowed_roots: list[str]
    resume_step: int | None = None


class AssignmentStarted(BaseModel):
    pid: int | None = Field(None, ge=1, le=2**31)
    devices: list[Annotated_str] = Field(default_factory=list, max_length=64)


class AssignmentFinished(BaseModel):
    exit_code: int | None = Field(None, ge=-(2**31), le=2**31)
    log_tail: str | None = Field(None, max_length=64 * 1024)


class WorkerOut(BaseModel):
    id: str
    name: str
    host: str
    address: str
    devices: list[str]
    slots: int
    reserved: int
    status: str
    registered_at: float | None = None
    heartbeat_at: float | None = None
    lease_expires_at: float | None = None
    jobs: list[dict[str, Any]] = []
    local: bool = False
