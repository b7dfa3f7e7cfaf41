"""Data-analysis questions on CSV files, answered in a Jupyter notebook (in the spirit of BixBench).

Built on Aviary's NBEnvironment with a local kernel (no Docker). Each episode copies its dataset
folder into a fresh temporary directory, runs its own kernel there, and removes both on close.
A submit_answer tool ends the episode: reward 1 for a correct answer, 0 otherwise.
"""

import asyncio
import json
import math
import shutil
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from aviary.core import Environment, Message, Messages, Tool
from aviary.envs.notebook import NBEnvironment, NBEnvironmentState
from aviary.envs.notebook.utils import nbformat_run_notebook
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.kernelspec import NATIVE_KERNEL_NAME
from jupyter_client.manager import AsyncKernelManager
from pydantic import BaseModel, ConfigDict, Field

from env_servers.envs.source import (
    EnvironmentSource,
    RewardComponents,
    last_tool_argument,
    no_submission,
    require_fields,
)

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


KERNEL_READY_TIMEOUT_S = 60.0


class LocalKernelState(NBEnvironmentState):
    """A local kernel, up and answering before Reset returns."""

    async def start_kernel(self) -> None:
        # Aviary asks for a kernelspec named "python", but ipykernel installs itself as
        # "python3" (jupyter_client's native kernel), so we start that one.
        self._kernel_manager = AsyncKernelManager(kernel_name=NATIVE_KERNEL_NAME)
        await self._kernel_manager.start_kernel(cwd=str(self.work_dir))
        (await self.ready_client()).stop_channels()

    async def ready_client(self) -> AsyncKernelClient:
        """A new client whose shell and IOPub channels are connected. A client that executes
        at once can miss the cell's output and idle status: its IOPub subscription may reach
        the kernel after they were published (ZeroMQ's late joiner), and the step then waits
        out the whole cell timeout. wait_for_ready returns once IOPub has received."""
        client = self._kernel_manager.client()
        client.start_channels()
        try:
            await client.wait_for_ready(timeout=KERNEL_READY_TIMEOUT_S)
        except BaseException:
            client.stop_channels()
            raise
        return client


class DataAnalysisEnv(NBEnvironment[LocalKernelState]):
    STATE_CLS = LocalKernelState

    def __init__(self, task: NotebookTask, data_dir: Path, cell_timeout_s: int) -> None:
        super().__init__(
            work_dir=data_dir / task.dataset,
            use_tmp_work_dir=True,  # Aviary copies work_dir into a mkdtemp() folder per reset
            use_docker=False,
            cell_execution_timeout=cell_timeout_s,
        )
        self.task = task
        self.reward_components: RewardComponents = {}

    async def reset(self) -> tuple[Messages, list[Tool]]:
        # NBEnvironment.reset replaces the state without stopping the previous kernel.
        await self.close()
        notebook_observations, tools = await super().reset()
        self.reward_components = {}
        self.tools = [*tools, Tool.from_function(self.submit_answer)]
        return [Message(content=self.task.prompt()), *notebook_observations], self.tools

    async def _run_notebook_local(self, cell_idx: int | None = None) -> str:
        """Aviary's local run, on a client made ready before the cell is sent (see
        `LocalKernelState.ready_client`); Aviary's helper stops the client's channels when done."""
        try:
            async with asyncio.timeout(self.cell_execution_timeout):
                client = await self.state.ready_client()
                await nbformat_run_notebook(cells=self.state.cells, client=client, cell_idx=cell_idx)
        except TimeoutError as error:
            raise TimeoutError(f"Notebook execution timed out after {self.cell_execution_timeout} seconds") from error
        self.state.save_nb()
        self.state.reload_nb()
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
        """Stop the kernel and remove the episode's directory, even if stopping fails."""
        if not hasattr(self, "state"):
            return
        work_dir = self.state.work_dir
        try:
            await super().close()
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
            del self.state


class NotebookOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data_dir: Path = DATA_DIR
    cell_timeout_s: int = Field(default=60, gt=0)


class NotebookSource(EnvironmentSource):
    name = "notebook"
    description = (
        "Data-analysis questions on CSV files answered in a local Jupyter notebook; tools:"
        " edit_cell(contents, idx), list_workdir(), submit_answer(answer)."
        " Reward 1 for a correct submitted answer, else 0."
    )

    def __init__(self, options: NotebookOptions) -> None:
        self.options = options
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
        return DataAnalysisEnv(task, self.options.data_dir, self.options.cell_timeout_s)

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
