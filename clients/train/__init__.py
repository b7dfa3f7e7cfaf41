"""`sciproto train`: one command that trains end to end.

    sciproto train --config demo [--set learner.grpo.lr=1e-3 ...]

1. Starts an env server, a policy server and the learner on an engine (`engine`: child processes
   by default, logs in the run directory), all from the sections of one config file (`env`,
   `policy`, `learner`).
2. Runs the rollout client here: `collect(...)` over the task split, cycled, streams every finished
   group into the learner's TrainStep stream. Generation goes on while the learner trains (async
   GRPO), but at most `rollout.max_groups_ahead` groups are started and not yet consumed by the
   learner (trained, dropped or refused): with max_staleness 0 and one batch ahead, this is
   synchronous on-policy GRPO.
3. Stops at the budget (optimizer steps and/or seconds) or on Ctrl-C: stops every child (SIGTERM,
   then SIGKILL after processes.stop_timeout_s), the learner first, which finishes the step in
   flight (or interrupts it past half that time) and writes its final checkpoint; then prints a summary that agrees with that checkpoint
   and metrics.jsonl (a step that finished after the stop is counted).

A run directory `runs/<name>` holds: config.yaml (as resolved), env.log / policy.log /
learner.log, checkpoints/, metrics.jsonl, reward.png, rollouts.jsonl (the rollout line format of
`sciproto.client.rollouts`; `sciproto view` opens it), rollouts.failures.jsonl and summary.json.
Each pass over the split is an epoch; a group's id is `<env>/<split>/<index>#<epoch>` (its
rollouts' ids add `/<sample>`), so the learner's duplicate check refuses only true retries. With
`rollout.grouping: step` a task gives one group per step group (clients.step_rollouts), each id
adding `/step<k>`.

The package, one job per module: `config` (the config file), `loop` (the training loop, top to
bottom), `stream` (the TrainStep stream across learner restarts), `flow` (admission and the group
ledger), `records` (messages, step records, the outcome), `engine` and `processes` (where the
servers run), `resume` and `learner_record` (the run directory), `display` (the live line),
`summary` (what the run reports), `app` (the command).
"""

from clients.train.app import STOP_SIGNALS, main, train
from clients.train.config import TrainConfig, load_train_config
from clients.train.loop import run_rollouts_into_learner
from clients.train.records import StepRecord, TrainOutcome, group_to_pb, with_epoch
from clients.train.summary import print_summary

__all__ = [
    "STOP_SIGNALS",
    "StepRecord",
    "TrainConfig",
    "TrainOutcome",
    "group_to_pb",
    "load_train_config",
    "main",
    "print_summary",
    "run_rollouts_into_learner",
    "train",
    "with_epoch",
]
