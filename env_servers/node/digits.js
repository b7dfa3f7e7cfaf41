// The "digits" environment: one step, reply with digits. The same task as the Python
// server's `toy` environment (reward = fraction of the reply's characters that are ASCII
// digits; a reply is plain content or the answer of a submit_answer call), with its own
// deterministic task generator.
"use strict";

const crypto = require("node:crypto");

const SPLIT_SIZES = { train: 512, test: 64 };
const NOUNS = ["apples", "birds", "cups", "doors", "eggs", "fish", "kites", "lamps", "maps", "pens"];
const TEMPLATES = [
  (n, noun) => `Reply with a number: ${n} ${noun}`,
  (n, noun) => `Reply with digits only: ${n} ${noun}`,
  (n, noun) => `Answer with a number. How many ${noun}? ${n}`,
  (n, noun) => `Count the ${noun} and reply in digits: ${n}`,
  (n, noun) => `Number only, please: ${n} ${noun}`,
];

// A reply every task scores 1 on: digits only.
const REFERENCE_REPLY = "0123456789";

const SUBMIT_ANSWER = {
  name: "submit_answer",
  description: "Submit your reply. This ends the episode.",
  parametersJsonSchema: JSON.stringify({
    type: "object",
    properties: { answer: { type: "string", description: "The reply, written with digits only." } },
    required: ["answer"],
  }),
};

// Task `index` of `split`: a fixed function of both (a string hash picks template, number, noun).
function taskPrompt(split, index) {
  let hash = 2166136261;
  for (const char of `digits/${split}/${index}`) {
    hash = Math.imul(hash ^ char.charCodeAt(0), 16777619) >>> 0;
  }
  const template = TEMPLATES[hash % TEMPLATES.length];
  return template((hash >>> 8) % 99 + 1, NOUNS[(hash >>> 16) % NOUNS.length]);
}

// reward = |{c in text : c in '0'..'9'}| / |text|, and 0 for an empty text.
function digitFraction(text) {
  if (!text) return 0;
  let digits = 0;
  for (const char of text) if (char >= "0" && char <= "9") digits += 1;
  return digits / [...text].length;
}

// Why a tool call cannot be applied, or null: the checks the Python server makes.
function callProblem(call) {
  if (call.name !== SUBMIT_ANSWER.name) {
    return `there is no tool ${JSON.stringify(call.name)}; the tools are ['submit_answer']`;
  }
  let args;
  try {
    args = call.arguments.trim() ? JSON.parse(call.arguments) : {};
  } catch (error) {
    return `the arguments of 'submit_answer' are not valid JSON (${error.message}): ${call.arguments}`;
  }
  if (args === null || typeof args !== "object" || Array.isArray(args)) {
    return `the arguments of 'submit_answer' must be a JSON object, got ${call.arguments}`;
  }
  const keys = Object.keys(args);
  if (keys.length !== 1 || keys[0] !== "answer") {
    return `'submit_answer' takes arguments ['answer'] (required: ['answer']); got ${JSON.stringify(keys)}`;
  }
  if (args.answer === null || typeof args.answer === "object") {
    return `argument 'answer' of 'submit_answer' must be a string, got ${JSON.stringify(args.answer)}`;
  }
  return null;
}

// The reply text of an assistant message: the first valid submit_answer answer if it calls
// tools (none: ""), else its content.
function replyText(message) {
  if (message.toolCalls && message.toolCalls.length) {
    const valid = message.toolCalls.filter((call) => callProblem(call) === null);
    return valid.length ? String(JSON.parse(valid[0].arguments).answer) : "";
  }
  return message.content || "";
}

const scored = (value) => `Reply scored: digit fraction ${value.toFixed(3)}.`;

// One episode: any reply ends it.
class DigitsEpisode {
  constructor(prompt) {
    this.prompt = prompt;
    this.done = false;
    this.reward = 0;
    this.stepCount = 0;
  }

  reset() {
    return { observations: [{ role: "ROLE_USER", content: this.prompt }], tools: [SUBMIT_ANSWER] };
  }

  // The action's observations and reward; the episode has ended afterwards.
  step(action) {
    const reward = digitFraction(replyText(action));
    this.done = true;
    this.reward = reward;
    this.stepCount += 1;
    let observations;
    if (action.toolCalls && action.toolCalls.length) {
      observations = action.toolCalls.map((call) => {
        const problem = callProblem(call);
        const answer = problem === null ? scored(digitFraction(String(JSON.parse(call.arguments).answer))) : "";
        return {
          role: "ROLE_TOOL",
          toolCallId: call.id,
          name: call.name,
          content: problem === null ? answer : `Invalid tool call: ${problem}`,
        };
      });
    } else {
      observations = [{ role: "ROLE_USER", content: scored(reward) }];
    }
    return { observations, reward, terminated: true, truncated: false };
  }
}

// The grade of a stored trajectory: its last assistant message's reply, as step() scores it.
function rescore(messages) {
  const replies = messages.filter((message) => message.role === "ROLE_ASSISTANT");
  if (!replies.length) return 0;
  const last = replies[replies.length - 1];
  const calls = (last.toolCalls || []).map((call) => {
    // Recorded calls are kept as recorded: arguments that are not an object count as none.
    try {
      const args = call.arguments.trim() ? JSON.parse(call.arguments) : {};
      return { ...call, arguments: JSON.stringify(args && typeof args === "object" && !Array.isArray(args) ? args : {}) };
    } catch {
      return { ...call, arguments: "{}" };
    }
  });
  return digitFraction(replyText({ ...last, toolCalls: calls }));
}

const DESCRIPTION =
  "One-step task: reply with digits. Reward = fraction of the reply's characters that are ASCII digits" +
  " (plain content, or the answer of a submit_answer call), in [0, 1].";

// Bumped when the same actions could lead to other observations / the same trajectory to
// another reward.
const PROVENANCE = { environment: "digits", environmentVersion: "digits/1+node", graderVersion: "digits/1+node" };

// A task's stable id: a digest of what defines it (its prompt), not its position.
function taskId(prompt) {
  const digest = crypto.createHash("sha256").update(JSON.stringify({ question: prompt })).digest("hex");
  return `digits:${digest.slice(0, 16)}`;
}

module.exports = {
  DESCRIPTION, DigitsEpisode, PROVENANCE, REFERENCE_REPLY, SPLIT_SIZES, SUBMIT_ANSWER, digitFraction, rescore, taskId,
  taskPrompt,
};
