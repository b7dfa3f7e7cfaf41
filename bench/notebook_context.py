"""How long a notebook agent's prompt gets, turn by turn, with the environment's two context
policies side by side in one run (`ResetRequest.options["observation"]`):

  history  every step's observations (tool results, the notebook) are appended to the
           conversation: the prompt of turn t holds every earlier notebook view
  state    every step's observation is the whole view (instruction, earlier actions in short, the
           current notebook) and replaces the conversation

A scripted agent (no model) plays episodes of 2, 5 and 10 steps on the notebook test task 0 of a
real `sciproto serve env` process; each step writes a cell that prints a summary of one column of
the data, in two ways: `append` (a new cell every step: the notebook itself grows) and `rewrite`
(the agent keeps one working cell, idx 0, and rewrites it: the notebook stays one cell). Before each turn the prompt the policy would get is counted in SmolLM2 tokens (its
chat template, tool calls written as their JSON). The same actions are sent in both modes.

Prints JSON (stdout, and `--output`): prompt tokens per turn (mean, max, every turn) per agent,
mode and episode length, and the ratio history max / state max per agent and length (the state
view's saving; it grows with the episode).

    python bench/notebook_context.py [--steps 2,5,10] [--output FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from sciproto.client.env import EnvClient, tool_calls_action
from sciproto.models.smollm2 import load_smollm2_tokenizer
from sciproto.pb import common_pb2
from sciproto.processes import start_server

MODES = ("history", "state")
ROLES = {common_pb2.ROLE_SYSTEM: "system", common_pb2.ROLE_USER: "user",
         common_pb2.ROLE_ASSISTANT: "assistant", common_pb2.ROLE_TOOL: "user"}


def cell(step: int) -> str:
    """The code of step `step`: a summary of one column of the task's first file."""
    return ("import json, pandas as pd\n"
            f"frame = pd.read_csv(sorted(__import__('glob').glob('*.csv'))[0])\n"
            f"column = frame.columns[{step} % len(frame.columns)]\n"
            "print(column, frame[column].describe().to_string())")


def prompt_tokens(tokenizer: Any, messages: list[common_pb2.ChatMessage]) -> int:
    chat = []
    for message in messages:
        calls = [{"name": call.name, "arguments": call.arguments} for call in message.tool_calls]
        content = message.content + (("\n" + json.dumps(calls)) if calls else "")
        chat.append({"role": ROLES.get(message.role, "user"), "content": content})
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


AGENTS = ("append", "rewrite")


async def episode(client: EnvClient, tokenizer: Any, agent: str, mode: str, steps: int) -> list[int]:
    """Prompt tokens of each of `steps` turns of one episode of `agent` in `mode`."""
    reset = await client.reset("notebook", split="test", index=0, options={"observation": mode})
    conversation = list(reset.observations)
    tokens = []
    try:
        for step in range(steps):
            tokens.append(prompt_tokens(tokenizer, conversation))
            arguments: dict[str, Any] = {"contents": cell(step)}
            if agent == "rewrite":
                arguments["idx"] = 0
            action = tool_calls_action(("edit_cell", arguments))
            response = await client.step(reset.episode_id, action)
            if mode == "state":  # the observation is the whole view: the next prompt is it alone
                conversation = list(response.observations)
            else:
                conversation += [action, *response.observations]
    finally:
        await client.close(reset.episode_id)
    return tokens


async def measure(target: str, lengths: list[int]) -> dict[str, Any]:
    tokenizer = load_smollm2_tokenizer()
    results: dict[str, Any] = {agent: {mode: {} for mode in MODES} for agent in AGENTS}
    async with EnvClient(target) as client:
        for agent in AGENTS:
            for mode in MODES:
                for steps in lengths:
                    tokens = await episode(client, tokenizer, agent, mode, steps)
                    results[agent][mode][str(steps)] = {"mean": round(sum(tokens) / len(tokens), 1),
                                                        "max": max(tokens), "per_turn": tokens}
                    print(f"[notebook_context] {agent} {mode} {steps} steps: max {max(tokens)} tokens",
                          file=sys.stderr)
            by_mode = results[agent]
            by_mode["history_max_over_state_max"] = {
                str(steps): round(by_mode["history"][str(steps)]["max"] / by_mode["state"][str(steps)]["max"], 2)
                for steps in lengths}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="2,5,10", help="episode lengths, comma-separated")
    parser.add_argument("--sandbox", default="bwrap", help="notebook sandbox: bwrap, or none")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    lengths = [int(part) for part in args.steps.split(",")]
    server = start_server(["serve", "env", "--port", "0", "--set", "envs=[notebook]",
                           "--set", f"env_options.notebook.sandbox={args.sandbox}"], timeout_s=120)
    try:
        results = asyncio.run(measure(server.target, lengths))
    finally:
        server.stop(grace_s=15)
    report = {"bench": "notebook_context", "tokenizer": "SmolLM2-135M-Instruct", "task": "notebook test 0",
              **results}
    text = json.dumps(report)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
