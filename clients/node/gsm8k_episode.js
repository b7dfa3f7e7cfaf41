#!/usr/bin/env node
// Runs one GSM8K episode against an env server and prints it as JSON:
//   node clients/node/gsm8k_episode.js HOST:PORT
// The task is inline (the question and its answer are ours), the agent asks the
// calculator, then submits the calculator's result. Exits 0 only if the reward is 1.
"use strict";

const { EnvClient, toolCallsAction } = require("./env_client");

const TASK = { question: "A baker makes 17 trays of 24 rolls. How many rolls is that?", answer: "408" };

async function runEpisode(client) {
  const described = await client.describe();
  const gsm8k = described.environments.find((env) => env.name === "gsm8k");
  if (!gsm8k) {
    throw new Error(`the server does not host gsm8k (it hosts ${described.environments.map((e) => e.name)})`);
  }
  const reset = await client.reset("gsm8k", { inlineTask: { fields: TASK } });
  const toolNames = reset.tools.map((tool) => tool.name);
  const calculation = await client.step(reset.episodeId, toolCallsAction([["calculator", { expr: "17 * 24" }]]));
  const result = calculation.observations[0].content;
  const submission = await client.step(reset.episodeId, toolCallsAction([["submit_answer", { answer: result }]]));
  const verified = await client.verify(reset.episodeId);
  await client.close(reset.episodeId);
  return {
    protocol_version: described.server.protocolVersion,
    episode_id: reset.episodeId,
    tools: toolNames,
    calculator_result: result,
    step_reward: submission.reward.value,
    terminated: submission.terminated,
    reward: verified.reward.value,
    reward_status: verified.reward.status,
    step_count: submission.stepCount,
  };
}

async function main() {
  const target = process.argv[2];
  if (!target) {
    console.error("usage: node clients/node/gsm8k_episode.js HOST:PORT");
    process.exit(2);
  }
  const client = new EnvClient(target, { deadlineMs: 30000 });
  try {
    const episode = await runEpisode(client);
    console.log(JSON.stringify(episode));
    process.exitCode = episode.reward === 1 && episode.reward_status === "REWARD_STATUS_SCORED" ? 0 : 1;
  } catch (error) {
    console.error(error.message);
    process.exitCode = 1;
  } finally {
    client.shutdown();
  }
}

main();
