"""The collective weight-transfer group between the learner and the policy servers, on
torch.distributed's gloo backend (CPU), and the rules both ends follow. vLLM servers join vLLM's
own NCCL group instead (`policy_server.backends.vllm_backend`); the rules are the same:

- Group (`sciproto.weights.rendezvous.CollectiveRendezvous`): the learner is rank 0 and hosts the rendezvous store (a TCPStore on
  `master_address:master_port`); each server's receiving ranks are rank_offset ..
  rank_offset + ranks - 1; `world_size` counts them all. Both ends read one `CollectiveRendezvous`.
- Generations: the learner names the group it opens in the store (`GENERATION_KEY`, a value unique
  to this learner process and push attempt). A server forms a new group whenever that name differs
  from the one it holds, so after any failed push, or a restart of either side, the next push forms
  a fresh group instead of waiting on a broken one.
- Order and types: an update's tensors travel as the bytes of its UpdateWeights header, in header
  order, exactly as the gRPC chunk stream would carry them (`weights_stream.chunk_parts`), cut into
  broadcasts of `buffer_bytes`; the receiver writes them into a `WeightsReceiver` built from the
  header it already checked against its manifest, so names, shapes and dtypes agree by construction.
- Timeouts: the store, the group formation and every broadcast wait at most `timeout_s`; a peer
  that never joins or dies mid-update fails the update with a TimeoutError or RuntimeError.
"""

from __future__ import annotations

import datetime
import logging
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from sciproto.weights.rendezvous import CollectiveRendezvous
from sciproto.weights.tensors import TensorSpec
from sciproto.weights.wire import WeightsReceiver, chunk_parts

GENERATION_KEY = "sciproto/weights/generation"

log = logging.getLogger(__name__)


def broadcast_sizes(total_bytes: int, buffer_bytes: int) -> list[int]:
    """The byte size of each broadcast of an update of `total_bytes`: what both ends loop over."""
    count = math.ceil(total_bytes / buffer_bytes)
    return [min(buffer_bytes, total_bytes - index * buffer_bytes) for index in range(count)]


class WeightGroup:
    """One member of the gloo weight-transfer group: `rank` 0 is the learner, others receive."""

    def __init__(self, rendezvous: CollectiveRendezvous, rank: int) -> None:
        if not 0 <= rank < rendezvous.world_size:
            raise ValueError(f"rank {rank} is outside the group of world_size {rendezvous.world_size}")
        self.rendezvous = rendezvous
        self.rank = rank
        self._timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        self._store: Any = None
        self._group: Any = None
        self.generation = ""  # the name of the group held, "" when none
        self._formed: set[str] = set()  # names of the groups this member formed (or tried to)
        self._session = secrets.token_hex(6)
        self._attempts = 0

    # -- group formation ---------------------------------------------------------------------------

    def _connect(self) -> Any:
        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore(self.rendezvous.master_address, self.rendezvous.master_port,
                                        is_master=self.rank == 0, timeout=self._timeout, wait_for_workers=False)
        return self._store

    def announce(self) -> str:
        """Learner: name a new group in the store (call before the servers are asked to join)."""
        self.discard()
        self._attempts += 1
        name = f"{self._session}-{self._attempts}"
        self._connect().set(GENERATION_KEY, name)
        return name

    def form(self, name: str | None = None) -> None:
        """Form the group named `name` (the learner's, from `announce`) or the one the store names
        now (a server); returns at once when that group is already held. Blocks until every rank
        joined, at most `timeout_s`."""
        import torch.distributed as dist

        if name is None:
            try:
                name = self._connect().get(GENERATION_KEY).decode()
            except (RuntimeError, OSError):  # a stale connection to a restarted learner: connect once more
                self._store = None
                name = self._connect().get(GENERATION_KEY).decode()
        if name == self.generation and self._group is not None:
            return
        self.discard()
        if name in self._formed:  # its store keys are spent: a group forms once under a name
            raise RuntimeError(f"the weight-transfer group {name} broke on this side; the learner names a new "
                               "group on its next push")
        self._formed.add(name)
        try:
            store = dist.PrefixStore(f"sciproto/weights/{name}/", self._connect())
            self._group = dist.ProcessGroupGloo(store, self.rank, self.rendezvous.world_size, self._timeout)
        except RuntimeError as error:
            raise TimeoutError(f"the weight-transfer group {name} did not form within {self.rendezvous.timeout_s:.0f} s "
                               f"(rank {self.rank} of {self.rendezvous.world_size}): {error}") from error
        self.generation = name
        log.info("joined weight-transfer group %s as rank %d of %d", name, self.rank, self.rendezvous.world_size)

    def discard(self) -> None:
        """Drop the group (after a failure: the next update forms a new one)."""
        self._group, self.generation = None, ""

    def close(self) -> None:
        self.discard()
        self._store = None

    # -- transfer -----------------------------------------------------------------------------------

    def _broadcast(self, buffer: torch.Tensor) -> None:
        if self._group is None:
            raise RuntimeError("no weight-transfer group is formed")
        try:
            self._group.broadcast(buffer, 0, self._timeout).wait(self._timeout)
        except RuntimeError as error:
            self.discard()
            raise RuntimeError(f"a broadcast of the weight-transfer group failed on rank {self.rank}: {error}") from error

    def send(self, tensors: Mapping[str, torch.Tensor], progress: Callable[[int, int], None] | None = None) -> None:
        """Learner: broadcast `tensors` (header order) as `buffer_bytes` pieces of their bytes."""
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        sizes = broadcast_sizes(total, self.rendezvous.buffer_bytes)
        for index, parts in enumerate(chunk_parts(tensors, self.rendezvous.buffer_bytes)):
            buffer = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
            if buffer.numel() != sizes[index]:
                raise AssertionError(f"broadcast {index} has {buffer.numel()} bytes, expected {sizes[index]}")
            self._broadcast(buffer)
            if progress is not None:
                progress(index + 1, len(sizes))

    def receive(self, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """Server: receive the tensors of `specs` (header order) into fresh CPU tensors."""
        receiver = WeightsReceiver(specs)
        for size in broadcast_sizes(receiver.total_bytes, self.rendezvous.buffer_bytes):
            buffer = torch.empty(size, dtype=torch.uint8)
            self._broadcast(buffer)
            receiver.write(memoryview(buffer.numpy()))
        return receiver.finish()
