"""The configuration of `sciproto train`: one file configures every component (`env`, `policy`,
`learner` are the servers' own sections) and the run around them."""

from __future__ import annotations

import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from clients.agent import ResetOptions
from clients.agent_process import AgentProgram
from clients.curriculum import read_curriculum
from clients.step_rollouts import StepGroupSettings
from clients.train.cluster import ClusterSettings
from clients.train.phases import Phase, check_phases
from clients.train.placement import check_placement
from clients.train.task_stats import TaskFilter
from env_servers.catalog import check_name, import_modules
from env_servers.config import EnvServerConfig
from learner.server_config import LearnerServerConfig
from policy_server.config import PolicyServerConfig
from sciproto.client.rollouts import RolloutDetail
from sciproto.config import ConfigError, load_config
from sciproto.sampling import EpisodeSettings


class RunSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("demo", description="Run name; the run directory is <dir>/<name>")
    dir: Path = Field(Path("runs"), description="Parent of run directories")
    resume: bool = Field(
        True,
        description=(
            "Continue the latest run of this name that holds a checkpoint (<dir>/<name> or its"
            " highest <name>-N); false (`sciproto train --fresh`) starts over, in a numbered"
            " sibling (<name>-2, ...) when <dir>/<name> is taken"
        ),
    )


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_steps: int | None = Field(
        30, ge=1, description="Stop after this many optimizer steps (learner total)"
    )
    max_seconds: float | None = Field(
        None, gt=0, description="Stop after this many seconds of training"
    )
    # Once a policy scores near the maximum, most groups carry no signal (all rewards equal) and
    # each further step waits long for data: a run that reached its goal may as well stop.
    target_reward: float | None = Field(
        None, description="Stop once the mean reward of the last `target_window` steps reaches this"
    )
    target_window: int = Field(3, ge=1, description="Steps averaged for target_reward")

    @model_validator(mode="after")
    def _some_limit(self) -> Budget:
        if self.max_steps is None and self.max_seconds is None:
            raise ValueError(
                "budget needs max_steps or max_seconds (or both); an unbounded run never ends"
            )
        return self


class AgentCommand(BaseModel):
    """An external agent program that plays the tasks instead of sciproto's agent loop."""

    model_config = ConfigDict(extra="forbid")

    command: str = Field(
        ...,
        min_length=1,
        description=(
            "The program, as shell words (e.g. `python my_agent.py`), started `samples` times per task with"
            " OPENAI_BASE_URL (its gateway session) and SCIPROTO_TASK (env, split, index, the Reset"
            " observation and tools); each finished run is graded by the env's Verify"
        ),
    )
    timeout_s: float = Field(600.0, gt=0, description="Seconds one run may take; past it the run is an INFRA_ERROR")
    preload: list[str] = Field(
        default_factory=list,
        description=(
            "Python modules the program imports (e.g. [openai, openai.resources, httpcore]: a package's lazily"
            " imported parts are named too), imported once in a fork server started with the command's"
            " interpreter: each run is then a fork of it that runs the script, not a new interpreter (`import"
            " openai` alone is about 1 s of CPU). A run that imports 20 or more modules after the fork gets a"
            " warning naming them. The command must be `PYTHON SCRIPT [ARGS]` or `PYTHON -m MODULE [ARGS]`"
        ),
    )

    @model_validator(mode="after")
    def _program_exists(self) -> AgentCommand:
        # Every run of a missing program would fail at once, and the run would go on making
        # failed groups until its budget: refuse it before anything starts.
        try:
            argv = shlex.split(self.command)
        except ValueError as error:
            raise ValueError(f"rollout.agent.command {self.command!r} is not valid shell words: {error}") from None
        if not argv or shutil.which(argv[0]) is None:
            raise ValueError(f"rollout.agent.command {self.command!r}: no program {argv[0] if argv else ''!r} "
                             "on PATH (give the interpreter and the script, e.g. `python my_agent.py`)")
        AgentProgram(self.command, self.timeout_s, tuple(self.preload)).argv()  # the shape preload needs
        return self


class RolloutSettings(EpisodeSettings):
    """The in-process rollout client: how its episodes are played (sciproto.sampling.EpisodeSettings)
    and which."""

    model_config = ConfigDict(extra="forbid")

    tasks: str = Field("toy:train", description="ENV:SPLIT, cycled over")
    curriculum: Path | None = Field(
        None,
        description="A curriculum file (`sciproto eval --write-curriculum`): cycle over its tasks of the split only",
    )
    samples: int = Field(8, ge=2, description="Samples per task: one GRPO group (grouping trajectory)")
    grouping: Literal["trajectory", "step"] = Field(
        "trajectory",
        description=(
            "trajectory: a group is `samples` whole episodes of a task; step: a group is the"
            " alternatives of one step, sampled on forks of the episode (see step_groups)"
        ),
    )
    step_groups: StepGroupSettings = Field(default_factory=StepGroupSettings)
    observation: Literal["history", "state"] | None = Field(
        None,
        description=(
            "The notebook env's context policy, sent with every Reset (unset: the env's default,"
            " history); state needs grouping step"
        ),
    )
    reset_options: ResetOptions = Field(
        default_factory=dict,
        description=(
            "More per-episode env options sent with every Reset (notebook: action: code, cell_reward: 0.1);"
            " the environment checks them"
        ),
    )
    task_filter: TaskFilter = Field(
        default_factory=TaskFilter,
        description=(
            "Pass over tasks whose recent groups all gave no signal, revisiting them now and then"
            " (clients.train.task_stats; counts in summary.json's task_stats)"
        ),
    )
    concurrency: int = Field(64, ge=1, description="Episodes in flight at once")
    max_groups_ahead: int | None = Field(
        None,
        ge=1,
        description=(
            "Groups started and not yet consumed by the learner; default (max_staleness + 1) x batch_groups"
        ),
    )
    agent: AgentCommand | None = Field(
        None,
        description=(
            "Train an external agent program through the OpenAI-compatible gateway (grouping trajectory);"
            " its own requests set its sampling, so rollout.sampling, max_steps and max_tokens do not apply"
        ),
    )
    rollouts_file: RolloutDetail = Field(
        "full", description="rollouts.jsonl lines: full (token arrays too) or summary (see sciproto.client.rollouts)"
    )
    learner_reconnect_s: float = Field(
        300.0,
        gt=0,
        description=(
            "Longest the learner may stay unreachable (restarting) before the run fails; its "
            "unsettled groups are sent again once it is back"
        ),
    )

    @model_validator(mode="after")
    def _agent_plays_whole_episodes(self) -> RolloutSettings:
        if self.agent is not None and self.grouping != "trajectory":
            raise ValueError(
                "rollout.agent runs an external program over whole tasks; it needs rollout.grouping trajectory"
                " (step groups fork episodes inside sciproto's own agent loop)"
            )
        return self

    @model_validator(mode="after")
    def _state_view_trains_by_step(self) -> RolloutSettings:
        if self.options.get("observation") == "state" and self.grouping != "step":
            raise ValueError(
                "rollout.observation state needs rollout.grouping step: a state-view episode's turns"
                " do not extend one another, so they cannot train as one trajectory"
            )
        return self

    @property
    def options(self) -> dict[str, str]:
        """The env options of every Reset."""
        return {**self.reset_options, **({"observation": self.observation} if self.observation else {})}

    def split(self) -> tuple[str, str]:
        env, sep, split = self.tasks.partition(":")
        if not sep or not env or not split:
            raise ConfigError(
                f"rollout.tasks {self.tasks!r} must look like ENV:SPLIT, e.g. toy:train"
            )
        return env, split


class ProcessSettings(BaseModel):
    """How the child processes start."""

    model_config = ConfigDict(extra="forbid")

    start_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for a server to announce its port"
    )
    stop_timeout_s: float = Field(
        120.0, gt=0, description="Longest wait after SIGTERM before SIGKILL"
    )
    # CPU threads of each server's torch/OpenMP pools (0: library default; vLLM on the CPU: the
    # cores its worker is bound to, clients.train.placement). On a small CPU, one thread each lets
    # generation and training run side by side instead of fighting for cores.
    policy_threads: int = Field(0, ge=0)
    learner_threads: int = Field(0, ge=0)
    # CPU cores each server may run on (taskset; empty: any). Giving generation (policy) and
    # training (learner) cores of their own lets them overlap instead of time-sharing.
    env_cpus: list[int] = Field(default_factory=list)
    policy_cpus: list[int] = Field(default_factory=list)
    learner_cpus: list[int] = Field(default_factory=list)


class DisplaySettings(BaseModel):
    """What the run shows besides the live line."""

    model_config = ConfigDict(extra="forbid")

    stall_after_s: float = Field(
        60.0, gt=0, description="Say why when no optimizer step has run for this long"
    )
    calibration_groups: int = Field(
        2, ge=0, description=("Before the first rollout, time this many Generate calls of rollout.samples on each"
                              " policy server alone, for the summary's tokens/s alone against in the run (0: skip)")
    )
    calibration_max_tokens: int = Field(32, ge=1, description="Most tokens per sample of the calibration")


class TrainPolicySettings(PolicyServerConfig):
    """The run's policy server: the `policy:` section, which the server it starts reads; or, with
    `address`, a policy server already running that this run shares with others."""

    address: str | None = Field(
        None,
        exclude=True,  # the run's own; never in the section a started server reads
        description=(
            "HOST:PORT of a running policy server to share instead of starting one: the run then"
            " trains a LoRA adapter (learner.lora, a name no other run uses) and pushes only it;"
            " the server's model must be policy.model"
        ),
    )


class TrainConfig(BaseModel):
    """Everything `sciproto train` needs: one file configures every component."""

    model_config = ConfigDict(extra="forbid")

    run: RunSettings = Field(default_factory=RunSettings)
    budget: Budget = Field(default_factory=Budget)
    env: EnvServerConfig = Field(default_factory=lambda: EnvServerConfig(envs=["toy"]))
    policy: TrainPolicySettings = Field(default_factory=TrainPolicySettings)
    learner: LearnerServerConfig = Field(default_factory=LearnerServerConfig)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    processes: ProcessSettings = Field(default_factory=ProcessSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    progress: bool = Field(True, description="Show a live progress line")
    display: DisplaySettings = Field(default_factory=lambda: DisplaySettings())
    phases: list[Phase] = Field(
        default_factory=list,
        description="sft phases on demonstrations, then grpo (clients.train.phases); empty: grpo only")
    placement: Literal["disaggregated", "colocated"] = Field(
        "disaggregated",
        description=(
            "disaggregated: the policy server and the learner run side by side, each with processes.*_threads;"
            " colocated: generation and the learner step take turns, each with every core (the learner holds"
            " generation during its step; clients.train.placement)"
        ),
    )

    @model_validator(mode="after")
    def _learner_trains_the_served_model(self) -> TrainConfig:
        # The learner must build exactly the weights the policy server starts from.
        self.learner.model = self.policy.model
        self.learner.model_seed = self.policy.seed
        # ... and train the policy that sampled: the tempered one (greedy rollouts report T = 1).
        # Each rollout also says what sampled its turns (sciproto/sampling.py), and the learner
        # trains each token under that; this temperature is for tokens of senders that do not.
        sampled_at = self.rollout.sampling.distribution.temperature
        if self.policy.backend == "openai" and self.rollout.sampling.top_k:
            raise ValueError(f"rollout.sampling.top_k {self.rollout.sampling.top_k}: policy.backend openai sends"
                             " no top_k to its endpoint; leave top_k 0 or use the transformers or vllm backend")
        grpo = self.learner.grpo
        if "temperature" not in grpo.model_fields_set:
            grpo.temperature = sampled_at
        elif grpo.temperature != sampled_at:
            raise ValueError(
                f"learner.grpo.temperature {grpo.temperature} differs from rollout.sampling.temperature"
                f" {self.rollout.sampling.temperature}: the learner must train the policy that sampled;"
                " leave learner.grpo.temperature unset and it follows the rollouts"
            )
        env, _ = self.rollout.split()
        if self.rollout.curriculum is not None:
            curriculum = read_curriculum(self.rollout.curriculum)
            if curriculum.tasks != self.rollout.tasks:
                raise ValueError(
                    f"rollout.curriculum {self.rollout.curriculum} lists tasks of {curriculum.tasks},"
                    f" but rollout.tasks is {self.rollout.tasks}"
                )
        if env not in self.env.envs:
            raise ValueError(
                f"rollout.tasks uses environment {env!r} but env.envs is {self.env.envs}"
            )
        check_phases(self.phases)
        self._size_the_policy_server_for_the_adapter()
        self._place_the_roles()
        if self.policy.address is not None:
            if self.learner.lora is None:
                raise ValueError(
                    f"policy.address {self.policy.address}: a shared policy server takes each run's LoRA adapter;"
                    " pushing full weights would replace what the other runs sample. Set learner.lora"
                    " (e.g. --set learner.lora.name=my-run)"
                )
            if self.cluster.engine == "ray":
                raise ValueError("policy.address shares a running policy server; cluster.engine ray starts its"
                                 " own: leave one of them unset")
        return self

    def _place_the_roles(self) -> None:
        """Check `placement`; colocated has the learner hold generation during its steps."""
        processes = self.processes
        check_placement(self.placement, engine=self.cluster.engine, shared_policy=self.policy.address is not None,
                        pinned=bool(processes.env_cpus or processes.policy_cpus or processes.learner_cpus))
        if self.placement == "colocated":
            self.learner.hold_policy = True

    def _size_the_policy_server_for_the_adapter(self) -> None:
        """A LoRA run's own policy server holds its adapter: vLLM, which takes none unless told
        (its CPU kernels cost every request by the largest rank it takes), takes exactly this one."""
        lora, adapters = self.learner.lora, self.policy.adapters
        if lora is None or self.policy.address is not None:
            return
        if adapters.held(self.policy.backend) == 0:
            if adapters.max_adapters == 0:
                raise ValueError("learner.lora trains an adapter but policy.adapters.max_adapters is 0: the policy"
                                 " server could not serve it; leave max_adapters unset")
            adapters.max_adapters = 1
            if "max_rank" not in adapters.model_fields_set:
                adapters.max_rank = lora.rank
        if adapters.max_rank < lora.rank:
            raise ValueError(f"learner.lora.rank {lora.rank} is above policy.adapters.max_rank {adapters.max_rank};"
                             " raise max_rank or lower the rank")

    @property
    def runs_grpo(self) -> bool:
        """Whether rollouts train after the sft phases (no phases, or a grpo phase)."""
        return not self.phases or self.phases[-1].objective == "grpo"

    @property
    def max_groups_ahead(self) -> int:
        if self.rollout.max_groups_ahead is not None:
            return self.rollout.max_groups_ahead
        return (self.learner.grpo.max_staleness + 1) * self.learner.batch_groups


def load_train_config(config: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    return load_config(TrainConfig, config, list(overrides))


def check_envs(names: Sequence[str], imports: Sequence[str] = ()) -> None:
    """Refuse, before any server starts, an environment the env server could not host (after
    importing the modules that may register it)."""
    try:
        import_modules(imports)
    except ValueError as error:
        raise ConfigError(f"env.{error}") from None
    for name in names:
        try:
            check_name(name)
        except ValueError as error:
            raise ConfigError(f"env.envs: {error}") from None


__all__ = [
    "Budget",
    "DisplaySettings",
    "ProcessSettings",
    "RolloutSettings",
    "RunSettings",
    "TrainConfig",
    "TrainPolicySettings",
    "check_envs",
    "load_train_config",
]
