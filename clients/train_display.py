"""What `sciproto train` shows while it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:
    from clients.train import StepRecord


class Progress:
    """A live line: step, reward, policy lag, generation throughput."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.bar = tqdm(
            total=total, unit="step", disable=not enabled, dynamic_ncols=True, desc="train"
        )

    def update(self, record: StepRecord, tokens_per_s: float) -> None:
        self.bar.update(record.step - self.bar.n)
        self.bar.set_postfix(
            reward=f"{record.reward_mean:.3f}",
            lag=f"{record.policy_lag_mean:.2f}",
            version=record.policy_version,
            tok_s=f"{tokens_per_s:.0f}",
        )

    def close(self) -> None:
        self.bar.close()



__all__ = ["Progress"]
