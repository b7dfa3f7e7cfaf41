"""LearnerService: rollout groups in, optimizer steps out, new weights pushed to the policy servers.

This module is the gRPC servicer, the group accounting and the optimizer loop; it delegates the
reading of RolloutGroup messages to `learner.wire`, the learner state a checkpoint holds to
`learner.learner_state`, and the push and reconcile of the policy servers to `learner.policy_sync`.

    TrainStep stream --> validate --> dedupe --> RolloutBuffer --> optimizer loop (background)
         ^                                        (staleness K)       take batch_groups groups
         |                                                            train_step (worker thread)
         +--- GroupReceipt per group                                  push weights (every push_every)
         +--- OptimizerStepResult per step, to every open stream  <---+ metrics.jsonl, checkpoints
         +--- StepFailure when a step fails (its groups go back)      reconcile policy versions (timer)

Receipts: accepted, or refused with a stable reason: "duplicate" (group_id seen before, in this
process or trained before the checkpoint we resumed from, so retries never count twice),
"invalid" (the group cannot be read; the receipt's message says why), "stale" (already more than
max_staleness versions behind on arrival), "no_signal" (fewer than two scored samples or all
rewards equal: GRPO would learn nothing), "busy" (no buffer slot freed within add_timeout_s).
A group with objective SFT (demonstrations, learner/sft.py) is never "stale" nor "no_signal"; it is
"invalid" when no sample has a trainable token, or when a sample's first token is trained (it has
no prompt to extend).

Accounting: every accepted group belongs to the stream that last sent it. A step result goes to
every open stream, but names to each only its own groups: the ids the step consumed and the ids
dropped as stale when it took its batch. A failed step leaves the weights and optimizer state as
they were before it (learner/trainer.py), puts its groups back at the front of the buffer and says
so (StepFailure.returned_group_ids); after max_step_attempts failures in a row a group is given up
(abandoned_group_ids). A group sent again while it still waits (a client that
reconnected) is accepted again and moves to the new stream; a duplicate of a settled group is
refused with what became of it in the receipt's detail.

No stalls: every reconcile_interval_s, and at once when a group arrives stale, the learner asks
each policy server its version and re-pushes the current weights to any server behind the last
push (a restarted server serves version 0; a push may have failed). push_every > max_staleness + 1
is refused by the config.

A stream the client half-closes ends once no further step can come from what is buffered (no
step running and fewer than batch_groups groups waiting, or max_steps reached); until then it
still carries step results. Checkpoints (SaveCheckpoint, every checkpoint_every steps, and at
shutdown) hold the trainer state plus `learner_state.json`: the group ids trained so far, those
a step dropped as stale, where metrics.jsonl ended, and the buffer counters.

Crash consistency: a step writes its metrics line, then its checkpoint (learner_state.json last:
the checkpoint counts only once it exists), and only then tells the clients which groups it
consumed. A learner killed before that file exists told no client of the step: it resumes at
the previous checkpoint, cuts metrics.jsonl back to where that checkpoint recorded, and trains
the groups the clients send again. Killed after it, the resent groups are refused as
duplicates with their fate. Steps between checkpoints (checkpoint_every > 1, or 0) are told to
the clients at once and are lost with a crash; only checkpoint_every 1 trains and counts every
group exactly once through one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from learner.buffer import RolloutBuffer
from learner.learner_state import (
    LEARNER_STATE_FILE,
    LearnerState,
    latest_learner_checkpoint,
    read_learner_state,
    write_learner_state,
)
from learner.metrics import MetricsLogger
from learner.policy_hold import HeldStep, policy_hold
from learner.policy_sync import PolicySync
from learner.ranks import Ranks, RanksFailed
from learner.server_config import LearnerServerConfig
from learner.trainer import GRPOTrainer, StepInterrupted, StepMetrics
from learner.types import RolloutGroup
from learner.weight_push import WeightPusher
from learner.wire import InvalidGroup, group_from_pb, sample_from_pb
from sciproto import pb
from sciproto.errors import Internal, InvalidArgument, Reason, SciprotoError, to_status
from sciproto.pb import learner_pb2
from sciproto.server import server_info

log = logging.getLogger(__name__)

LOOP_STOP_TIMEOUT_S = 30.0  # how long aclose waits for a cancelled background task to end

class InjectedFault(RuntimeError):
    """A failure the config asked for (learner.faults), to exercise recovery."""


class _Stream:
    """One open TrainStep call: its outgoing events."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[learner_pb2.TrainStepResponse] = asyncio.Queue()


class LearnerServicer:
    """The LearnerService servicer; `start()` resumes and starts the optimizer loop."""

    def __init__(
        self,
        config: LearnerServerConfig,
        trainer: GRPOTrainer,
        pusher: WeightPusher | None,
        metrics: MetricsLogger,
        model_name: str,
        ranks: Ranks | None = None,
    ) -> None:
        self.config = config
        self.trainer = trainer
        # Every collective trainer call goes through it, so that every rank makes it (learner/ranks.py)
        self.ranks = ranks or Ranks(trainer)
        self.pusher = pusher
        self.metrics = metrics
        self.model_name = model_name
        self.buffer = RolloutBuffer(config.buffer_capacity, config.grpo.max_staleness)
        self.vocab_size = trainer.model.get_input_embeddings().num_embeddings
        self.seen_group_ids: set[str] = set()
        self.trained_group_ids: set[str] = set()
        self.dropped_stale_group_ids: set[str] = set()
        self.groups_duplicate = 0
        # Every open TrainStep call, and which one each accepted, not yet settled group came by.
        self._streams: set[_Stream] = set()
        self._owner: dict[str, _Stream] = {}
        # What became of each settled group: "consumed", "stale", "no_signal", "abandoned".
        self._fate: dict[str, str] = {}
        self._failed_attempts: dict[str, int] = {}  # group id -> failed steps in a row
        self._step_attempts = 0
        self._step_settled = False
        self._since_step = {"refused_stale": 0, "skipped_equal": 0, "refused_invalid": 0}
        self._step_lock = asyncio.Lock()  # one of: a train step + push, or a checkpoint save
        # The push and reconcile of the policy servers' weights (none without a pusher)
        self.sync = None if pusher is None else PolicySync(config, trainer, self.ranks, pusher, self._step_lock)
        # Colocated placement: generation held on the policy servers while a step and its push run
        self.hold = policy_hold(config.policy_targets, config.policy_access, config.push_timeout_s,
                                0.0, config.hold_policy)  # 0: each server's max_hold_s
        self._closing = False  # set by aclose: the optimizer loop takes no further batch
        self._step_running = False
        self._progress = asyncio.Condition()  # notified after every step and stream change
        self._loop_task: asyncio.Task[None] | None = None
        self._started = time.monotonic()
        self._last_step_end = time.monotonic()
        self._tokens_since_step = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Resume from the run directory's latest checkpoint, align the policy servers' weights
        with ours, and start the optimizer loop."""
        resumed = await self._resume()
        if resumed is not None and resumed.metrics_bytes is not None:
            dropped = self.metrics.truncate(resumed.metrics_bytes)
        else:  # no checkpoint, or one that did not record where the metrics ended
            dropped = self.metrics.rewind(self.trainer.step)
        if dropped:
            log.info("dropped %d metrics lines written after the checkpoint of step %d, whose "
                     "steps are trained again", dropped, self.trainer.step)
        if self.sync is not None:
            await self.sync.start(resumed is not None)
        self._loop_task = asyncio.create_task(self._optimizer_loop(), name="optimizer loop")

    async def _resume(self) -> LearnerState | None:
        """Load the latest complete checkpoint; its learner state, or None without one."""
        path = latest_learner_checkpoint(self.config.run_dir)
        if path is None:
            return None
        await self.ranks.run("load_checkpoint", path)
        state = read_learner_state(path)
        self.trained_group_ids = set(state.trained_group_ids)
        self.seen_group_ids = set(state.trained_group_ids)
        self.dropped_stale_group_ids = set(state.dropped_stale_group_ids)
        self.seen_group_ids |= self.dropped_stale_group_ids
        self._fate = {
            **dict.fromkeys(state.dropped_stale_group_ids, "stale"),
            **dict.fromkeys(state.trained_group_ids, "consumed"),
        }
        counters = self.buffer.counters
        counters.groups_received = state.groups_received
        counters.dropped_stale = state.groups_dropped_stale
        counters.dropped_all_equal = state.groups_skipped_equal
        self.groups_duplicate = state.groups_duplicate
        log.info(
            "resumed from %s: step %d, policy version %d, %d groups trained before",
            path,
            self.trainer.step,
            self.trainer.policy_version,
            len(self.trained_group_ids),
        )
        return state

    async def aclose(self, timeout_s: float = 600.0) -> None:
        """Finish the step in progress (past `stop_step_wait_s`, interrupt it: nothing of it is
        kept), stop the loop, save a final checkpoint.

        The loop takes no batch once closing starts: it could not be relied on to stop by
        cancellation alone, since a cancel that lands as `buffer.take` returns a batch is lost
        (asyncio.wait_for in Python 3.11), and the loop then waited for the step lock this method
        holds while this method waited for the loop: the learner hung until SIGKILL, without its
        final checkpoint."""
        self._closing = True
        try:
            # (With several ranks the interrupt below cannot end a step mid-way: it runs to its end.)
            await asyncio.wait_for(self._step_lock.acquire(), self.config.stop_step_wait_s)
        except TimeoutError:
            # A step longer than the stop allows: end it at its next micro-batch, all or nothing,
            # so the final checkpoint (of the step before) is still written.
            log.warning(
                "the step in flight ran %.0f s into the stop (learner.stop_step_wait_s): "
                "interrupting it; its groups stay untrained",
                self.config.stop_step_wait_s,
            )
            self.trainer.interrupt.set()
            try:
                await asyncio.wait_for(self._step_lock.acquire(), timeout_s)
            except TimeoutError:
                log.error(
                    "the step in progress did not end within %.0f s; no final checkpoint", timeout_s
                )
                return
        try:
            for task in (self._loop_task, self.sync and self.sync.reconcile_task):
                if task is not None:
                    task.cancel()
                    _, running = await asyncio.wait({task}, timeout=LOOP_STOP_TIMEOUT_S)
                    if running:
                        log.error("%s did not stop within %.0f s of being cancelled",
                                  task.get_name(), LOOP_STOP_TIMEOUT_S)
            if self.trainer.step > 0:
                try:
                    path = await self._save_checkpoint_locked(self.config.run_dir)
                except RanksFailed as error:  # a rank is gone: a rerun resumes from the last checkpoint
                    log.error("no final checkpoint: %s", error)
                else:
                    log.info("final checkpoint %s", path)
        finally:
            self._step_lock.release()
            self.metrics.close()
            if self.pusher is not None:
                await self.pusher.aclose()
            if self.hold is not None:
                await self.hold.aclose()
            await asyncio.to_thread(self.ranks.close)  # the other ranks stop after the final checkpoint

    # ------------------------------------------------------------------ optimizer loop

    async def _optimizer_loop(self) -> None:
        config = self.config
        while not self._reached_max_steps():
            waited_from = time.monotonic()
            try:
                groups = await self.buffer.take(
                    config.batch_groups, self.trainer.policy_version, timeout=config.take_timeout_s
                )
            except TimeoutError:
                log.info(
                    "no batch of %d groups within %.0f s (%d buffered); waiting on",
                    config.batch_groups,
                    config.take_timeout_s,
                    len(self.buffer),
                )
                continue
            wait_s = time.monotonic() - waited_from
            if self._closing:  # the learner is stopping: no new step
                self.buffer.put_back(groups)
                return
            try:
                async with self._step_lock:
                    self._step_running = True
                    await self._step(groups, wait_s)
            except StepInterrupted as error:  # the learner is stopping: nothing was trained
                log.warning("%s by the stop; its %d groups go back to the buffer", error, len(groups))
                self.buffer.put_back(groups)
                return
            except Exception as error:  # the loop goes on
                log.exception("optimizer step failed")
                if self._step_settled:  # trained and reported: only what followed failed
                    self._broadcast(
                        learner_pb2.TrainStepResponse(error=to_status(_as_sciproto(error)))
                    )
                else:  # nothing trained: the groups go back
                    self._step_failed(groups, _as_sciproto(error))
            finally:
                self._step_running = False
                async with self._progress:
                    self._progress.notify_all()
        log.info("reached max_steps %d: no further optimizer steps", config.max_steps)

    @contextlib.asynccontextmanager
    async def _holding_policy(self, step: int) -> AsyncIterator[HeldStep]:
        """With `hold_policy`, every policy server's generation is held for the block."""
        if self.hold is None:
            yield HeldStep()
        else:
            async with self.hold.step(step) as held:
                yield held

    async def _step(self, groups: list[RolloutGroup], wait_s: float) -> None:
        config = self.config
        counters = self.buffer.counters
        lag_mean, lag_max = counters.last_policy_lag_mean, counters.last_policy_lag_max
        self._step_settled = False
        self._step_attempts += 1
        if self._step_attempts in config.faults.fail_step_attempts:
            raise InjectedFault(
                f"injected failure of optimizer step attempt {self._step_attempts} "
                "(learner.faults.fail_step_attempts)"
            )
        faults = config.faults
        slow = faults.micro_batch_delay_s if self.trainer.step + 1 == faults.hold_step else 0.0
        if slow:
            log.warning("slowing step %d: %.0f s before each micro-batch (learner.faults."
                        "micro_batch_delay_s)", self.trainer.step + 1, slow)
        self.trainer.micro_batch_delay_s = slow
        async with self._holding_policy(self.trainer.step + 1) as held:
            train_started = time.monotonic()
            metrics: StepMetrics = await self.ranks.run("train_step", groups)
            train_s = time.monotonic() - train_started
            await self._fault_hold("after_train")
            consumed = [g.group_id for g in groups]
            dropped = self.buffer.drain_dropped()
            self._step_settled = True
            self.trained_group_ids.update(consumed)
            for group_id in consumed:
                self._fate[group_id] = "consumed"
                self._failed_attempts.pop(group_id, None)
            for group_id in dropped:
                self._fate[group_id] = "stale"
            self.dropped_stale_group_ids.update(dropped)
            pushed, sync_s = False, 0.0
            if (
                metrics.trained
                and self.sync is not None
                and self.trainer.step % config.push_every == 0
            ):
                try:
                    sync_s = await self.sync.push_step()
                    pushed = True
                except SciprotoError as error:
                    log.warning(
                        "weight push of version %d failed (retried within %.0f s): %s",
                        self.trainer.policy_version,
                        config.reconcile_interval_s,
                        error,
                    )
                    self._broadcast(learner_pb2.TrainStepResponse(error=to_status(error)))
        now = time.monotonic()
        interval = max(now - self._last_step_end, 1e-9)
        record: dict[str, Any] = {
            **metrics.model_dump(exclude={"trained"}),
            "policy_lag_mean": lag_mean,
            "policy_lag_max": lag_max,
            # Groups settled since the last step, by fate; together with the receipts they account
            # for every group once: consumed by this step, dropped stale when it took its batch,
            # refused stale / all-equal / invalid on arrival.
            "groups_consumed": len(consumed),
            "groups_dropped_stale": len(dropped),
            "groups_refused_stale": self._since_step["refused_stale"],
            "groups_skipped_equal": self._since_step["skipped_equal"],
            "groups_refused_invalid": self._since_step["refused_invalid"],
            "tokens_per_s_generation": self._tokens_since_step / interval,
            "tokens_per_s_training": metrics.tokens / max(train_s, 1e-9),
            "wait_rollouts_s": wait_s,
            "train_s": train_s,
            "weight_sync_s": sync_s,
            "time_s": now - self._started,
            **(held.record() if self.hold is not None else {}),
        }
        self._last_step_end, self._tokens_since_step = now, 0
        self._since_step = dict.fromkeys(self._since_step, 0)
        # Crash-consistent order: metrics line, then checkpoint (which records where metrics.jsonl
        # ends and every group this step settled), then the step result. A learner killed before
        # the checkpoint's learner_state.json exists resumes at the previous step, cuts the line
        # off and trains the step again on the groups the clients send again (no client was told
        # of it); killed after, it resumes here and refuses the resent groups as duplicates.
        if metrics.trained:
            self.metrics.log(record)
            await self._fault_hold("after_metrics")
        log.info(
            "step %d version %d reward %.3f lag %.2f train %.2fs sync %.2fs",
            self.trainer.step,
            self.trainer.policy_version,
            metrics.reward_mean,
            lag_mean,
            train_s,
            sync_s,
        )
        try:
            if (
                metrics.trained
                and config.checkpoint_every
                and self.trainer.step % config.checkpoint_every == 0
            ):
                await self._save_checkpoint_locked(config.run_dir)
                await self._fault_hold("after_checkpoint")
        finally:  # trained: the clients hear of it even when the checkpoint failed
            self._send_step_result(record, groups, consumed, dropped, pushed)

    def _send_step_result(
        self,
        record: dict[str, Any],
        groups: list[RolloutGroup],
        consumed: list[str],
        dropped: list[str],
        pushed: bool,
    ) -> None:
        """To every open stream: the step, naming the stream's own consumed and dropped groups."""
        numbers = {
            k: float(v)
            for k, v in record.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        for stream, mine in self._by_owner(consumed + dropped).items():
            stream.events.put_nowait(
                learner_pb2.TrainStepResponse(
                    step=learner_pb2.OptimizerStepResult(
                        step=self.trainer.step,
                        policy_version=self.trainer.policy_version,
                        metrics=numbers,
                        groups=len(groups),
                        weights_pushed=pushed,
                        consumed_group_ids=[g for g in consumed if g in mine],
                        dropped_stale_group_ids=[g for g in dropped if g in mine],
                    )
                )
            )
        for group_id in consumed + dropped:
            self._owner.pop(group_id, None)

    async def _fault_hold(self, point: str) -> None:
        """learner.faults.hold_at: stop here (for a test to SIGKILL the process at this point), or
        wait learner.faults.hold_s seconds here (a step in flight for that long)."""
        faults = self.config.faults
        if faults.hold_at == point and self.trainer.step == faults.hold_step:
            log.warning("holding at %s of step %d (learner.faults.hold_at)", point, self.trainer.step)
            if faults.hold_s is None:
                await asyncio.Event().wait()
            await asyncio.sleep(faults.hold_s)
            log.warning("held %.0f s at %s of step %d: going on", faults.hold_s, point, self.trainer.step)

    def _by_owner(self, group_ids: list[str]) -> dict[_Stream, set[str]]:
        """Every open stream with the ids among `group_ids` it owns (maybe none)."""
        mine: dict[_Stream, set[str]] = {stream: set() for stream in self._streams}
        for group_id in group_ids:
            owner = self._owner.get(group_id)
            if owner in mine:
                mine[owner].add(group_id)
        return mine

    def _step_failed(self, groups: list[RolloutGroup], error: SciprotoError) -> None:
        """Put a failed step's groups back (those that failed fewer than max_step_attempts
        steps in a row) and tell each stream which of its groups went back or were given up."""
        returned, abandoned = [], []
        for group in groups:
            attempts = self._failed_attempts.get(group.group_id, 0) + 1
            self._failed_attempts[group.group_id] = attempts
            (abandoned if attempts >= self.config.max_step_attempts else returned).append(group)
        self.buffer.put_back(returned)
        abandoned_ids = [g.group_id for g in abandoned]
        for group_id in abandoned_ids:
            self._fate[group_id] = "abandoned"
            self._failed_attempts.pop(group_id, None)
        returned_ids = {g.group_id for g in returned}
        for stream, mine in self._by_owner([g.group_id for g in groups]).items():
            stream.events.put_nowait(
                learner_pb2.TrainStepResponse(
                    step_failure=learner_pb2.StepFailure(
                        error=to_status(error),
                        returned_group_ids=sorted(mine & returned_ids),
                        abandoned_group_ids=sorted(mine & set(abandoned_ids)),
                    )
                )
            )
        for group_id in abandoned_ids:
            self._owner.pop(group_id, None)

    # ------------------------------------------------------------------ policy versions

    async def retarget_policy(self, index: int, target: str) -> bool:
        """Policy server `index` now listens at `target`: push there from now on (PolicySync.retarget).
        False when this transport cannot move a target, or there is no pusher."""
        return self.sync is not None and await self.sync.retarget(index, target)

    # ------------------------------------------------------------------ checkpoints

    async def _save_checkpoint_locked(self, root: Path) -> Path:
        """Write trainer and learner state; the caller holds the step lock."""
        path = await self.ranks.run("save_checkpoint", root)
        await self._fault_hold("in_checkpoint")
        counters = self.buffer.counters
        state = LearnerState(
            trained_group_ids=sorted(self.trained_group_ids),
            dropped_stale_group_ids=sorted(self.dropped_stale_group_ids),
            metrics_bytes=self.metrics.position(),
            groups_received=counters.groups_received,
            groups_dropped_stale=counters.dropped_stale,
            groups_skipped_equal=counters.dropped_all_equal,
            groups_duplicate=self.groups_duplicate,
        )
        write_learner_state(path, state)  # the checkpoint counts only once this exists
        return path

    # ------------------------------------------------------------------ RPCs

    async def Describe(
        self, request: learner_pb2.LearnerServiceDescribeRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.LearnerServiceDescribeResponse:
        return learner_pb2.LearnerServiceDescribeResponse(
            server=server_info(
                self.config.server,
                "sciproto-learner",
                [
                    "train_step.dedupe",
                    "train_step.accounting",
                    f"weights.{self.config.push_transport}",
                    "weights.reconcile",
                    "checkpoint.resume",
                    *self._lora_capability(),
                ],
                service=pb.LEARNER_SERVICE,
                auth=self.config.auth,
            ),
            model=self.model_name,
            step=self.trainer.step,
            policy_version=self.trainer.policy_version,
            max_staleness=self.config.grpo.max_staleness,
            buffer=self.buffer_state(),
            precision=self.config.grpo.precision,
        )

    def _lora_capability(self) -> list[str]:
        """With a LoRA adapter: "weights.lora:<name>:r<rank>", what it trains and pushes."""
        spec = self.config.lora
        return [] if spec is None else [f"weights.lora:{spec.name}:r{spec.rank}"]

    def buffer_state(self) -> learner_pb2.RolloutBufferState:
        counters = self.buffer.counters
        return learner_pb2.RolloutBufferState(
            groups_buffered=len(self.buffer),
            capacity=self.buffer.capacity,
            groups_received=counters.groups_received,
            groups_dropped_stale=counters.dropped_stale,
            groups_skipped_equal=counters.dropped_all_equal,
            groups_duplicate=self.groups_duplicate,
        )

    async def SaveCheckpoint(
        self, request: learner_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.SaveCheckpointResponse:
        root = self._checkpoint_root(request.directory)
        async with self._step_lock:
            path = await self._save_checkpoint_locked(root)
            step, version = self.trainer.step, self.trainer.policy_version
        return learner_pb2.SaveCheckpointResponse(
            directory=str(path), step=step, policy_version=version
        )

    def _checkpoint_root(self, directory: str) -> Path:
        """The run directory, or a folder inside it: a caller never picks where on the
        learner's disk a checkpoint lands."""
        run_dir = self.config.run_dir.resolve()
        root = (run_dir / directory).resolve()
        if not root.is_relative_to(run_dir):
            raise InvalidArgument(
                f"directory {directory!r} leaves the run directory; give a folder relative to "
                f"{run_dir} (or leave it empty)", Reason.INVALID_REQUEST)
        return root

    async def TrainStep(
        self,
        request_iterator: AsyncIterator[learner_pb2.TrainStepRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[learner_pb2.TrainStepResponse]:
        stream = _Stream()
        events = stream.events
        self._streams.add(stream)
        reader = asyncio.create_task(
            self._read_groups(request_iterator, stream), name="TrainStep reader"
        )
        finished = asyncio.create_task(self._stream_finished(reader), name="TrainStep end")
        try:
            while True:
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, finished}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                    continue
                getter.cancel()
                while not events.empty():
                    yield events.get_nowait()
                if reader.exception() is not None:
                    raise reader.exception()  # type: ignore[misc]
                return
        finally:
            self._streams.discard(stream)
            for task in (reader, finished):
                task.cancel()
            await asyncio.gather(reader, finished, return_exceptions=True)

    async def _stream_finished(self, reader: asyncio.Task[None]) -> None:
        """Returns once the client stopped sending and no further step can follow from the
        buffered groups."""
        await asyncio.wait({reader})
        async with self._progress:
            await self._progress.wait_for(
                lambda: not self._step_running
                and (len(self.buffer) < self.config.batch_groups or self._reached_max_steps())
            )

    def _reached_max_steps(self) -> bool:
        return self.config.max_steps is not None and self.trainer.step >= self.config.max_steps

    async def _read_groups(
        self,
        requests: AsyncIterator[learner_pb2.TrainStepRequest],
        stream: _Stream,
    ) -> None:
        async for request in requests:
            receipt = await self._receive(request.group, stream)
            stream.events.put_nowait(learner_pb2.TrainStepResponse(receipt=receipt))

    async def _receive(
        self, message: learner_pb2.RolloutGroup, stream: _Stream
    ) -> learner_pb2.GroupReceipt:
        group_id = message.group_id

        def refused(reason: str, detail: str = "") -> learner_pb2.GroupReceipt:
            return learner_pb2.GroupReceipt(
                group_id=group_id, accepted=False, reason=reason, detail=detail
            )

        if group_id in self.seen_group_ids:
            fate = self._fate.get(group_id)
            if fate is None:  # still buffered or in a step: the resending stream owns it now
                self._owner[group_id] = stream
                return learner_pb2.GroupReceipt(group_id=group_id, accepted=True)
            self.groups_duplicate += 1
            return refused("duplicate", fate)
        try:
            group = group_from_pb(message, self.vocab_size)
        except InvalidGroup as error:
            log.info("group %r refused: %s", group_id, error)
            self._since_step["refused_invalid"] += 1
            return refused("invalid", str(error))
        self.seen_group_ids.add(group_id)
        oldest = group.oldest_version
        if (
            oldest is not None
            and self.trainer.policy_version - oldest > self.config.grpo.max_staleness
        ):
            self.buffer.counters.groups_received += 1
            self.buffer.counters.dropped_stale += 1
            self._since_step["refused_stale"] += 1
            self._fate[group_id] = "stale"
            if self.sync is not None:
                self.sync.reconcile_now.set()  # its policy server may be behind
            return refused("stale")
        self._owner[group_id] = stream
        try:
            accepted = await self.buffer.add(group, timeout=self.config.add_timeout_s)
        except TimeoutError:
            self.seen_group_ids.discard(group_id)  # never trained: a retry may send it again
            self._owner.pop(group_id, None)
            return refused("busy")
        if not accepted:
            self._owner.pop(group_id, None)
            self._since_step["skipped_equal"] += 1
            self._fate[group_id] = "no_signal"
            return refused("no_signal")
        self._tokens_since_step += sum(s.num_trained_tokens for s in group.samples)
        async with self._progress:
            self._progress.notify_all()
        return learner_pb2.GroupReceipt(group_id=group_id, accepted=True)

    def _broadcast(self, event: learner_pb2.TrainStepResponse) -> None:
        for stream in self._streams:
            stream.events.put_nowait(event)


def _as_sciproto(error: Exception) -> SciprotoError:
    if isinstance(error, SciprotoError):
        return error
    return Internal(f"optimizer step failed: {type(error).__name__}: {error}", Reason.INTERNAL)


__all__ = [  # the wire conversion and the checkpoint state are named here for those that import them from here
    "LEARNER_STATE_FILE",
    "InjectedFault",
    "InvalidGroup",
    "LearnerServicer",
    "LearnerState",
    "group_from_pb",
    "latest_learner_checkpoint",
    "sample_from_pb",
]
