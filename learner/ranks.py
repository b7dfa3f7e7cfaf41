"""The learner's data-parallel ranks: rank 0 serves LearnerService and leads, the others follow.

Under FSDP2 every trainer call that touches the weights is collective (`train_step`,
`state_dict_for_push`, `save_checkpoint`, `load_checkpoint`): every rank must make it, in the same
order. The service makes each through `Ranks.call`. In one process that just calls. With several
ranks, rank 0 first names the call in the rendezvous store (`command/<n>`) and hands its arguments
to the others (`broadcast_object_list`), then all ranks run it; one lock keeps the calls in one
order. The other ranks run `follow`: wait for the next command, run it, until rank 0 says stop.

    rank 0 (LearnerService)                    rank 1.. (follow)
      call("train_step", groups)                 wait command/<n>   (store, WAIT_S at a time)
        store.set(command/<n>, name)   ------>   read name
        broadcast_object_list(args)    ------>   receive args
        trainer.train_step(groups)     <----->   trainer.train_step(groups)   FSDP2 collectives
      ...
      close(): "stop", barrier, destroy  ---->   barrier, destroy, return

A follower waits for commands in bounded store waits, so a learner that waits long for rollouts
never trips the process group's timeout; a follower whose rank 0 is gone sees the store's
connection close and ends with `LeaderGone`. A rank that dies makes rank 0's next collective fail
(gloo: at once when its connections close; a lost node: within `timeout_s` of the process group),
and `call` raises `RanksFailed`, one line. After a failed call the ranks may be out of step: a
follower ends (`RanksFailed`), so whatever started it sees the rank gone.

`GRPOTrainer.interrupt` (a stop that ends a step mid-way) works in one process only: with several
ranks a step in flight runs to its end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.distributed import current_context
from learner.trainer import GRPOTrainer
from sciproto.config import ConfigError

log = logging.getLogger(__name__)

WAIT_S = 10.0  # a follower waits for the next command this long at a time, then again
STOP = "stop"


# Every collective call a rank can be told to make, by name; each takes the trainer first.
COMMANDS: dict[str, Callable[..., Any]] = {
    "train_step": GRPOTrainer.train_step,
    "state_dict_for_push": GRPOTrainer.state_dict_for_push,
    "save_checkpoint": save_checkpoint,
    "load_checkpoint": load_checkpoint,
}


class RanksFailed(RuntimeError):
    """A collective call failed with several ranks: a rank may be gone, and the ranks may be out
    of step. The message is one line."""


class LeaderGone(RuntimeError):
    """A follower lost rank 0 (its store connection closed)."""


@dataclass(frozen=True)
class RankEnv:
    """Where this process stands among the ranks, as torchrun (or the Ray engine) says it in the
    environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (rank 0 listens there)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls) -> RankEnv:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls(0, 1, "", 0)
        try:
            return cls(int(os.environ["RANK"]), world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        except KeyError as missing:
            raise ConfigError(f"WORLD_SIZE={world_size} needs {missing.args[0]} in the environment too "
                             "(RANK, MASTER_ADDR, MASTER_PORT)") from None


def join(env: RankEnv, timeout_s: float = 600.0) -> dist.Store | None:
    """Join the ranks' process group (NCCL on CUDA, each rank on cuda:LOCAL_RANK; gloo otherwise),
    over a store rank 0 serves at MASTER_ADDR:MASTER_PORT; the store, or None in one process.
    `timeout_s` bounds every collective (and the wait for all ranks to join)."""
    if env.world_size == 1:
        return None
    # Under torchrun its agent already serves the store at MASTER_PORT: every rank is a client.
    serves = env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, serves,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    store = dist.PrefixStore("sciproto-learner", store)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("pg", store),
                            rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    return store


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _leave() -> None:
    """Meet the other ranks, then tear the process group down (a rank that destroys it while
    another still has gloo work in flight can abort that one)."""
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


class Ranks:
    """Rank 0's side: every collective trainer call goes through `call` (or `run` from asyncio)."""

    def __init__(self, trainer: GRPOTrainer, store: dist.Store | None = None) -> None:
        self.trainer = trainer
        self.context = current_context()
        if self.context.is_distributed and (store is None or not self.context.is_main):
            raise ValueError("with several ranks, Ranks runs on rank 0 with the ranks' store; "
                             "the other ranks run follow()")
        self._store = store
        self._lock = threading.Lock()
        self._sent = 0
        self._closed = False

    @property
    def world_size(self) -> int:
        return self.context.world_size

    def call(self, name: str, *args: Any) -> Any:
        """Run trainer call `name` on every rank (blocking); rank 0's result."""
        with self._lock:
            if self._closed:
                raise RanksFailed(f"{name} after the learner's ranks were stopped")
            if not self.context.is_distributed:
                return COMMANDS[name](self.trainer, *args)
            try:
                self._tell(name, list(args))
                return COMMANDS[name](self.trainer, *args)
            except Exception as error:
                raise RanksFailed(f"{name} failed on rank 0 of {self.world_size} learner ranks (is a rank gone? "
                                  f"see its log): {_one_line(error)}") from error

    async def run(self, name: str, *args: Any) -> Any:
        """`call` from asyncio, in a worker thread."""
        return await asyncio.to_thread(self.call, name, *args)

    def _tell(self, name: str, args: list[Any]) -> None:
        assert self._store is not None
        number = self._sent
        self._store.set(f"command/{number}", name)
        if number:  # every follower read the one before: it took part in its collectives
            self._store.delete_key(f"command/{number - 1}")
        self._sent += 1
        dist.broadcast_object_list([args], src=0)

    def close(self) -> None:
        """Tell the followers to stop, meet them, leave the process group (no-op in one process)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self.context.is_distributed:
                return
            try:
                self._tell(STOP, [])
                _leave()
            except RuntimeError as error:  # torch.distributed's errors: a rank is gone
                log.error("stopping the learner's ranks: %s", _one_line(error))
                if dist.is_initialized():
                    dist.destroy_process_group()


def follow(trainer: GRPOTrainer, store: dist.Store, wait_s: float = WAIT_S,
           stopping: threading.Event | None = None) -> None:
    """A follower's life: run rank 0's commands until it says stop. Raises LeaderGone when rank 0's
    store goes away (or `stopping` is set before rank 0 said stop), RanksFailed when a command
    failed here (the ranks may be out of step)."""
    context = current_context()
    number = 0
    try:
        while True:
            key = f"command/{number}"
            while True:
                if stopping is not None and stopping.is_set():
                    raise LeaderGone("stopped before rank 0 said stop")
                try:
                    store.wait([key], timedelta(seconds=wait_s))
                    break
                except dist.DistStoreError:  # nothing yet: rank 0 waits for rollouts
                    continue
                except dist.DistNetworkError as error:
                    raise LeaderGone(f"learner rank {context.rank} lost rank 0: {_one_line(error)}") from None
            name = store.get(key).decode()
            number += 1
            payload: list[Any] = [None]
            dist.broadcast_object_list(payload, src=0)
            if name == STOP:
                _leave()
                log.info("learner rank %d stopped by rank 0 after %d commands", context.rank, number - 1)
                return
            try:
                COMMANDS[name](trainer, *payload[0])
            except Exception as error:
                raise RanksFailed(f"{name} failed on learner rank {context.rank}: {_one_line(error)}") from error
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


__all__ = ["COMMANDS", "LeaderGone", "RankEnv", "Ranks", "RanksFailed", "follow", "join"]
