"""The one way the server runs code an agent wrote: a command in a bubblewrap (`bwrap`) sandbox.

    limits = SandboxLimits(memory_mb=2048, max_processes=64)
    sandbox = Sandbox(workspace, limits)          # raises SandboxUnavailable without bwrap
    process = await sandbox.start([python, "-c", "print(1)"])
    ...
    await process.kill()                          # the sandbox and everything in it
    sandbox.remove()                              # its runtime directory

What a sandboxed command sees: the Python installation and system libraries read-only, its
workspace (the only writable host path, bound at the same path), a private /tmp of bounded size,
a runtime directory for sockets shared with the server, a fresh /proc of its own PID namespace,
minimal /dev, and nothing else of the host: no repository, /root, /home, other workspaces, token or
certificate files, environment variables of the server, or network (a network namespace with only
its own loopback) unless `network` is set. Namespaces come from bwrap (`--unshare-*`,
`--die-with-parent`); this module writes no namespace or seccomp code of its own.

bwrap ties the sandbox to the server's life only part way through its set-up (each of its
processes sets its parent-death signal some time after it starts), so a server killed in the
first milliseconds of a start would leave that sandbox running. Each sandbox therefore also gets
the read end of a pipe whose write end only the server holds (its lifeline,
`sciproto.processes.lifeline_fd`, the one its other children get), and a watcher process
inside it that ends the whole sandbox once that pipe closes: when the server has ended, and every
process it forked without exec with it. Without a sandbox (mode "none") the command gets a parent
death signal and checks, once that is set, that its parent is still the server.

Limits are set inside the sandbox, just before the command starts, by a few lines of Python that
call setrlimit and exec the command: address space (memory), CPU seconds, processes, file size,
no core dumps. Where the server runs as root, the command also runs as a user id of its own,
chosen per sandbox, so that the process limit counts its processes only and nothing it does has
root's rights on files; elsewhere bwrap's user namespace does the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import shutil
import signal
import site
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from env_servers import scratch
from sciproto.processes import lifeline_fd

log = logging.getLogger("env_servers.sandbox")

PACKAGE_HINT = ("install the bubblewrap package (Debian/Ubuntu: apt-get install bubblewrap) on a"
                " host that allows namespaces, or set the environment option sandbox: none to run"
                " agent code unsandboxed, with the server's rights")

# User ids given to sandboxes when the server runs as root: far above any real account's.
UID_BASE, UID_SPAN = 1_500_000_000, 500_000_000
STOP_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 20.0


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or may not create namespaces here."""


class SandboxLimits(BaseModel):
    """What one sandbox may use. Memory, processes and file size are kernel rlimits (per process
    for memory, per sandbox for processes); the workspace size is checked by the caller after
    each run (`Sandbox.workspace_bytes`)."""

    model_config = ConfigDict(extra="forbid")

    memory_mb: int = Field(2048, gt=0, description="Address space of each process (RLIMIT_AS)")
    cpu_seconds: int = Field(3600, gt=0, description="CPU seconds of each process over its life (RLIMIT_CPU)")
    max_processes: int = Field(64, gt=0, description="Processes and threads in the sandbox, its watcher among them (RLIMIT_NPROC)")
    max_file_mb: int = Field(256, gt=0, description="Largest file it may write (RLIMIT_FSIZE)")
    workspace_mb: int = Field(512, gt=0, description="Most the workspace may hold after a run")
    tmp_mb: int = Field(256, gt=0, description="Size of its private /tmp (memory-backed)")
    threads: int = Field(1, gt=0, description="OMP/OpenBLAS/MKL threads numeric libraries start")
    network: bool = Field(False, description="Share the host's network (off: loopback of its own only)")


SandboxMode = Literal["bwrap", "none"]


@functools.cache
def bwrap_path() -> str:
    """The bwrap executable, checked once to create the namespaces a sandbox needs."""
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(f"bwrap was not found on PATH: {PACKAGE_HINT}")
    probe = [path, *_namespace_flags(network=False), "--ro-bind", "/", "/", "--proc", "/proc",
             "--dev", "/dev", "--", "true"]
    try:
        result = subprocess.run(probe, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SandboxUnavailable(f"bwrap could not be run ({error}): {PACKAGE_HINT}") from None
    if result.returncode != 0:
        raise SandboxUnavailable(
            f"bwrap may not create namespaces here ({result.stderr.strip() or f'exit {result.returncode}'}):"
            f" {PACKAGE_HINT}")
    return path


def _running_as_root() -> bool:
    return os.geteuid() == 0


def _namespace_flags(*, network: bool) -> list[str]:
    """Own mount, PID, IPC, UTS and (unless `network`) network namespaces; the sandbox dies with
    the server. As root no user namespace is made: the command drops to its own user id instead
    (see WRAPPER), which keeps the process limit per sandbox and needs CAP_SETUID for that one step."""
    if _running_as_root():
        flags = ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
                 "--cap-add", "CAP_SETUID,CAP_SETGID"]
        if not network:
            flags.append("--unshare-net")
    else:
        flags = ["--unshare-all", "--unshare-user", "--disable-userns"]
        if network:
            flags.append("--share-net")
    return [*flags, "--die-with-parent", "--hostname", "sandbox"]


# Runs inside the sandbox as `python -I -S -c WATCHER lifeline command-pid`, a child of the
# command's process: waits for the server's end of the lifeline pipe to close (the pipe reads as
# hung up), then SIGKILLs every process it may in the sandbox's PID namespace, which ends the
# sandbox. It ends with the command (PR_SET_PDEATHSIG), and at once if the command's process was
# gone before that was set.
WATCHER = """
import ctypes, os, select, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
if os.getppid() != int(sys.argv[2]):
    os._exit(0)
watch = select.poll()
watch.register(int(sys.argv[1]), select.POLLIN)
watch.poll()
os.kill(-1, signal.SIGKILL)
"""

# Runs inside the sandbox as `python -I -S -c WRAPPER lifeline uid gid as cpu nproc fsize -- command...`:
# the sandbox's own user id where one was given, then the watcher (forked before the exec, so that
# the command keeps bwrap's pid and exit status), then the limits; then it execs the command.
WRAPPER = f"""
import os, resource, sys
uid, gid, memory, cpu, nproc, fsize = (int(v) for v in sys.argv[2:8])
if uid >= 0:
    os.setgroups([]); os.setresgid(gid, gid, gid); os.setresuid(uid, uid, uid)
command = os.getpid()
if os.fork() == 0:
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.execv(sys.executable,
                 [sys.executable, "-I", "-S", "-c", {WATCHER!r}, sys.argv[1], str(command)])
    finally:
        os._exit(70)
os.close(int(sys.argv[1]))
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),
                     (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
os.execv(sys.argv[9], sys.argv[9:])
"""

# Runs a command without a sandbox (mode "none") as
# `python -I -S -c UNSANDBOXED server-pid -- command...`: the command gets SIGKILL when the server
# ends (PR_SET_PDEATHSIG, kept across exec); if the server was gone before that was set, the
# command's parent is no longer the server, and it runs nothing.
UNSANDBOXED = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    os._exit(70)
os.execv(sys.argv[3], sys.argv[3:])
"""


def sandbox_python() -> str:
    """The interpreter sandboxed Python code runs on: this one, named by its real venv path
    (a symlinked venv is bound where it really is)."""
    return str(Path(sys.prefix).resolve() / "bin" / Path(sys.executable).name)


def _read_only_paths() -> list[Path]:
    """Host paths a sandboxed Python needs: system libraries, the interpreter, its packages."""
    paths = [Path(p) for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")]
    paths += [Path("/etc") / name for name in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives",
                                               "localtime", "fonts", "mime.types")]
    paths += [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()]
    paths += [Path(p).resolve() for p in site.getsitepackages()]
    # Site-packages in use that are not the installation's own (named by a .pth file, say).
    paths += [Path(p).resolve() for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    kept: list[Path] = []
    for path in paths:
        if path.exists() and not any(path.is_relative_to(k) for k in kept if not k.is_symlink()):
            kept.append(path)
    return kept


def _bind_flags(path: Path, *, rw: bool = False) -> list[str]:
    """Bind `path` at the same place, read-only unless `rw`; a top-level symlink (/bin -> usr/bin)
    stays one. Directories bwrap creates on the way get mode 0755, so that the sandbox's own user
    id can walk through (the private /tmp exists already)."""
    if path.is_symlink() and path.parent == Path("/"):
        return ["--symlink", os.readlink(path), str(path)]
    flags: list[str] = []
    for parent in reversed(path.parents[:-1]):
        if parent != Path("/tmp"):
            flags += ["--perms", "0755", "--dir", str(parent)]
    return [*flags, "--bind" if rw else "--ro-bind", str(path), str(path)]


STDERR_KEPT_BYTES = 4096  # the end of a command's stderr kept to say why it failed


@dataclass
class SandboxedProcess:
    """A command running in a sandbox (its bwrap process leads a process group of its own)."""

    process: asyncio.subprocess.Process
    sandboxed: bool
    _stderr: bytearray = field(default_factory=bytearray)  # the last STDERR_KEPT_BYTES of it
    _stderr_reader: asyncio.Task[None] | None = None

    def keep_stderr(self) -> None:
        """Read the command's stderr (a pipe) as it comes, keeping its end for `stderr_tail`."""
        stream = self.process.stderr
        if stream is None or self._stderr_reader is not None:
            return

        async def read() -> None:
            while chunk := await stream.read(65536):
                self._stderr += chunk
                del self._stderr[:-STDERR_KEPT_BYTES]

        self._stderr_reader = asyncio.get_running_loop().create_task(read())

    async def stderr_tail(self, lines: int = 12, wait_s: float = 2.0) -> str:
        """The last `lines` lines the command wrote to stderr (after waiting up to `wait_s` for
        the rest of it, once the command has ended); empty when it was not kept."""
        if self._stderr_reader is not None and not self.alive:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._stderr_reader), wait_s)
        text = self._stderr.decode(errors="replace").strip()
        return "\n".join(text.splitlines()[-lines:])

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def tasks(self) -> int:
        """Processes and threads of the command and its descendants now (zombies too: the
        process limit counts them until they are reaped); bwrap's own two are not counted."""
        total = 0
        for pid in _descendants(self.process.pid):
            try:
                with open(f"/proc/{pid}/status", "rb") as status:
                    total += int(status.read().split(b"Threads:", 1)[1].split()[0])
            except (OSError, IndexError, ValueError):
                continue
        return max(total - 2, 0) if self.sandboxed else total

    def cpu_seconds(self) -> float:
        """CPU time of every process in the sandbox so far (user + system, waited children
        included), read from /proc."""
        return sum(_cpu_seconds(pid) for pid in _descendants(self.process.pid))

    async def kill(self) -> None:
        """SIGKILL the sandbox: bwrap, and with it (--die-with-parent, PID namespace) every process
        inside; without a sandbox, the command's process group."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), STOP_TIMEOUT_S)
        if self._stderr_reader is not None and not self._stderr_reader.done():
            self._stderr_reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stderr_reader


def _descendants(root: int) -> list[int]:
    """`root` and every process below it, by parent pid."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    ppid = int(stat.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue += children.get(pid, [])
    return found


_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    # fields[11:15]: utime, stime, cutime, cstime (after the state field at 0)
    return sum(int(value) for value in fields[11:15]) / _TICKS


class Sandbox:
    """Sandboxes for one workspace: each `start` runs one command in a fresh sandbox that sees
    the workspace and the runtime directory (`runtime_dir`, for sockets the server connects to)."""

    def __init__(self, workspace: Path, limits: SandboxLimits, mode: SandboxMode = "bwrap") -> None:
        self.workspace = Path(workspace).resolve()
        self.limits = limits
        self.mode = mode
        self.bwrap = bwrap_path() if mode == "bwrap" else None
        self.runtime_dir = scratch.mkdtemp("sciproto-run-")
        # As root, the sandbox's own user id owns what it may write.
        self.uid = UID_BASE + secrets.randbelow(UID_SPAN) if mode == "bwrap" and _running_as_root() else -1
        if self.uid >= 0:
            for path in (self.runtime_dir, self.workspace):
                _chown_tree(path, self.uid)

    def own_workspace(self) -> None:
        """Give what was put in the workspace since the sandbox was made to the sandbox's own
        user id (where it has one), so that its commands may change it."""
        if self.uid >= 0:
            _chown_tree(self.workspace, self.uid)

    def command(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
        """The full command line that runs `argv` in this sandbox (mode "none": `argv` tied to the
        server's life, and nothing else)."""
        if self.bwrap is None:
            return [sandbox_python(), "-I", "-S", "-c", UNSANDBOXED, str(os.getpid()), "--", *argv]
        limits = self.limits
        flags = [self.bwrap, *_namespace_flags(network=limits.network)]
        # The private /tmp first, then what is bound into the sandbox: a Python installation or
        # virtual environment under the host's /tmp stays visible, bound over the private one.
        flags += ["--proc", "/proc", "--dev", "/dev",
                  "--perms", "1777", "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp"]
        for path in _read_only_paths():
            flags += _bind_flags(path)
        for path in (self.workspace, self.runtime_dir):
            flags += [*_bind_flags(path, rw=True)]
        flags += ["--chdir", str(self.workspace), "--clearenv"]
        for name, value in {**self._environment(), **(env or {})}.items():
            flags += ["--setenv", name, value]
        gid = self.uid
        wrapper = [sandbox_python(), "-I", "-S", "-c", WRAPPER, str(lifeline_fd()), str(self.uid), str(gid),
                   str(limits.memory_mb << 20), str(limits.cpu_seconds), str(limits.max_processes),
                   str(limits.max_file_mb << 20), "--"]
        return [*flags, "--", *wrapper, *argv]

    def _environment(self) -> dict[str, str]:
        threads = str(self.limits.threads)
        return {
            "PATH": f"{Path(sandbox_python()).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp", "USER": "sandbox", "LOGNAME": "sandbox", "LANG": "C.UTF-8",
            "TMPDIR": "/tmp", "MPLCONFIGDIR": "/tmp/matplotlib", "IPYTHONDIR": "/tmp/ipython",
            "JUPYTER_RUNTIME_DIR": "/tmp/jupyter", "PYTHONNOUSERSITE": "1",
            "OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
        }

    async def start(self, argv: Sequence[str], env: Mapping[str, str] | None = None, *,
                    keep_stderr: bool = False) -> SandboxedProcess:
        """Start `argv` in a new sandbox, in the workspace, with a clean environment plus `env`.
        Its stdout is dropped; so is its stderr, unless `keep_stderr`: then its end is kept for
        `SandboxedProcess.stderr_tail` (to say why the command failed)."""
        command = self.command(argv, env)
        if self.bwrap is None:
            environment = {**os.environ, **self._environment(), **(env or {})}
            environment.pop("PYTHONPATH", None)
            environment["HOME"] = os.environ.get("HOME", "/tmp")
        else:
            environment = {}
        process = await asyncio.create_subprocess_exec(
            *command, cwd=self.workspace, env=environment, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE if keep_stderr else subprocess.DEVNULL,
            start_new_session=True, pass_fds=() if self.bwrap is None else (lifeline_fd(),))
        started = SandboxedProcess(process, sandboxed=self.bwrap is not None)
        started.keep_stderr()
        return started

    def workspace_bytes(self) -> int:
        """What the workspace holds now (apparent sizes of its files)."""
        total = 0
        for root, _, files in os.walk(self.workspace):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_size
        return total

    def remove(self) -> None:
        """Remove the runtime directory (the workspace belongs to the caller)."""
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def describe(self) -> str:
        """One line for Describe: the mode and its limits."""
        if self.mode == "none":
            return describe_mode("none", self.limits)
        return describe_mode("bwrap", self.limits)


def describe_mode(mode: SandboxMode, limits: SandboxLimits) -> str:
    if mode == "none":
        return ("sandbox: none (agent code runs unsandboxed, with the server's rights; only the cell"
                " time limit applies)")
    return (f"sandbox: bwrap (own mount, PID, IPC, UTS{'' if limits.network else ' and network'} namespaces;"
            f" memory {limits.memory_mb} MiB per process, {limits.max_processes} processes,"
            f" files up to {limits.max_file_mb} MiB, workspace up to {limits.workspace_mb} MiB,"
            f" /tmp {limits.tmp_mb} MiB{', network shared' if limits.network else ''})")


def check_mode(mode: SandboxMode) -> None:
    """At server start: bwrap mode must work here (SandboxUnavailable naming the package and the
    opt-out otherwise); mode none is allowed, with a warning each time."""
    if mode == "bwrap":
        bwrap_path()
    else:
        log.warning("sandbox: none: agent code runs unsandboxed, with the rights of this server's"
                    " user; use it only for trusted agents")


def _chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid)
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)
