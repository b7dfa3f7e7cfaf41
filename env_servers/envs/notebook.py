"""Data-analysis questions on CSV files, answered in a Jupyter notebook (in the spirit of BixBench).

Built on Aviary's NBEnvironment with a local kernel (no Docker). Each episode takes a kernel of its
own, in a bwrap sandbox with limits (env_servers.sandbox; `sandbox: none` opts out) on an empty
workspace, from a pool of kernels started ahead (env_servers.envs.kernel_pool; one is started on
demand when the pool is empty or off), copies its dataset folder into that workspace, and destroys
kernel, sandbox and workspace on close: no kernel serves two episodes.
A submit_answer tool ends the episode: reward 1 for a correct answer, 0 otherwise.

Per-episode options (ResetRequest.options, `NotebookEpisodeOptions`):
- `observation: history | state`: what a step observes (see DataAnalysisEnv.state_view);
- `action: tools | code`: with `code` no tool is offered, for models that write code but not tool
  calls: a reply's first ```python block runs as the next cell, and a reply without one is the
  answer (the text after its last "Answer:", else all of it);
- `cell_reward`: a shaping term, added to the reward of each step whose cell ran to the end
  without an error (0 by default). It gives step-level groups a signal before the model can
  answer; it is counted in the reward component `clean_cells`.
Verify of a live episode grades all of this; rescoring a stored trajectory reads its last
submit_answer call only (tool actions, no cell reward).
"""

import importlib.util
import json
import math
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Literal

import nbformat
from aviary.core import Environment, Message, Messages, Tool, ToolRequestMessage
from aviary.envs.notebook import NBEnvironment, NBEnvironmentState
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from env_servers.envs.kernel import CellLimits, SandboxedKernel
from env_servers.envs.kernel_pool import KernelPool, PooledKernel, PoolSettings, PoolStats
from env_servers.envs.source import (
    FORK_REPLAY,
    EnvironmentSource,
    ForkUnsupportedError,
    RewardComponents,
    last_tool_argument,
    no_submission,
    require_fields,
    submission,
)
from env_servers.sandbox import Sandbox, SandboxLimits, SandboxMode, check_mode, describe_mode

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "notebook"


class NotebookTask(BaseModel):
    """One line of tasks.jsonl: a question about the CSV files of one dataset folder."""

    model_config = ConfigDict(extra="ignore")

    id: str
    split: str
    dataset: str = Field(description="Folder under the data directory copied into the episode.")
    files: list[str]
    question: str
    answer: str
    tolerance: float | None = Field(
        default=None, description="Absolute tolerance for numeric answers; None: exact match."
    )

    def prompt(self, action: "ActionMode" = "tools") -> str:
        where = f"Answer this question about the data in {', '.join(self.files)} (in the working directory of the notebook)."
        if action == "code":
            how = (" To run Python code (pandas is available), reply with one ```python block: it runs as the next"
                   " cell of the notebook and you see its output. When you know the answer, reply with"
                   " \"Answer:\" and the answer alone, no units, explanation or code.")
        else:
            how = (" Use edit_cell to run Python code (pandas is available), and when you know the answer call"
                   " submit_answer with the answer alone, no units or explanation.")
        return f"{where}{how}\n\nQuestion: {self.question}"

    def is_correct(self, submitted: str) -> bool:
        """Numbers: |submitted - answer| <= tolerance; everything else: equal ignoring case."""
        expected_number, submitted_number = parse_number(self.answer), parse_number(submitted)
        if expected_number is not None and submitted_number is not None:
            tolerance = self.tolerance if self.tolerance is not None else 0.0
            return math.isclose(submitted_number, expected_number, rel_tol=1e-9, abs_tol=tolerance)
        return submitted.strip().casefold() == self.answer.strip().casefold()


def parse_number(text: str) -> float | None:
    try:
        value = float(text.strip().replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class NotebookOptions(BaseModel):
    """Options of the notebook environment (env_options.notebook); the sandbox's limits are
    those of env_servers.sandbox.SandboxLimits, given here flat."""

    model_config = ConfigDict(extra="forbid")

    data_dir: Path = Field(default=DATA_DIR, description="Folder of tasks.jsonl and the tasks' data")
    cell_timeout_s: int = Field(default=60, gt=0, description="Wall time of one cell")
    cpu_seconds_per_cell: float = Field(default=60.0, gt=0, description="CPU time of one cell")
    max_output_chars: int = Field(default=100_000, gt=0, description="Output kept of one cell")
    sandbox: SandboxMode = Field(default="bwrap", description="bwrap, or none to run unsandboxed")
    memory_mb: int = SandboxLimits.model_fields["memory_mb"]
    max_processes: int = SandboxLimits.model_fields["max_processes"]
    max_file_mb: int = SandboxLimits.model_fields["max_file_mb"]
    workspace_mb: int = SandboxLimits.model_fields["workspace_mb"]
    tmp_mb: int = SandboxLimits.model_fields["tmp_mb"]
    threads: int = SandboxLimits.model_fields["threads"]
    network: bool = SandboxLimits.model_fields["network"]
    pool_size: int = Field(
        default=4, ge=0,
        description="Sandboxed kernels kept started ahead of Reset and Fork, each with an empty workspace of"
        " its own; a kernel serves one episode and is destroyed with it. 0: no pool, every Reset starts one")
    pool_refill_parallel: int = Field(
        default=1, gt=0,
        description="Refill rate: how many kernels the pool starts at once, in the background, after Resets"
        " and Forks took some")
    preload: list[str] = Field(
        default=["pandas", "numpy"],
        description="Modules each pooled kernel imports before an episode takes it (a list, or names separated"
        " by commas; empty: none). No name is bound in the episode's namespace")
    pool_min_available_mb: int = Field(
        default=1024, ge=0,
        description="The pool starts no kernel while the host has less memory available (MemAvailable);"
        " Resets then start kernels on demand, as without a pool")

    @field_validator("preload", mode="before")
    @classmethod
    def _preload_names(cls, value: object) -> object:
        if isinstance(value, str):
            value = [name.strip() for name in value.strip("[]").split(",") if name.strip()]
        if isinstance(value, list):
            bad = [name for name in value if not isinstance(name, str) or not _MODULE_NAME.fullmatch(name)]
            if bad:
                raise ValueError(f"preload takes module names such as pandas or scipy.stats; not {bad}")
        return value

    def pool_settings(self) -> PoolSettings:
        return PoolSettings(size=self.pool_size, refill_parallel=self.pool_refill_parallel,
                            preload=list(self.preload), min_available_mb=self.pool_min_available_mb)

    def limits(self) -> SandboxLimits:
        return SandboxLimits(**{name: getattr(self, name) for name in SandboxLimits.model_fields
                                if name in type(self).model_fields})


ActionMode = Literal["tools", "code"]


class NotebookEpisodeOptions(BaseModel):
    """Per-episode options of the notebook environment (ResetRequest.options)."""

    model_config = ConfigDict(extra="forbid")

    action: ActionMode = Field(
        default="tools",
        description="tools: edit_cell, list_workdir and submit_answer; code: no tools, a reply's first ```python"
        " block runs as the next cell and a reply without one is the answer")
    cell_reward: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="Added to the reward of a step whose cell ran without an error (a shaping term)")

    observation: Literal["history", "state"] = Field(
        default="history",
        description="history: each step's observations are its tool results and the notebook, to be"
        " appended to the conversation; state: each step's observation is the whole view (instruction,"
        " earlier actions in short, the current notebook) and replaces the conversation")


# The state view lists at most this many earlier actions (the latest), each cut to ACTION_CHARS.
STATE_ACTIONS, ACTION_CHARS = 12, 160


class SandboxedKernelState(NBEnvironmentState):
    """The notebook's state with its kernel in a sandbox on the episode's workspace (the
    workspace of the kernel it took from the pool, or of one started for it)."""

    _sandbox: Sandbox = PrivateAttr()
    _kernel: SandboxedKernel = PrivateAttr()

    def adopt(self, pooled: PooledKernel) -> None:
        """Make `pooled` (whose workspace is this state's work_dir) the episode's kernel; the
        files put in the workspace since the sandbox was made become its user's."""
        self._sandbox, self._kernel = pooled.sandbox, pooled.kernel
        self._sandbox.own_workspace()

    async def start_kernel(self) -> None:
        """Taken by DataAnalysisEnv.reset from its kernel pool instead."""

    @property
    def kernel(self) -> SandboxedKernel:
        return self._kernel

    @property
    def sandbox(self) -> Sandbox:
        return self._sandbox

    async def stop(self) -> None:
        if hasattr(self, "_kernel"):
            await self._kernel.stop()
        if hasattr(self, "_sandbox"):
            self._sandbox.remove()


class DataAnalysisEnv(NBEnvironment[SandboxedKernelState]):
    STATE_CLS = SandboxedKernelState

    def __init__(self, task: NotebookTask, data_dir: Path, options: NotebookOptions, kernels: KernelPool) -> None:
        super().__init__(
            work_dir=data_dir / task.dataset,
            use_tmp_work_dir=True,  # reset copies work_dir into the workspace of the kernel it takes
            use_docker=False,
            cell_execution_timeout=options.cell_timeout_s,
        )
        self.task = task
        self.options = options
        self.kernels = kernels
        self._taken: PooledKernel | None = None  # the kernel reset took, until the state adopts it
        self.observation = "history"  # NotebookEpisodeOptions.observation
        self.action_mode: ActionMode = "tools"  # NotebookEpisodeOptions.action
        self.cell_reward = 0.0  # NotebookEpisodeOptions.cell_reward
        self.clean_runs = 0  # cell runs that ended without an error or a limit
        self.action_log: list[str] = []  # the agent's actions in short, for the state view
        self.reward_components: RewardComponents = {}

    async def reset(self) -> tuple[Messages, list[Tool]]:
        # NBEnvironment.reset replaces the state without stopping the previous kernel.
        await self.close()
        self._taken = await self.kernels.take()
        try:
            notebook_observations, tools = await super().reset()  # copies the data (_set_work_dir)
            self.state.adopt(self._taken)
        except BaseException:
            await self._taken.destroy()
            if hasattr(self, "state"):
                del self.state
            raise
        finally:
            self._taken = None
        self.reward_components = {}
        self.action_log = []
        self.clean_runs = 0
        self.tools = [] if self.action_mode == "code" else [*tools, Tool.from_function(self.submit_answer)]
        return [Message(content=self.task.prompt(self.action_mode)), *notebook_observations], self.tools

    def _set_work_dir(self) -> tuple[Path, Path]:
        """The workspace of the kernel reset took, with a copy of `work_dir` (the dataset, or the
        parent's workspace for a fork) in it."""
        assert self._taken is not None, "reset takes a kernel before it sets the workspace"
        workspace = self._taken.workspace
        shutil.copytree(self.work_dir, workspace, dirs_exist_ok=True)
        return workspace / self.NOTEBOOK_NAME, workspace

    async def step(self, action: Message) -> tuple[Messages, float, bool, bool]:
        clean_before = self.clean_runs
        if self.action_mode == "code":
            observations, reward, terminated, truncated = await self._code_step(action)
        else:
            observations, reward, terminated, truncated = await super().step(action)
            self.action_log.extend(_short_actions(action, observations))
        if self.cell_reward and self.clean_runs > clean_before:  # once per step, however many cells ran
            # r_t = (grade of an answer given at t) + cell_reward * [a cell of step t ran cleanly]
            reward += self.cell_reward
            self.state.total_reward += self.cell_reward
            self.reward_components["clean_cells"] = self.reward_components.get("clean_cells", 0.0) + 1.0
        if self.observation == "state":
            observations = [self.state_view()]
        return observations, reward, terminated, truncated

    async def _code_step(self, action: Message) -> tuple[Messages, float, bool, bool]:
        """A code action: the reply's first ```python block runs as a new cell (a limit that stops
        it, or a workspace over its size, is reported as the result, as a tool call's error would
        be); a reply without a block is the answer."""
        reply = action.content or ""
        before = self.state.total_reward
        code = code_block(reply)
        if code is None:
            answer = final_answer(reply)
            result = await self.submit_answer(answer)
            observations = [Message(content=result)]
            self.action_log.append(_cut(f"answered {answer!r} -> {result}"))
        else:
            try:
                result = await self.edit_cell(code)
            except Exception as error:  # noqa: BLE001 -- what stopped the cell is the agent's to read
                result = f"{type(error).__name__}: {error}"
            observations = [Message(content=result), self.get_env_state_msg()]
            self.action_log.append(_cut(f"ran a cell: {code} -> {result}"))
        self.state.actions.append(reply)
        return observations, self.state.total_reward - before, self.state.done, False

    def state_view(self) -> Message:
        """The instruction, the latest earlier actions in short, and the notebook as it is now: a
        prompt whose size does not grow with the number of steps (only with the notebook)."""
        earlier = self.action_log[-STATE_ACTIONS:]
        omitted = len(self.action_log) - len(earlier)
        lines = ([f"({omitted} earlier actions not shown)"] if omitted else []) + [
            f"{len(self.action_log) - len(earlier) + number + 1}. {line}" for number, line in enumerate(earlier)]
        notebook = self.get_env_state_msg()
        text = (f"{self.task.prompt(self.action_mode)}\n\nYour actions so far:\n" + ("\n".join(lines) or "(none)")
                + f"\n\n{notebook.content if not notebook.content_is_json_str else _text_of(notebook)}")
        if notebook.content_is_json_str:  # the notebook has images: keep them
            return Message.create_message(text=text, images=_images_of(notebook))
        return Message(content=text)

    async def _run_notebook_local(self, cell_idx: int | None = None) -> str:
        """Run the cells (all, or `cell_idx`) in the sandboxed kernel under the cell limits. A
        cell stopped by a limit gets the reason as its last output, and the tool call fails with
        it (the agent reads it); the episode goes on, on a fresh kernel if it had to be killed."""
        limits = CellLimits(wall_s=self.cell_execution_timeout, cpu_s=self.options.cpu_seconds_per_cell,
                            max_output_chars=self.options.max_output_chars)
        stopped: list[str] = []
        for index, cell in enumerate(self.state.cells):
            if cell.cell_type != "code" or (cell_idx is not None and index != cell_idx):
                continue
            result = await self.state.kernel.run_cell(cell.source, limits)
            cell.outputs = result.outputs
            if result.stopped is None and not any(output.get("output_type") == "error" for output in result.outputs):
                self.clean_runs += 1
            if result.stopped is not None:
                note = f"Cell {index} was stopped: {result.stopped}." + (
                    " The kernel was restarted: variables and imports of earlier cells are gone."
                    if result.restarted else "")
                cell.outputs.append(nbformat.v4.new_output("stream", name="stderr", text=note + "\n"))
                stopped.append(note)
                break
        self.state.save_nb()
        self.state.reload_nb()
        used, allowed = self.state.sandbox.workspace_bytes(), self.options.workspace_mb << 20
        if used > allowed:
            self.state.done = True
            raise RuntimeError(f"the workspace holds {used >> 20} MiB, more than its limit of"
                               f" {self.options.workspace_mb} MiB; the episode is over")
        if stopped:
            raise TimeoutError(" ".join(stopped))
        return "Executed all cells."

    async def fork(self) -> "DataAnalysisEnv":
        """A new episode at this one's step: a copy of the workspace (data, files the cells wrote,
        the notebook) in the workspace of a kernel from the pool (or one started for it), and the notebook's code
        cells run again in order, so that the kernel has the variables they made. Exact when the
        cells are deterministic. A replayed cell stopped by a limit fails the fork."""
        twin = DataAnalysisEnv(self.task, self.options.data_dir, self.options, self.kernels)
        twin.observation, twin.action_mode, twin.cell_reward = self.observation, self.action_mode, self.cell_reward
        twin.work_dir = self.state.work_dir  # reset copies this folder into a fresh workspace
        try:
            await twin.reset()
        finally:
            twin.work_dir = self.work_dir  # a later reset of the fork starts from the dataset again
        try:
            notebook = self.state.work_dir.name
            limits = CellLimits(wall_s=self.cell_execution_timeout, cpu_s=self.options.cpu_seconds_per_cell,
                                max_output_chars=self.options.max_output_chars)
            for index, cell in enumerate(twin.state.cells):
                if cell.cell_type != "code":
                    continue
                result = await twin.state.kernel.run_cell(cell.source, limits)
                if result.stopped is not None:
                    raise RuntimeError(f"replaying cell {index} of {notebook} was stopped: {result.stopped}")
            twin.state.total_reward, twin.state.done = self.state.total_reward, self.state.done
            twin.state.answer, twin.state.actions = self.state.answer, list(self.state.actions)
            twin.reward_components = dict(self.reward_components)
            twin.action_log = list(self.action_log)
        except BaseException:
            await twin.close()
            raise
        return twin

    async def submit_answer(self, answer: str) -> str:
        """Submit the final answer to the question. This ends the episode.

        Args:
            answer: The answer alone (a number, name or identifier), without units or explanation.
        """
        correct = self.task.is_correct(answer)
        self.state.answer = answer
        self.state.done = True
        self.state.total_reward += 1.0 if correct else 0.0
        self.reward_components["correct"] = float(correct)
        return "Answer submitted; the episode is over."

    async def close(self) -> None:
        """Kill the kernel's sandbox and remove the episode's directories, even if stopping fails."""
        if not hasattr(self, "state"):
            return
        work_dir = self.state.work_dir
        try:
            await self.state.stop()
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
            del self.state


class NotebookSource(EnvironmentSource):
    name = "notebook"
    description = (
        "Data-analysis questions on CSV files answered in a local Jupyter notebook; tools:"
        " edit_cell(contents, idx), list_workdir(), submit_answer(answer)."
        " Reward 1 for a correct submitted answer, else 0. Reset options: observation: history (default:"
        " each step's observations are appended) | state (each step's observation is the whole view:"
        " instruction, earlier actions in short, current notebook); action: tools (default) | code (no"
        " tools: a reply's ```python block runs as the next cell, a reply without one is the answer);"
        " cell_reward: added to the reward of a step whose cell runs without an error (default 0)."
    )

    fork_mode = FORK_REPLAY
    reward_range = (0.0, 1.0, 0.0)  # with the default episode options (cell_reward 0)

    def __init__(self, options: NotebookOptions) -> None:
        self.options = options
        check_mode(options.sandbox)
        missing = [name for name in options.preload if importlib.util.find_spec(name.split(".")[0]) is None]
        if missing:
            raise ValueError(f"preload names {missing}, not installed in this Python (the kernels run on it);"
                             " install them or remove them from preload")
        self.pool = KernelPool(options.pool_settings(), options.limits(), options.sandbox)
        self.description = f"{type(self).description} {describe_mode(options.sandbox, options.limits())}."
        if not (options.data_dir / "tasks.jsonl").is_file():
            raise FileNotFoundError(
                f"notebook tasks file {options.data_dir / 'tasks.jsonl'} is missing; run"
                " env_servers/data/notebook/generate.py or point data_dir at a task folder"
            )

    @cached_property
    def _tasks(self) -> dict[str, list[NotebookTask]]:
        by_split: dict[str, list[NotebookTask]] = {}
        for line in (self.options.data_dir / "tasks.jsonl").read_text().splitlines():
            task = NotebookTask.model_validate_json(line)
            by_split.setdefault(task.split, []).append(task)
        return by_split

    @property
    def splits(self) -> dict[str, int]:
        return {split: len(tasks) for split, tasks in self._tasks.items()}

    def start(self, room: Callable[[], int] | None = None) -> None:
        """Start filling the kernel pool (see KernelPool.start)."""
        self.pool.start(room)

    async def aclose(self) -> None:
        """Kill every kernel in the pool."""
        await self.pool.aclose()

    def pool_stats(self) -> PoolStats | None:
        return self.pool.stats()

    def _env(self, task: NotebookTask) -> DataAnalysisEnv:
        return DataAnalysisEnv(task, self.options.data_dir, self.options, self.pool)

    async def _make_checked(self, split: str, index: int) -> DataAnalysisEnv:
        return self._env(self._tasks[split][index])

    async def make_inline(self, task: dict[str, str]) -> DataAnalysisEnv:
        require_fields(self.name, task, {"question", "answer", "dataset"}, frozenset({"tolerance"}))
        dataset_dir = self.options.data_dir / task["dataset"]
        datasets = sorted(p.name for p in self.options.data_dir.iterdir() if p.is_dir())
        if task["dataset"] not in datasets:
            raise ValueError(f"unknown notebook dataset {task['dataset']!r}; known: {datasets}")
        tolerance = parse_number(task.get("tolerance", "0"))
        if tolerance is None or tolerance < 0:
            raise ValueError(f"tolerance must be a number >= 0, got {task['tolerance']!r}")
        return self._env(
            NotebookTask(
                id="inline",
                split="inline",
                dataset=task["dataset"],
                files=sorted(p.name for p in dataset_dir.iterdir() if p.is_file()),
                question=task["question"],
                answer=task["answer"],
                tolerance=tolerance,
            )
        )

    def _summary_checked(self, split: str, index: int) -> dict[str, str]:
        # The summary reaches the agent (ResetResponse.task_summary): never the answer.
        task = self._tasks[split][index]
        return {
            "id": task.id,
            "question": task.question,
            "files": json.dumps(task.files),
        }

    async def fork(self, env: Environment) -> Environment:
        if not isinstance(env, DataAnalysisEnv):
            raise ForkUnsupportedError(f"{type(env).__name__} is not a notebook environment of this server")
        return await env.fork()

    def check_episode_options(self, options: Mapping[str, str]) -> None:
        try:
            NotebookEpisodeOptions.model_validate(dict(options))
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise ValueError(f"notebook per-episode options: {problems} (it takes observation: history | state,"
                             " action: tools | code, cell_reward: a number from 0 to 1)") from None

    def configure(self, env: Environment, options: Mapping[str, str]) -> None:
        if isinstance(env, DataAnalysisEnv):
            chosen = NotebookEpisodeOptions.model_validate(dict(options))
            env.observation, env.action_mode, env.cell_reward = chosen.observation, chosen.action, chosen.cell_reward

    def unanswered_reward(self, env: Environment) -> tuple[float, RewardComponents]:
        return no_submission(0.0)

    def reference_actions(self, split: str, index: int) -> list[Message]:
        """The task's answer, submitted (the default tool actions)."""
        return [submission(self._tasks[split][index].answer)]

    async def rescore(
        self, split: str, index: int, messages: Sequence[Message]
    ) -> tuple[float, RewardComponents]:
        """Score the final submit_answer call; the answer check needs no kernel."""
        self.check_task(split, index)
        answer = last_tool_argument(messages, "submit_answer", "answer")
        if answer is None:
            return no_submission(0.0)
        correct = self._tasks[split][index].is_correct(answer)
        return float(correct), {"correct": float(correct), "submitted": 1.0}


def _short_actions(action: Message, observations: Messages) -> list[str]:
    """One line per tool call of `action`: the call, its first arguments, and the start of its
    result (the tool message answering it)."""
    if not isinstance(action, ToolRequestMessage) or not action.tool_calls:
        return [_cut(f"replied without a tool call: {action.content or ''}")]
    results = {getattr(m, "tool_call_id", None): m.content or "" for m in observations}
    lines = []
    for call in action.tool_calls:
        arguments = ", ".join(f"{name}={value!r}" for name, value in call.function.arguments.items())
        result = results.get(call.id, "")
        lines.append(_cut(f"{call.function.name}({arguments}) -> {result}"))
    return lines


_CODE_BLOCK = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_ANSWER = re.compile(r"answer\s*:\s*(.*)", re.IGNORECASE)


def code_block(reply: str) -> str | None:
    """The code of the reply's first fenced block (one cut off by max_tokens included), or None."""
    match = _CODE_BLOCK.search(reply)
    return match.group(1) if match is not None and match.group(1).strip() else None


def final_answer(reply: str) -> str:
    """The answer in a reply without code: the rest of the line after its last "Answer:", else the
    whole reply, without the quotes, emphasis or full stop around it."""
    answers = _ANSWER.findall(reply)
    answer = answers[-1] if answers else reply
    return answer.strip().removesuffix(".").strip("*`'\" ").removesuffix(".")


def _cut(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= ACTION_CHARS else flat[:ACTION_CHARS - 3] + "..."


def _text_of(message: Message) -> str:
    parts = json.loads(message.content or "[]")
    return "\n".join(part.get("text", "") for part in parts if part.get("type") == "text")


def _images_of(message: Message) -> list[str]:
    parts = json.loads(message.content or "[]")
    return [part["image_url"]["url"] for part in parts if part.get("type") == "image_url"]
