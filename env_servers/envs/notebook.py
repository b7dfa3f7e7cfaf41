"""Data-analysis questions on CSV files, answered in a Jupyter notebook (in the spirit of BixBench).

Built on Aviary's NBEnvironment with a local kernel (no Docker). Each episode copies its dataset
folder into a fresh temporary directory (its workspace), runs its own kernel there in a bwrap
sandbox with limits (env_servers.sandbox; `sandbox: none` opts out), and removes both on close.
A submit_answer tool ends the episode: reward 1 for a correct answer, 0 otherwise.
"""

import json
import math
import shutil
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import nbformat
from aviary.core import Environment, Message, Messages, Tool
from aviary.envs.notebook import NBEnvironment, NBEnvironmentState
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from env_servers.envs.kernel import CellLimits, SandboxedKernel
from env_servers.envs.source import (
    EnvironmentSource,
    RewardComponents,
    last_tool_argument,
    no_submission,
    require_fields,
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

    def prompt(self) -> str:
        return (
            f"Answer this question about the data in {', '.join(self.files)} (in the working"
            " directory of the notebook). Use edit_cell to run Python code (pandas is"
            " available), and when you know the answer call submit_answer with the answer alone,"
            f" no units or explanation.\n\nQuestion: {self.question}"
        )

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


class NotebookOptions(BaseModel):
    """Options of the notebook environment (env_options.notebook); the sandbox's limits are
    those of env_servers.sandbox.SandboxLimits, given here flat."""

    model_config = ConfigDict(extra="forbid")

    data_dir: Path = DATA_DIR
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

    def limits(self) -> SandboxLimits:
        return SandboxLimits(**{name: getattr(self, name) for name in SandboxLimits.model_fields
                                if name in type(self).model_fields})


class SandboxedKernelState(NBEnvironmentState):
    """The notebook's state with its kernel in a sandbox on the episode's workspace."""

    _sandbox: Sandbox = PrivateAttr()
    _kernel: SandboxedKernel = PrivateAttr()

    async def start_sandboxed(self, limits: SandboxLimits, mode: SandboxMode) -> None:
        self._sandbox = Sandbox(self.work_dir, limits, mode)
        try:
            self._kernel = await SandboxedKernel.start(self._sandbox)
        except BaseException:
            self._sandbox.remove()
            raise

    async def start_kernel(self) -> None:
        """Started by DataAnalysisEnv.reset with the environment's limits instead."""

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

    def __init__(self, task: NotebookTask, data_dir: Path, options: NotebookOptions) -> None:
        super().__init__(
            work_dir=data_dir / task.dataset,
            use_tmp_work_dir=True,  # Aviary copies work_dir into a mkdtemp() folder per reset
            use_docker=False,
            cell_execution_timeout=options.cell_timeout_s,
        )
        self.task = task
        self.options = options
        self.reward_components: RewardComponents = {}

    async def reset(self) -> tuple[Messages, list[Tool]]:
        # NBEnvironment.reset replaces the state without stopping the previous kernel.
        await self.close()
        notebook_observations, tools = await super().reset()
        try:
            await self.state.start_sandboxed(self.options.limits(), self.options.sandbox)
        except BaseException:
            shutil.rmtree(self.state.work_dir, ignore_errors=True)
            del self.state
            raise
        self.reward_components = {}
        self.tools = [*tools, Tool.from_function(self.submit_answer)]
        return [Message(content=self.task.prompt()), *notebook_observations], self.tools

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

    async def submit_answer(self, answer: str) -> str:
        """Submit the final answer to the question. This ends the episode.

        Args:
            answer: The answer alone (a number, name or identifier), without units or explanation.
        """
        correct = self.task.is_correct(answer)
        self.state.answer = answer
        self.state.done = True
        self.state.total_reward += 1.0 if correct else 0.0
        self.reward_components = {"correct": float(correct)}
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
        " Reward 1 for a correct submitted answer, else 0."
    )

    def __init__(self, options: NotebookOptions) -> None:
        self.options = options
        check_mode(options.sandbox)
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

    def _env(self, task: NotebookTask) -> DataAnalysisEnv:
        return DataAnalysisEnv(task, self.options.data_dir, self.options)

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

    def unanswered_reward(self, env: Environment) -> tuple[float, RewardComponents]:
        return no_submission(0.0)

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
