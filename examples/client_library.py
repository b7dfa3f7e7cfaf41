"""One episode through the client library: the policy answers the environment's prompt, the
environment scores it (docs/guides/python-client.md). Usage: python examples/client_library.py ENV POLICY"""

import asyncio
import sys

from sciproto.client.env import EnvClient
from sciproto.client.policy import PolicyClient, generate_request
from sciproto.pb import common_pb2


async def main(env_target: str, policy_target: str) -> None:
    async with EnvClient(env_target) as env, PolicyClient(policy_target) as policy:
        info = await env.describe()
        print("environments:", [e.name for e in info.environments])
        episode = await env.reset("letters", split="test", index=0)
        print("prompt:", episode.observations[-1].content)
        group = await policy.generate_group(generate_request(
            messages=list(episode.observations), max_tokens=8, temperature=1.0, n=4, seed=0))
        for sample in group.samples:
            print(f"sample {sample.sample_index}: {sample.text!r} ({len(sample.completion_token_ids)} tokens,"
                  f" policy version {group.policy_version})")
        reply = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=group.samples[0].text)
        step = await env.step(episode.episode_id, reply)
        print("observation:", step.observations[-1].content, "| terminated:", step.terminated)
        grade = await env.verify(episode.episode_id)
        print("verified reward:", grade.reward.value, common_pb2.RewardStatus.Name(grade.reward.status))
        await env.close(episode.episode_id)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
