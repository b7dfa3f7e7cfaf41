"""`sciproto verify ROLLOUTS.jsonl --env HOST:PORT`: grade stored rollouts again and report every
rollout whose new grade differs from the stored one.

Each record's conversation goes to `Verify` as a stored trajectory (its env, its task `{split,
index}` and its messages; no episode is opened or replayed), so a grader that changed, or a file
from another team, can be checked against the environment server as it is now. A record agrees
when the new reward has the stored status and its value lies within `tolerance` of the stored
one. INFRA_ERROR records were never graded and are skipped; a record the server cannot grade
(an environment that scores only live episodes, a task it does not have) is counted as not
re-scored, with the server's reason. The command exits 1 when any record disagrees or could not
be re-scored, 0 when every graded record agrees.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from sciproto.channel import ChannelConfig
from sciproto.client.env import EnvClient
from sciproto.client.rollouts import RolloutRecord, RolloutStatus, read_rollouts, status_from_pb
from sciproto.errors import SciprotoError
from sciproto.pb import env_pb2

# Answers that say nothing of a record: the whole run stops on them.
SERVER_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@dataclass(frozen=True)
class Disagreement:
    """A rollout whose new grade is not its stored one."""

    rollout_id: str
    old_status: str
    old_reward: float
    new_status: str
    new_reward: float
    detail: str = ""


@dataclass
class VerifyReport:
    """What re-scoring a rollout file found."""

    path: str
    target: str
    rollouts: int = 0
    agreed: int = 0
    skipped_infra_error: int = 0
    disagreements: list[Disagreement] = field(default_factory=list)
    # rollout id -> why the server did not grade it
    not_rescored: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.disagreements and not self.not_rescored

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "disagreed": len(self.disagreements), "ok": self.ok}, indent=2)

    def render(self) -> str:
        head = (f"{self.path}: {self.rollouts} rollouts against {self.target}: {self.agreed} agree, "
                f"{len(self.disagreements)} disagree, {len(self.not_rescored)} not re-scored, "
                f"{self.skipped_infra_error} skipped (INFRA_ERROR)")
        lines = [head]
        lines += [f"  disagree  {d.rollout_id}: stored {d.old_status} {d.old_reward:g}, now {d.new_status} "
                  f"{d.new_reward:g}" + (f" ({d.detail})" if d.detail else "") for d in self.disagreements]
        lines += [f"  not re-scored  {rollout_id}: {why}" for rollout_id, why in self.not_rescored.items()]
        return "\n".join(lines)


def stored_trajectory(record: RolloutRecord) -> env_pb2.StoredTrajectory:
    """The record's conversation as a StoredTrajectory of its dataset task."""
    return env_pb2.StoredTrajectory(env=record.env, task_ref=env_pb2.TaskRef(split=record.split, index=record.index),
                                    messages=[message.to_pb() for message in record.messages])


async def verify_rollouts(path: Path, config: ChannelConfig, *, tolerance: float = 1e-6,
                          concurrency: int = 16, timeout_s: float = 60.0) -> VerifyReport:
    """Re-score every record of `path` through `config.target`'s Verify (at most `concurrency`
    calls at once, each within `timeout_s`)."""
    records = list(read_rollouts(path))
    if not records and not path.exists():
        raise FileNotFoundError(f"{path} does not exist; give a rollouts file written by `sciproto collect` or `train`")
    report = VerifyReport(path=str(path), target=config.target, rollouts=len(records))
    slots = asyncio.Semaphore(concurrency)

    async def one(client: EnvClient, record: RolloutRecord) -> None:
        if record.status is RolloutStatus.INFRA_ERROR:
            report.skipped_infra_error += 1
            return
        async with slots:
            try:
                response = await client.verify(trajectory=stored_trajectory(record), timeout=timeout_s)
            except SciprotoError as error:
                if error.code in SERVER_FAILURES:
                    raise  # the server, not this record: stop
                report.not_rescored[record.rollout_id] = f"{error.code.name}: {error.message}"
                return
        reward = response.reward
        new_status = status_from_pb(reward.status)
        if new_status is RolloutStatus.INFRA_ERROR:
            report.not_rescored[record.rollout_id] = f"INFRA_ERROR: {reward.detail or 'no detail'}"
        elif new_status is record.status and math.isclose(reward.value, record.reward, rel_tol=0.0,
                                                          abs_tol=tolerance):
            report.agreed += 1
        else:
            report.disagreements.append(Disagreement(record.rollout_id, record.status.value, record.reward,
                                                     new_status.value, reward.value, reward.detail))

    async with EnvClient(config, transport="unary", default_timeout_s=timeout_s) as client:
        await asyncio.gather(*(one(client, record) for record in records))
    order = {record.rollout_id: n for n, record in enumerate(records)}
    report.disagreements.sort(key=lambda d: order[d.rollout_id])
    return report


__all__ = ["Disagreement", "VerifyReport", "stored_trajectory", "verify_rollouts"]
