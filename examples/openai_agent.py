"""An external agent as a team would write it (`sciproto train --set "rollout.agent={command: python
examples/openai_agent.py}"`): the `openai` SDK, its base URL from
OPENAI_BASE_URL, its task from SCIPROTO_TASK. It asks the model once, then answers through the
task's tool with the model's text (or the model's own tool call, when it made one)."""

import json
import os

import openai

task = json.loads(os.environ["SCIPROTO_TASK"])
client = openai.OpenAI(max_retries=0, timeout=300)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
model = client.models.list().data[0].id
reply = client.chat.completions.create(model=model, messages=task["messages"], tools=task["tools"], max_tokens=24)
assert reply.choices[0].message.content is not None or reply.choices[0].message.tool_calls
