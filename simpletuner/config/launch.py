"""The one place that builds the ``accelerate launch`` command of a training run: ``simpletuner train
--num_processes N``, the server's own jobs and ``simpletuner worker`` all call :func:`accelerate_command`.

``num_processes`` is the total over all machines, as accelerate counts it; a run on ``num_machines`` > 1 machines
gives each machine its ``machine_rank`` and the rendezvous address of rank 0 (``main_process_ip``/``port``), which
torch.distributed uses for its static rendezvous. On a machine without GPUs, ``accelerate launch --cpu`` runs one
process whatever ``--num_processes`` says; several gloo ranks need ``--multi_gpu`` with ``ACCELERATE_USE_CPU=1``
(:func:`launch_env` sets it).

Standard library only: the server (which never imports torch), the trainer's CLI and the worker all use it.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

TRAIN_MODULE = "simpletuner.train"


@dataclass(frozen=True)
class LaunchSpec:
    """Where one machine's share of a run goes."""

    num_processes: int = 1  # over all machines
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    use_cpu: bool = False  # this machine has no accelerators (gloo ranks on the CPU)

    @property
    def processes_here(self) -> int:
        return self.num_processes // self.num_machines

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1 or self.num_machines > 1


def problems(spec: LaunchSpec) -> list[tuple[str, str]]:
    """(field, message) for every value that cannot launch; empty when the spec is usable."""
    out: list[tuple[str, str]] = []
    if spec.num_processes < 1:
        out.append(("num_processes", f"{spec.num_processes} is below 1"))
    if spec.num_machines < 1:
        out.append(("num_machines", f"{spec.num_machines} is below 1"))
    if out:
        return out
    if spec.num_processes % spec.num_machines:
        out.append(("num_processes", f"{spec.num_processes} processes do not divide evenly over "
                                     f"{spec.num_machines} machines (each machine runs the same number)"))
    if not 0 <= spec.machine_rank < spec.num_machines:
        out.append(("machine_rank", f"{spec.machine_rank} is not in 0..{spec.num_machines - 1}"))
    if spec.num_machines > 1:
        if not spec.main_process_ip:
            out.append(("main_process_ip", "a run on several machines needs rank 0's address"))
        elif not _is_host(spec.main_process_ip):
            out.append(("main_process_ip", f"{spec.main_process_ip!r} is not a host name or IP address"))
        if spec.main_process_port is None:
            out.append(("main_process_port", "a run on several machines needs rank 0's rendezvous port"))
    if spec.main_process_port is not None and not 1 <= spec.main_process_port <= 65535:
        out.append(("main_process_port", f"{spec.main_process_port} is not a TCP port (1..65535)"))
    return out


def _is_host(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        labels = value.rstrip(".").split(".")
        return all(label and len(label) <= 63 and label.replace("-", "").isalnum() and label[0] != "-"
                   for label in labels)


def accelerate_command(spec: LaunchSpec, train_args: list[str], python: str | None = None,
                       module: str = TRAIN_MODULE) -> list[str]:
    """``python -m accelerate.commands.launch ... -m <module> <train_args>`` for this machine (``module``: the
    trainer, or split training's stage 1 ``simpletuner.cache``).

    ValueError naming the field when the spec cannot launch."""
    bad = problems(spec)
    if bad:
        raise ValueError("; ".join(f"{field}: {message}" for field, message in bad))
    cmd = [python or sys.executable, "-m", "accelerate.commands.launch",
           "--num_processes", str(spec.num_processes), "--num_machines", str(spec.num_machines),
           "--mixed_precision", "no", "--dynamo_backend", "no"]
    if spec.distributed:
        cmd.append("--multi_gpu")  # with ACCELERATE_USE_CPU=1 on a CPU machine: real gloo ranks
    elif spec.use_cpu:
        cmd.append("--cpu")
    if spec.num_machines > 1:
        cmd += ["--machine_rank", str(spec.machine_rank), "--main_process_ip", str(spec.main_process_ip),
                "--main_process_port", str(spec.main_process_port), "--rdzv_backend", "static"]
    elif spec.main_process_port is not None:
        cmd += ["--main_process_port", str(spec.main_process_port)]
    return cmd + ["-m", module, *train_args]


def launch_env(spec: LaunchSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the launched run: ``base`` (default: this process's) plus what the spec needs."""
    env = dict(os.environ if base is None else base)
    if spec.use_cpu:
        env["ACCELERATE_USE_CPU"] = "1"
    return env


# ---- a launched run dies with whoever launched it -------------------------------------------------------------
PR_SET_PDEATHSIG = 1
PARENT_ENV = "SIMPLETUNER_DIE_WITH_PARENT"


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; False elsewhere). A worker
    that is killed with -9 then leaves no trainer behind writing into a run another worker has taken over."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent_from_env() -> None:
    """In a launched trainer: when ``SIMPLETUNER_DIE_WITH_PARENT`` is set, die with the launcher (and exit at once
    if it is already gone)."""
    if not os.environ.get(PARENT_ENV):
        return
    parent = os.getppid()
    if die_with_parent() and os.getppid() != parent:  # the launcher died before the request took hold
        os._exit(137)
