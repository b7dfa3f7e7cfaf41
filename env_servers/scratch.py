"""Where this process keeps its episodes' directories, and the removal of a dead server's.

    workspace = scratch.mkdtemp("sciproto-ws-")    # under this process's own scratch directory
    removed = scratch.remove_orphans()             # at server start: dead servers' directories

Every workspace and kernel runtime directory a server makes lives in one directory of its own,
`$TMPDIR/sciproto-env-<pid>-<random>/`. That directory holds a lock file, locked (flock) by the
process for as long as it lives: the kernel drops the lock when the process ends, however it ends
(SIGKILL included), so another process can tell a dead server's directory from a live one's without
trusting process ids, which are reused. The directory appears under its final name only once locked
(it is made under a hidden name, locked, then renamed), so a server starting at the same moment is
never taken for a dead one. A clean exit removes the directory; a killed server's stays until
`remove_orphans` runs (at the next server start).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("env_servers.scratch")

PREFIX = "sciproto-env-"
LOCK_NAME = ".owner.lock"

_lock = threading.Lock()
_root: Path | None = None
_root_fd: int | None = None  # the open, locked lock file: held until the process ends


def root() -> Path:
    """This process's scratch directory, made (and locked) on first use."""
    global _root, _root_fd
    with _lock:
        if _root is None or not _root.is_dir():
            staging = Path(tempfile.mkdtemp(prefix=f".{PREFIX}staging-"))
            fd = os.open(staging / LOCK_NAME, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else holds it
            final = staging.with_name(f"{PREFIX}{os.getpid()}-{staging.name.rsplit('-', 1)[-1]}")
            staging.rename(final)
            if _root_fd is not None:
                os.close(_root_fd)
            _root, _root_fd = final, fd
            atexit.register(_remove_own, final)
        return _root


def mkdtemp(prefix: str) -> Path:
    """A new directory in this process's scratch directory (the caller removes it)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root()))


def _remove_own(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def remove_orphans(parent: Path | None = None) -> list[Path]:
    """Remove the scratch directories in `parent` (the temporary directory by default) whose
    process is gone: those whose lock file this call can lock. A live process's directory (its
    lock held) and this process's own are left alone. Returns what was removed."""
    parent = Path(parent or tempfile.gettempdir())
    removed: list[Path] = []
    for path in parent.glob(f"{PREFIX}*"):
        if path == _root or not path.is_dir() or path.is_symlink():
            continue
        try:
            fd = os.open(path / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # no lock file: not one of ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its process is alive
        except OSError:
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    if removed:
        log.info("removed %d scratch directories of env servers that are gone: %s", len(removed),
                 ", ".join(str(path) for path in removed))
    return removed
