"""A one-node Slurm cluster on this machine for tests: munged, slurmctld and slurmd, each with its
own key, sockets, state and logs in a temporary directory, on free ports, stopped (with every job)
when the context ends. Needs Debian's slurmctld, slurmd, slurm-client and munge."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scancel")


def slurm_missing() -> str | None:
    """What is missing to run Slurm here, or None."""
    missing = [name for name in DAEMONS if shutil.which(name) is None
               and not Path("/usr/sbin", name).exists()]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}; apt-get install slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]

    def sbatch_wait(self, args: list[str], timeout_s: float, cwd: Path) -> subprocess.CompletedProcess[str]:
        """`sbatch --wait ARGS`: returns when the job ends (its exit status is sbatch's)."""
        return subprocess.run(["sbatch", "--wait", *args], cwd=cwd, env=self.env, capture_output=True,
                              text=True, timeout=timeout_s, check=False)


def _kill_leftovers(conf: Path) -> None:
    """SIGKILL every process still running with this cluster's SLURM_CONF (job steps, slurmstepd)."""
    marker = f"SLURM_CONF={conf}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)


@contextlib.contextmanager
def slurm_cluster(root: Path, start_timeout_s: float = 60.0) -> Iterator[SlurmCluster]:
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    key = root / "munge" / "key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    socket_path = root / "munge" / "munge.socket"
    cpus = os.cpu_count() or 1
    memory_mb = max(1024, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 - 2048)
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=sciproto-test",
        "SlurmctldHost=localhost",
        # Slurm asks getaddrinfo for IPv4 only with AI_ADDRCONFIG, which finds nothing where the only
        # interface is loopback (the network namespace of scripts/test.sh); with IPv6 on it asks for any.
        "CommunicationParameters=EnableIPv6",
        "SlurmUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={socket_path}",
        "CredType=cred/munge",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        f"NodeName=localhost CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
        "PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pid_files = [root / "munge" / "munged.pid", root / "slurmctld.pid", root / "slurmd.pid"]
    try:
        subprocess.run([_binary("munged"), "-f", f"--key-file={key}", f"--socket={socket_path}",
                        f"--pid-file={pid_files[0]}", f"--log-file={root / 'log' / 'munged.log'}",
                        f"--seed-file={root / 'munge' / 'seed'}"], check=True, timeout=30)
        subprocess.run([_binary("slurmctld"), "-f", str(conf)], check=True, timeout=30, env=env)
        subprocess.run([_binary("slurmd"), "-f", str(conf), "-N", "localhost"], check=True, timeout=30, env=env)
        deadline = time.monotonic() + start_timeout_s
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True,
                                   timeout=30, check=False).stdout.strip()
            if state == "idle":
                break
            if time.monotonic() > deadline:
                logs = "\n".join((root / "log" / name).read_text()[-2000:] for name in ("slurmctld.log", "slurmd.log")
                                 if (root / "log" / name).exists())
                raise RuntimeError(f"the test Slurm node is {state!r}, not idle, after {start_timeout_s:.0f} s\n{logs}")
            time.sleep(0.5)
        yield SlurmCluster(root, env)
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30, check=False)
        for pid_file in reversed(pid_files):
            with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    os.kill(pid, 0)
                    time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
        _kill_leftovers(conf)


__all__ = ["SlurmCluster", "free_port", "slurm_cluster", "slurm_missing"]
