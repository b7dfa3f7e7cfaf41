"""FutureHouse's `ldp` SimpleAgent, over LiteLLM, plays Aviary's GSM8K calculator env through the
gateway (the in-process API) on the tiny policy server: the session's tokens are the re-rendered
messages token for token, its logprobs are those LiteLLM was given, and its reward is Verify's.

ldp's LLMCallOp asks for tool_choice "required" by default, which the gateway refuses (the policy
samples freely, with no constrained decoding); the agent here asks for "auto"."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pytest
from aviary.envs.gsm8k import CalculatorEnv, CalculatorEnvConfig
from ldp.agent import SimpleAgent
from lmi.config import LLMConfig, ModelSpec

from env_servers.envs.gsm8k import DATA_DIR, parse_answer_number
from gateway.local import LocalGateway
from sciproto.client.env import EnvClient
from sciproto.models import load_model
from sciproto.pb import common_pb2, env_pb2
from sciproto.processes import ServerProcess, start_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def gsm8k_env() -> Iterator[ServerProcess]:
    server = start_server(["serve", "env", "--env", "gsm8k", "--port", "0"], timeout_s=180)
    yield server
    server.stop()


async def test_an_ldp_simple_agent_plays_gsm8k_through_the_gateway(tiny_policy: ServerProcess,
                                                                    gsm8k_env: ServerProcess) -> None:
    row = json.loads((DATA_DIR / "short_train.jsonl").read_text().splitlines()[0])
    played: dict[str, object] = {}

    async with LocalGateway([tiny_policy.target]) as gateway, EnvClient(gsm8k_env.target) as envs:
        assert gateway.gateway is not None
        store = gateway.gateway.store

        async def agent(base_url: str) -> float:
            spec = ModelSpec(name=f"openai/{gateway.model}", api_base=base_url, api_key="unused", max_retries=0,
                             extra_params={"temperature": 1.0, "max_tokens": 16, "logprobs": True})
            simple = SimpleAgent(llm_config=LLMConfig(models=[spec]))
            simple._llm_call_op.default_tool_choice = "auto"  # see the module's docstring
            # The tiny random model writes no tool call: with done_on_failure off the env answers
            # "Must call one of the provided tools" and the episode goes on, to 2 turns.
            env = CalculatorEnv(problem_id="short_train/0", problem=row["question"],
                                answer=parse_answer_number(row["answer"]),
                                config=CalculatorEnvConfig(done_on_failure=False))
            obs, tools = await env.reset()
            state = await simple.init_state(tools)
            raw_logprobs = []
            for _ in range(2):
                action, state, _ = await simple.get_asv(state, obs)
                raw_logprobs.append(simple._llm_call_op.ctx.get(action.call_id, "raw_logprob"))
                obs, _, done, _ = await env.step(action.value)
                if done:
                    break
            played["raw_logprobs"] = raw_logprobs
            session = store.sessions[base_url.rstrip("/").split("/")[-2]]
            played["calls"] = list(session.calls)
            last = session.calls[-1]
            reply = last.choices[0]
            trajectory = env_pb2.StoredTrajectory(
                env="gsm8k", task_ref=env_pb2.TaskRef(split="short_train", index=0),
                messages=[*last.messages, common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=reply.content)])
            played["verify"] = (await envs.verify(trajectory=trajectory)).reward
            return played["verify"].value

        group = await gateway.run_group(agent, "gsm8k/short_train/0", size=1)

    [record] = group.rollouts
    assert record.status == "SCORED", record.error
    calls = played["calls"]
    assert [(c.segment, c.extends) for c in calls] == [(0, False), (0, True)]
    # Logprobs: what LiteLLM handed ldp (its sum per call) is what the session recorded.
    assert played["raw_logprobs"] == pytest.approx([sum(c.choices[0].sample.logprobs) for c in calls])
    # Tokens: the first prompt is the re-rendered messages and tools; each later call adds exactly
    # the re-rendered text of the new message after the sampled tokens, nothing earlier again.
    tokenizer = load_model("tiny").tokenizer
    tools = [{"type": "function", "function": {**tool, "parameters": json.loads(json.dumps(tool["parameters"],
                                                                                       sort_keys=True))}}
             for tool in calls[0].normal_tools]  # the schema as the gateway sends it: keys sorted
    first = [{"role": m["role"], "content": m["content"]} for m in calls[0].normal_messages]
    rendered = tokenizer.apply_chat_template(first, tools=tools, tokenize=False, add_generation_prompt=True)
    assert calls[0].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    for before, after in itertools.pairwise(calls):
        sequence = before.prompt_token_ids + list(before.choices[0].sample.completion_token_ids)
        assert after.prompt_token_ids[: len(sequence)] == sequence
        closing = "<|im_end|>" if before.choices[0].finish_reason == "length" else ""
        added = tokenizer.decode(after.prompt_token_ids[len(sequence):])
        assert added == f"{closing}\n<|im_start|>user\n{after.normal_messages[-1]['content']}<|im_end|>\n" \
                        "<|im_start|>assistant\n", added
    # The record is that one sequence, sampled tokens only in the loss, and Verify's reward.
    final = calls[-1]
    assert record.token_ids == final.prompt_token_ids + list(final.choices[0].sample.completion_token_ids)
    assert sum(record.loss_mask) == sum(len(c.choices[0].sample.completion_token_ids) for c in calls)
    assert played["verify"].status == common_pb2.REWARD_STATUS_SCORED and record.reward == played["verify"].value
    assert record.group_id == "gsm8k/short_train/0" and record.steps == 2
