"""A fork server for Python agent programs: it imports the modules the agent needs once, then
forks one child per run, so a run costs a fork instead of a new interpreter and its imports
(`import openai` alone is about 1 s of CPU). clients.agent_process starts it with the agent's own
interpreter, by path; it imports nothing but the standard library, so that interpreter needs no
sciproto.

    PYTHON agent_zygote.py PATH0 MODULE [MODULE ...]

PATH0 is what `sys.path[0]` is for the agent (its script's directory; the working directory for
`-m`): the modules are imported, and every run starts, with it in place of this file's directory.

Protocol: JSON lines. It writes {"ready": true} once its modules are imported (or {"error": "..."}
and exits 1). It reads

    {"run": ID, "argv": ["SCRIPT" | "-m", "MODULE", ARGS...], "env": {...}, "cwd": DIR, "stderr": PATH}
    {"kill": ID}

and writes {"started": ID, "pid": PID} after each fork and {"exited": ID, "code": CODE} when that
child ends (CODE < 0: killed by signal -CODE). PATH, a file the parent made, is opened before the
fork: after "started" the parent may remove its name. A run whose PATH cannot be opened (the parent
removed it: it gave up on the run) is not forked: {"exited": ID, "code": 1, "error": "..."}. A child that imported modules this server had not
(a lazy import the preload missed: each run pays for it again) says so before it ends, naming the
first few that are not inside another of them (`openai.resources`, not its hundreds of submodules):

    {"imported": ID, "count": N, "modules": ["package.lazy_part", ...]}

A child runs the script as `__main__` with exactly `env` as its environment, stdin and stdout on
/dev/null and stderr to PATH; it dies with SIGKILL if this server dies. When its stdin closes (its
parent is gone or done) the server kills every child it has, reaps them, and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import pkgutil  # noqa: F401 - runpy.run_path imports it (and typing, weakref) on first use: once, here
import runpy
import select
import signal
import sys
import traceback

PR_SET_PDEATHSIG = 1
REPORTED_MODULES = 12  # names in an "imported" message (its line stays one atomic pipe write)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that forked it exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (AttributeError, OSError):  # not Linux: the server's own stdin EOF still kills its children
        pass


def _child(request: dict, err: int, wakeup: tuple[int, int], imports: tuple[int, int]) -> None:
    """In the forked child: become the run (stderr to `err`), then exit with its status (never returns)."""
    code = 1
    preloaded = set(sys.modules)
    try:
        _die_with_parent()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (*wakeup, imports[0]):
            os.close(fd)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err, 2)
        os.close(null)
        os.close(err)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the run's own failure: its traceback, as python would print it
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            _report_imports(imports[1], request["run"], [name for name in sys.modules if name not in preloaded])
        finally:
            os._exit(code & 0xFF)


def _report_imports(fd: int, run: object, late: list[str]) -> None:
    """Tell the server (through the pipe `fd`) which modules this run imported after the fork, in
    the order their imports began: the first is what the script imported, the rest what that pulled in."""
    if not late:
        return
    within = set(late)
    roots = [name for name in late if name.rpartition(".")[0] not in within][:REPORTED_MODULES]
    line = json.dumps({"imported": run, "count": len(late), "modules": roots}).encode() + b"\n"
    if len(line) > select.PIPE_BUF:
        line = json.dumps({"imported": run, "count": len(late), "modules": []}).encode() + b"\n"
    os.write(fd, line)


def serve(modules: list[str]) -> int:
    out = sys.stdout

    def say(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    try:
        for module in modules:
            importlib.import_module(module)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which says what to fix
        say({"error": f"import {module} failed: {type(error).__name__}: {error}"})
        return 1
    wakeup = os.pipe()
    for fd in wakeup:
        os.set_blocking(fd, False)
    imports = os.pipe()  # children write their "imported" lines here; this loop passes them on
    os.set_blocking(imports[0], False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, object] = {}  # pid -> run id
    say({"ready": True})

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            run = children.pop(pid, None)
            if run is not None:
                say({"exited": run, "code": os.waitstatus_to_exitcode(status)})

    stdin, pending, reported = sys.stdin.buffer.raw, b"", b""
    try:
        while True:
            ready, _, _ = select.select([stdin, wakeup[0], imports[0]], [], [])
            if imports[0] in ready:
                with contextlib.suppress(BlockingIOError):  # nothing more to read now
                    reported += os.read(imports[0], 65536)
                *lines, reported = reported.split(b"\n")
                for line in lines:
                    out.write(line.decode() + "\n")
                out.flush()
            if wakeup[0] in ready:
                while True:
                    try:
                        if not os.read(wakeup[0], 512):
                            break
                    except BlockingIOError:
                        break
                reap()
            if stdin not in ready:
                continue
            chunk = os.read(stdin.fileno(), 65536)
            if not chunk:
                return 0
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                request = json.loads(line)
                if "kill" in request:
                    for pid, run in children.items():
                        if run == request["kill"]:
                            os.kill(pid, signal.SIGKILL)
                    continue
                out.flush()
                # Opened here, before the fork: once "started" is said, the parent may remove the
                # file's name, and the run still writes to it (nothing is left if the parent is killed).
                # Not created: a file the parent has removed again is a run it gave up on.
                try:
                    err = os.open(request["stderr"], os.O_WRONLY | os.O_TRUNC)
                except OSError as error:
                    say({"exited": request["run"], "code": 1, "error": f"cannot open its stderr: {error}"})
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(request, err, wakeup, imports)
                os.close(err)
                children[pid] = request["run"]
                say({"started": request["run"], "pid": pid})
            reap()
    finally:
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


if __name__ == "__main__":
    _die_with_parent()
    sys.path[0] = sys.argv[1]
    sys.exit(serve(sys.argv[2:]))
