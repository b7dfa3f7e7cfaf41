"""A Jupyter kernel in a sandbox: start it, run one cell under limits, stop it.

    kernel = await SandboxedKernel.start(sandbox)
    result = await kernel.run_cell("print(1)", CellLimits(wall_s=60, cpu_s=60, max_output_chars=100_000))
    result.outputs, result.stopped        # nbformat outputs; why the cell was stopped, if it was
    await kernel.stop()

The kernel talks to the server over ZeroMQ's IPC transport, on sockets in the sandbox's runtime
directory: inside a network namespace the server's loopback TCP ports are out of reach. A cell
that outlives its wall time or CPU budget is interrupted (an interrupt_request on the control
channel); a kernel that does not stop then, or that died (out of memory, os._exit), is killed with
its whole sandbox and started again, and the result says so. Starting a kernel takes nothing but a
Sandbox, so an episode that needs a fresh one (a restart, a replay of earlier cells) starts it the
same way.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import signal
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import nbformat
import zmq.asyncio
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.connect import write_connection_file

from env_servers.sandbox import Sandbox, SandboxedProcess, sandbox_python

KERNEL_READY_TIMEOUT_S = 60.0
INTERRUPT_GRACE_S = 5.0  # after an interrupt, how long the cell has to end before the kernel is killed
SPARE_TASKS = 4  # a cell that leaves fewer processes than this to spare gets a fresh kernel
POLL_S = 0.25  # how often a running cell's time, CPU and kernel are checked


@dataclass(frozen=True)
class CellLimits:
    wall_s: float
    cpu_s: float
    max_output_chars: int


@dataclass
class CellResult:
    outputs: list[Any] = field(default_factory=list)
    stopped: str | None = None  # why the cell was stopped before it finished, if it was
    restarted: bool = False  # the kernel was started again: the episode's variables are gone


class SandboxedKernel:
    """One ipykernel process in a sandbox and a client connected to it."""

    def __init__(self, sandbox: Sandbox, process: SandboxedProcess, client: AsyncKernelClient) -> None:
        self.sandbox, self.process, self.client = sandbox, process, client
        # A kernel its owner lost without stop() (an episode never closed) is released when it is
        # collected: its client's sockets closed and its context destroyed (a ZeroMQ context that
        # reaches the garbage collector with sockets open blocks the collecting thread in term()),
        # and its sandbox killed.
        self._held = {"client": client, "pid": process.process.pid}
        weakref.finalize(self, _release, self._held)

    @property
    def client(self) -> AsyncKernelClient:
        return self._client

    @client.setter
    def client(self, client: AsyncKernelClient) -> None:
        self._client = client
        if hasattr(self, "_held"):
            self._held["client"] = client

    @classmethod
    async def start(cls, sandbox: Sandbox) -> SandboxedKernel:
        """A kernel in `sandbox`, answering before this returns (its IOPub subscription is live,
        so the first cell's output cannot be missed)."""
        connection_file = sandbox.runtime_dir / f"kernel-{secrets.token_hex(4)}.json"
        path, info = write_connection_file(
            str(connection_file), transport="ipc", ip=str(sandbox.runtime_dir / "k"),
            key=secrets.token_hex(32).encode(), kernel_name="python3")
        if sandbox.uid >= 0:
            os.chown(path, sandbox.uid, sandbox.uid)
        process = await sandbox.start([sandbox_python(), "-m", "ipykernel_launcher", "-f", path], keep_stderr=True)
        # A context of its own, closed with the kernel, whose sockets never linger: a context
        # left to the garbage collector with sockets open blocks its thread in term().
        context = zmq.asyncio.Context()
        context.linger = 0
        client = AsyncKernelClient(context=context)
        client.load_connection_info(info)
        client.start_channels(hb=False)  # the server watches the process itself
        kernel = cls(sandbox, process, client)
        try:
            await kernel._wait_ready(time.monotonic() + KERNEL_READY_TIMEOUT_S)
        except BaseException:
            await kernel.stop()
            raise
        return kernel

    async def _wait_ready(self, deadline: float) -> None:
        """Until the kernel answers kernel_info on the shell channel and its IOPub messages reach
        this client (a subscription made late misses what was published before it: ZeroMQ's
        late joiner, which would leave the first cell waiting for output already sent)."""
        while True:
            if not self.process.alive:
                said = await self.process.stderr_tail()
                raise RuntimeError(f"the kernel exited with status {self.process.returncode} before it was ready"
                                   + (f"; the end of its stderr:\n{said}" if said else " (it wrote nothing to stderr)"))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the kernel did not answer within {KERNEL_READY_TIMEOUT_S:g} s")
            msg_id = self.client.kernel_info()
            try:
                while (await self.client.get_shell_msg(timeout=POLL_S))["parent_header"].get("msg_id") != msg_id:
                    pass
                while (await self.client.get_iopub_msg(timeout=POLL_S))["parent_header"].get("msg_id") != msg_id:
                    pass
                return
            except queue.Empty:
                continue

    async def answers(self, timeout_s: float) -> bool:
        """Whether the kernel is alive and answers a kernel_info request within `timeout_s`."""
        if not self.process.alive:
            return False
        msg_id = self.client.kernel_info()
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and self.process.alive:
            try:
                reply = await self.client.get_shell_msg(timeout=min(left, POLL_S))
            except queue.Empty:
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                return True
        return False

    async def import_modules(self, modules: Sequence[str], limits: CellLimits) -> None:
        """Import `modules` ahead of the first cell, leaving no name behind in the user's namespace
        and no entry in the history (the first cell is still In [1]); RuntimeError if one fails."""
        if not modules:
            return
        code = ("import importlib as _sciproto_importlib\n"
                f"for _sciproto_module in {list(modules)!r}:\n"
                "    _sciproto_importlib.import_module(_sciproto_module)\n"
                "del _sciproto_importlib, _sciproto_module")
        result = await self.run_cell(code, limits, store_history=False)
        errors = [output for output in result.outputs if output.get("output_type") == "error"]
        if result.stopped is not None or errors:
            why = result.stopped or f"{errors[0].get('ename')}: {errors[0].get('evalue')}"
            raise RuntimeError(f"importing {', '.join(modules)} ahead failed: {why}")

    async def run_cell(self, source: str, limits: CellLimits, *, store_history: bool = True) -> CellResult:
        """Run `source` and collect its outputs (at most `max_output_chars` characters of them);
        stop it at `wall_s` seconds or `cpu_s` CPU seconds. store_history=False: the run takes no
        execution count and no place in the history."""
        result = CellResult()
        msg_id = self.client.execute(source, store_history=store_history)
        started, cpu_start = time.monotonic(), self.process.cpu_seconds()
        interrupted_at: float | None = None
        printed, checked = 0, started
        while True:
            if interrupted_at is None:
                if time.monotonic() - checked >= POLL_S:  # at most every POLL_S: it reads /proc
                    checked = time.monotonic()
                    reason = self._limit_reached(limits, started, cpu_start)
                    if reason is not None:
                        result.stopped = reason
                        await self._interrupt()
                        interrupted_at = time.monotonic()
            elif time.monotonic() - interrupted_at > INTERRUPT_GRACE_S:
                result.stopped = f"{result.stopped}; it did not stop when interrupted"
                break
            if not self.process.alive:
                result.stopped = (f"{result.stopped}; the kernel" if result.stopped else "the kernel") + (
                    f" died (exit status {self.process.returncode}, out of memory or os._exit?)")
                break
            try:
                message = await self.client.get_iopub_msg(timeout=POLL_S)
            except queue.Empty:
                continue
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "status" and content["execution_state"] == "idle":
                left = self.process.tasks()
                if self.process.sandboxed and left > self.sandbox.limits.max_processes - SPARE_TASKS:
                    result.stopped = (f"it left {left} processes and threads running, about the most"
                                      f" the sandbox allows ({self.sandbox.limits.max_processes}), so that"
                                      " the next cell could not start one")
                    break
                return result
            output = _output(kind, content)
            if output is None:
                continue
            if printed > limits.max_output_chars:
                continue
            size = len(str(content))
            if printed + size > limits.max_output_chars:
                if kind == "stream":  # keep what fits of it
                    output.text = output.text[:max(limits.max_output_chars - printed, 0)]
                    result.outputs.append(output)
                result.outputs.append(nbformat.v4.new_output(
                    "stream", name="stderr",
                    text=f"\n[output cut: the cell printed more than {limits.max_output_chars} characters]\n"))
                printed = limits.max_output_chars + 1
                continue
            printed += size
            result.outputs.append(output)
        await self.restart()
        result.restarted = True
        return result

    def _limit_reached(self, limits: CellLimits, started: float, cpu_start: float) -> str | None:
        if time.monotonic() - started > limits.wall_s:
            return f"the cell ran longer than its time limit of {limits.wall_s:g} s"
        if self.process.cpu_seconds() - cpu_start > limits.cpu_s:
            return f"the cell used more than its CPU time limit of {limits.cpu_s:g} s"
        return None

    async def _interrupt(self) -> None:
        """Ask the kernel to interrupt its cell (ipykernel raises KeyboardInterrupt in it)."""
        self.client.control_channel.send(self.client.session.msg("interrupt_request", {}))

    async def restart(self) -> None:
        """Kill the kernel and its sandbox, and start a fresh one on the same workspace."""
        await self.stop()
        fresh = await SandboxedKernel.start(self.sandbox)
        self.process, self.client = fresh.process, fresh.client
        self._held["pid"] = fresh.process.process.pid
        fresh._held.clear()  # this kernel owns them now

    async def stop(self) -> None:
        """Kill the sandbox (and every process in it); the client's sockets close."""
        with contextlib.suppress(Exception):
            self.client.stop_channels()
            self.client.context.destroy(linger=0)
        self._held.clear()  # nothing left for the finalizer
        await self.process.kill()


def _release(held: dict[str, Any]) -> None:
    """The finalizer of a SandboxedKernel (see its __init__): synchronous, never raises."""
    client, pid = held.pop("client", None), held.pop("pid", None)
    if client is not None:
        with contextlib.suppress(Exception):
            client.stop_channels()
            client.context.destroy(linger=0)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _output(kind: str, content: dict[str, Any]) -> Any:
    if kind == "stream":
        return nbformat.v4.new_output("stream", name=content["name"], text=content["text"])
    if kind == "execute_result":
        return nbformat.v4.new_output("execute_result", data=content.get("data", {}),
                                      metadata=content.get("metadata", {}),
                                      execution_count=content.get("execution_count"))
    if kind == "display_data":
        return nbformat.v4.new_output("display_data", data=content.get("data", {}),
                                      metadata=content.get("metadata", {}))
    if kind == "error":
        return nbformat.v4.new_output("error", ename=content.get("ename", ""),
                                      evalue=content.get("evalue", ""), traceback=content.get("traceback", []))
    return None
