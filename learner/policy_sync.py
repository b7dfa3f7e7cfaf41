"""The learner's side of the policy servers: pushing the trained weights to them, and reconciling
their versions with the last push (on a timer, and at once when a group arrives stale or a
server moved), so that a server that restarted or missed a push is brought up to date.

One of these per learner with a weight pusher; every push and re-push holds the learner's step
lock, so none runs beside a train step or a checkpoint save.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from learner.push_types import Serving, ServingDigestMismatch
from learner.ranks import Ranks
from learner.server_config import LearnerServerConfig
from learner.trainer import GRPOTrainer
from learner.weight_push import WeightPusher, version_after_resume
from sciproto.errors import SciprotoError

log = logging.getLogger("learner.service")


class PolicySync:
    """Pushes and reconciles the policy servers' weights for one learner."""

    def __init__(self, config: LearnerServerConfig, trainer: GRPOTrainer, ranks: Ranks, pusher: WeightPusher,
                 step_lock: asyncio.Lock) -> None:
        self.config = config
        self.trainer = trainer
        self.ranks = ranks
        self.pusher = pusher
        self._step_lock = step_lock
        # Version every policy server should serve: that of the last push attempted.
        self.published_version: int | None = None
        # WeightsProvenance.set_digest of the weights of that push; empty while unknown
        self.published_digest = b""
        self.reconcile_now = asyncio.Event()
        self.reconcile_task: asyncio.Task[None] | None = None

    async def start(self, resumed: bool) -> None:
        """Align the servers with the trainer's weights (a resumed learner, or servers that serve
        another version, get them pushed under a version above any served), then reconcile on.

        A LoRA adapter is pushed at start in any case (version 0 where no server holds it yet):
        rollouts name it from the first step, and a server may hold an older adapter of its name."""
        serving = await self.pusher.serving_versions()
        lora = self.config.lora is not None
        if resumed or lora or any(v != self.trainer.policy_version for v in serving):
            self.trainer.policy_version = version_after_resume(self.trainer.policy_version, serving)
            try:
                await self.push()
            except ServingDigestMismatch:
                pass  # logged; the reconcile loop pushes again
        self.published_version = self.trainer.policy_version
        self.reconcile_task = asyncio.create_task(self._reconcile_loop(), name="reconcile")

    async def push_step(self) -> float:
        """After a step: publish the trainer's version and push it; its seconds."""
        self.published_version = self.trainer.policy_version
        return await self.push()

    async def retarget(self, index: int, target: str) -> bool:
        """Policy server `index` now listens at `target` (an engine restarted it elsewhere): push
        there from now on, and reconcile at once so it gets the current weights. False when this
        transport cannot move a target (its group is fixed at start)."""
        retarget = getattr(self.pusher, "retarget", None)
        if retarget is None:
            return False
        async with self._step_lock:
            await retarget(index, target)
            self.config.policy_targets[index] = target
        log.warning("policy server %d moved to %s: reconciling its weights", index, target)
        self.reconcile_now.set()
        return True

    async def _reconcile_loop(self) -> None:
        """Bring every policy server that is behind up to the last pushed version, on a timer
        and whenever a group arrives stale."""
        interval = self.config.reconcile_interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.reconcile_now.wait(), interval)
            self.reconcile_now.clear()
            try:
                await self._reconcile()
            except Exception:  # a failed round is retried on the next tick
                log.exception("reconciling the policy servers' versions failed")

    def _out_of_step(self, servings: list[Serving | None]) -> tuple[list[int], list[int]]:
        """The servers behind the published version, and those that serve other weights than
        the published ones: a newer version (pushed from elsewhere), or the same version with
        another digest."""
        published, digest = self.published_version, self.published_digest
        assert published is not None
        behind = [i for i, s in enumerate(servings) if s is not None and s.policy_version < published]
        other = [i for i, s in enumerate(servings) if s is not None and (
            s.policy_version > published
            or (s.policy_version == published and digest and s.weights_digest and s.weights_digest != digest))]
        return behind, other

    async def _reconcile(self) -> None:
        pusher = self.pusher
        if self.published_version is None:
            return
        if not hasattr(pusher, "serving_each"):
            return  # this transport pushes to every server at once only
        servings = await pusher.serving_each(timeout_s=min(10.0, self.config.push_timeout_s))
        if not any(self._out_of_step(servings)):
            return
        async with self._step_lock:
            # A step's own push may have finished while we waited for the lock: ask again.
            servings = await pusher.serving_each(timeout_s=min(10.0, self.config.push_timeout_s))
            behind, other = self._out_of_step(servings)
            if not behind and not other:
                return
            version = self.trainer.policy_version
            indices = behind
            for i in other:
                serving = servings[i]
                assert serving is not None
                log.error("policy server %s serves version %d with weights digest %s, not the %s pushed as "
                          "version %d: it does not serve the weights the learner trained; pushing them again",
                          self.config.policy_targets[i], serving.policy_version,
                          serving.weights_digest.hex() or "(none)", self.published_digest.hex() or "(unknown)",
                          self.published_version)
            if other:
                # versions only grow: the weights go again, as a version above any served, to every server
                version = version_after_resume(version, [s.policy_version for s in servings if s is not None])
                self.trainer.policy_version = version
                indices = [i for i, s in enumerate(servings) if s is not None]
            targets = [self.config.policy_targets[i] for i in indices]
            log.warning(
                "policy servers %s serve versions %s, not version %d: pushing version %d",
                targets,
                [servings[i].policy_version for i in indices],  # type: ignore[union-attr]
                self.published_version,
                version,
            )
            weights = await self.ranks.run("state_dict_for_push")
            self.published_version = version
            try:
                result = await pusher.push_to(indices, weights, version)
            except SciprotoError as error:
                self._note_push_failure(error)
                log.warning("re-push of version %d to %s failed (retried): %s", version, targets, error)
                return
            self.published_digest = result.set_digest
            log.info("re-pushed version %d to %s in %.2f s", version, targets, result.seconds)

    async def push(self) -> float:
        """Push the trainer's weights as its current policy version to every server; its seconds."""
        weights = await self.ranks.run("state_dict_for_push")
        try:
            result = await self.pusher.push(weights, self.trainer.policy_version)
        except SciprotoError as error:
            self._note_push_failure(error)
            raise
        self.published_digest = result.set_digest
        return result.seconds

    def _note_push_failure(self, error: SciprotoError) -> None:
        """What every server should serve after a failed push: the weights pushed, whose digest a
        ServingDigestMismatch carries (a server that reports another is pushed again); unknown
        after any other failure."""
        pushed = error.metadata.get("pushed_digest", "") if isinstance(error, ServingDigestMismatch) else ""
        self.published_digest = bytes.fromhex(pushed)
        if pushed:
            log.error("%s", error)
