#!/usr/bin/env node
// sciproto EnvironmentService in Node.js (@grpc/grpc-js), built from the contracts in proto/
// at run time, hosting the "digits" environment (digits.js). It implements Reset, Step, Verify
// (live episodes and stored trajectories, by task_ref or inline_task), Close, Session and
// Describe, with grpc.health.v1 and reflection, and passes `sciproto conformance env`:
//
//   node env_servers/node/server.js --port 50061 [--host 127.0.0.1] [--max-live-episodes 1024]
//                                   [--idle-ttl-s 600]
//
// It prints `SCIPROTO_READY env port=N` once it listens and drains on SIGTERM. No
// authentication: bind it to loopback or a trusted network.
"use strict";

const crypto = require("node:crypto");
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");
const descriptor = require("protobufjs/ext/descriptor");

const digits = require("./digits");
const { asSciproto, fail } = require("./errors");
const { IdempotencyCache } = require("./idempotency");

const PROTOCOL_VERSION = "1.3";
const SERVER_VERSION = "0.1.0";
const ENV_NAME = "digits";
const ENV_SERVICE = "sciproto.v1.EnvironmentService";
const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");
const LOADER = { keepCase: false, longs: String, enums: String, defaults: true, oneofs: true };
const CAPABILITIES = ["session", "session.cancel", "session.max_in_flight", "verify.episode", "verify.trajectory", "inline_tasks", "idempotent_requests", "reference"];
const MAX_MESSAGE_BYTES = 16 * 1024 * 1024;
// Operations here finish before the next frame is read, so a stream never has one running when
// another arrives: the limit is never reached, and a cancel never finds anything to stop.
const SESSION_MAX_IN_FLIGHT = 256;
const S = grpc.status;

const contract = protoLoader.loadSync("sciproto/v1/environment_service.proto", { ...LOADER, includeDirs: [PROTO_ROOT] });
const local = protoLoader.loadSync(
  [path.join(__dirname, "protos", "health.proto"), path.join(__dirname, "protos", "reflection.proto")], LOADER);
const sciproto = grpc.loadPackageDefinition(contract).sciproto.v1;
const standard = grpc.loadPackageDefinition(local).grpc;

function options(argv) {
  const settings = { host: "127.0.0.1", port: 50061, maxLiveEpisodes: 1024, idleTtlS: 600, retryAfterS: 1 };
  const names = { "--host": "host", "--port": "port", "--max-live-episodes": "maxLiveEpisodes", "--idle-ttl-s": "idleTtlS" };
  for (let i = 0; i < argv.length; i += 2) {
    const key = names[argv[i]];
    if (!key || argv[i + 1] === undefined) {
      console.error(`usage: server.js [--host H] [--port N] [--max-live-episodes N] [--idle-ttl-s S]; got ${argv[i]}`);
      process.exit(2);
    }
    settings[key] = key === "host" ? argv[i + 1] : Number(argv[i + 1]);
  }
  return settings;
}

// ------------------------------------------------------------------ episodes and operations

class Environments {
  constructor(settings) {
    this.settings = settings;
    this.episodes = new Map(); // episode id -> { episode, lastUsed }
    this.counters = { opened: 0, expired: 0, steps: 0, errors: 0 };
    this.idempotency = new IdempotencyCache(8192, settings.idleTtlS);
    this.expiry = setInterval(() => this.expire(), 1000).unref();
  }

  expire() {
    const cutoff = Date.now() - this.settings.idleTtlS * 1000;
    for (const [id, entry] of this.episodes) {
      if (entry.lastUsed < cutoff) {
        this.episodes.delete(id);
        this.counters.expired += 1;
      }
    }
  }

  get(id) {
    const entry = this.episodes.get(id);
    if (!entry) {
      throw fail(S.NOT_FOUND, "EPISODE_NOT_FOUND",
        `no open episode ${JSON.stringify(id)}: it was never opened here, was closed, or expired after ` +
        `${this.settings.idleTtlS} s idle; Reset a new one`, { metadata: { episode_id: id } });
    }
    entry.lastUsed = Date.now();
    return entry.episode;
  }

  checkTask(env, taskRef) {
    if (env !== ENV_NAME) {
      throw fail(S.NOT_FOUND, "UNKNOWN_ENVIRONMENT",
        `this server hosts no environment ${JSON.stringify(env)}; it hosts ['${ENV_NAME}']`,
        { metadata: { environments: ENV_NAME } });
    }
    if (taskRef === undefined) return;
    const size = digits.SPLIT_SIZES[taskRef.split];
    if (size === undefined) {
      const splits = Object.keys(digits.SPLIT_SIZES).sort();
      throw fail(S.NOT_FOUND, "UNKNOWN_SPLIT",
        `environment '${ENV_NAME}' has no split ${JSON.stringify(taskRef.split)}; its splits are ${splits}`,
        { metadata: { splits: splits.join(",") } });
    }
    if (taskRef.index >= size) {
      throw fail(S.INVALID_ARGUMENT, "TASK_OUT_OF_RANGE",
        `task index ${taskRef.index} is out of range: split '${taskRef.split}' has ${size} tasks (indices 0..${size - 1})`,
        { metadata: { split_size: String(size) } });
    }
  }

  // The prompt of the task a Reset or StoredTrajectory names.
  taskOf(holder, env, what) {
    if (holder.task === "taskRef") {
      this.checkTask(env, holder.taskRef);
      return digits.taskPrompt(holder.taskRef.split, holder.taskRef.index);
    }
    this.checkTask(env);
    if (holder.task === "inlineTask") {
      const fields = holder.inlineTask.fields || {};
      const unknown = Object.keys(fields).filter((name) => name !== "question");
      if (typeof fields.question !== "string" || unknown.length) {
        throw fail(S.INVALID_ARGUMENT, "INVALID_REQUEST",
          `inline task for '${ENV_NAME}': inline tasks take fields ['question']; got ${JSON.stringify(Object.keys(fields))}`);
      }
      return fields.question;
    }
    throw fail(S.INVALID_ARGUMENT, "INVALID_REQUEST", `${what} names no task: set task_ref {split, index} or inline_task`);
  }

  reset(request) {
    const prompt = this.taskOf(request, request.env, "ResetRequest");
    if (Object.keys(request.options || {}).length) {
      throw fail(S.INVALID_ARGUMENT, "INVALID_REQUEST", `environment '${ENV_NAME}' takes no per-episode options`);
    }
    if (this.episodes.size >= this.settings.maxLiveEpisodes) {
      throw fail(S.RESOURCE_EXHAUSTED, "TOO_MANY_EPISODES",
        `${this.settings.maxLiveEpisodes} episodes are open, the most this server holds; close finished episodes ` +
        `or retry after ${this.settings.retryAfterS} s`, { retryAfterS: this.settings.retryAfterS });
    }
    const episode = new digits.DigitsEpisode(prompt);
    const id = crypto.randomUUID();
    this.episodes.set(id, { episode, lastUsed: Date.now() });
    this.counters.opened += 1;
    const { observations, tools } = episode.reset();
    return { episodeId: id, observations, tools, taskSummary: { question: prompt }, taskId: digits.taskId(prompt) };
  }

  step(request) {
    const episode = this.get(request.episodeId);
    const action = request.action || {};
    if (action.role !== "ROLE_ASSISTANT") {
      throw fail(S.INVALID_ARGUMENT, "INVALID_ACTION",
        `action.role is ${action.role}; an action must be an assistant message (ROLE_ASSISTANT) with tool calls or content`);
    }
    const ids = (action.toolCalls || []).map((call) => call.id);
    if (ids.includes("") || new Set(ids).size !== ids.length) {
      throw fail(S.INVALID_ARGUMENT, "INVALID_ACTION",
        `action.tool_calls ids ${JSON.stringify(ids)} must be non-empty and distinct`);
    }
    if (episode.done) {
      throw fail(S.FAILED_PRECONDITION, "EPISODE_FINISHED",
        `episode ${request.episodeId} has terminated after ${episode.stepCount} steps; Reset a new episode`);
    }
    const outcome = episode.step(action);
    this.counters.steps += 1;
    return {
      observations: outcome.observations,
      reward: { value: outcome.reward, components: { digit_fraction: outcome.reward }, status: "REWARD_STATUS_SCORED", provenance: digits.PROVENANCE },
      terminated: outcome.terminated,
      truncated: outcome.truncated,
      stepCount: episode.stepCount,
    };
  }

  verify(request) {
    if (request.target === "episodeId") {
      const episode = this.get(request.episodeId);
      if (episode.done) {
        return { reward: { value: episode.reward, components: { digit_fraction: episode.reward }, status: "REWARD_STATUS_SCORED", provenance: digits.PROVENANCE } };
      }
      return { reward: { value: 0, status: "REWARD_STATUS_UNSCORED", detail: "the episode has not terminated yet (0 steps)", provenance: digits.PROVENANCE } };
    }
    if (request.target === "trajectory") {
      const trajectory = request.trajectory;
      this.taskOf(trajectory, trajectory.env, "StoredTrajectory");
      if (trajectory.messages.some((message) => message.role === "ROLE_UNSPECIFIED")) {
        throw fail(S.INVALID_ARGUMENT, "INVALID_REQUEST", "a trajectory message has role ROLE_UNSPECIFIED; set each message's role");
      }
      const value = digits.rescore(trajectory.messages);
      return { reward: { value, components: { digit_fraction: value }, status: "REWARD_STATUS_SCORED", provenance: digits.PROVENANCE } };
    }
    throw fail(S.INVALID_ARGUMENT, "INVALID_REQUEST", "VerifyRequest names nothing to grade: set episode_id or trajectory");
  }

  close(request) {
    return { closed: this.episodes.delete(request.episodeId) };
  }

  // The reference action of a task (protocol 1.3): a reply of digits only, which earns 1.
  reference(request) {
    if (!request.taskRef) {
      throw fail(S.INVALID_ARGUMENT, "INVALID_REQUEST", "ReferenceRequest names no task: set task_ref {split, index}");
    }
    this.checkTask(request.env, request.taskRef);
    return { actions: [{ role: "ROLE_ASSISTANT", content: digits.REFERENCE_REPLY }] };
  }

  describe() {
    return {
      server: {
        protocolVersion: PROTOCOL_VERSION, serverVersion: SERVER_VERSION, implementation: "sciproto-env-node",
        capabilities: CAPABILITIES,
        limits: { maxReceiveMessageBytes: MAX_MESSAGE_BYTES, maxSendMessageBytes: MAX_MESSAGE_BYTES },
      },
      environments: [{
        name: ENV_NAME, description: digits.DESCRIPTION, tools: [digits.SUBMIT_ANSWER], provenance: digits.PROVENANCE,
        rewardRange: { min: 0, max: 1, baseline: 0 },
        splits: Object.entries(digits.SPLIT_SIZES).map(([name, size]) => ({ name, size })),
      }],
      limits: {
        maxLiveEpisodes: this.settings.maxLiveEpisodes, idleTtlSeconds: this.settings.idleTtlS, stepTimeoutSeconds: 0,
        sessionMaxInFlight: SESSION_MAX_IN_FLIGHT,
      },
      counters: { liveEpisodes: this.episodes.size, episodesOpened: this.counters.opened,
        episodesExpired: this.counters.expired, steps: this.counters.steps, errors: this.counters.errors },
    };
  }

  // One operation by name, deduplicated by request_id where the contract says so.
  apply(operation, request) {
    try {
      if (operation === "reset") {
        const { requestId, traceContext, ...asked } = request; // eslint-disable-line no-unused-vars
        return this.idempotency.run("reset", request.requestId, JSON.stringify(asked), () => this.reset(request));
      }
      if (operation === "step") {
        const fingerprint = JSON.stringify([request.episodeId, request.action]);
        return this.idempotency.run("step", request.requestId, fingerprint, () => this.step(request));
      }
      return this[operation](request);
    } catch (error) {
      this.counters.errors += 1;
      throw error;
    }
  }
}

// ------------------------------------------------------------------ RPC handlers

function unary(environments, operation) {
  return (call, callback) => {
    try {
      callback(null, environments.apply(operation, call.request));
    } catch (error) {
      callback(asSciproto(error).toServiceError());
    }
  };
}

// Many operations on one stream, answered by request_id; every episode opened here and not
// closed is closed when the stream ends, however it ends.
function session(environments) {
  return (call) => {
    const opened = new Set();
    let ended = false;
    const cleanup = () => {
      for (const id of opened) environments.episodes.delete(id);
      opened.clear();
    };
    call.on("data", (request) => {
      const operation = request.operation;
      const body = operation ? request[operation] : {};
      const answer = { requestId: body.requestId || "", episodeId: body.episodeId || "" };
      try {
        if (!operation) {
          throw fail(S.INVALID_ARGUMENT, "INVALID_REQUEST", "SessionRequest carries no operation: set reset, step, verify or close");
        }
        if (operation === "cancel") {
          if (!ended) call.write({ requestId: body.requestId, cancel: { cancelled: false } });
          return;
        }
        const result = environments.apply(operation, body);
        if (operation === "reset") {
          opened.add(result.episodeId);
          answer.episodeId = result.episodeId;
        } else if (operation === "close") {
          opened.delete(body.episodeId);
        }
        answer[operation] = result;
      } catch (error) {
        answer.error = asSciproto(error).toInBand();
      }
      if (!ended) call.write(answer);
    });
    call.on("end", () => {
      ended = true;
      cleanup();
      call.end();
    });
    call.on("cancelled", () => {
      ended = true;
      cleanup();
    });
    call.on("error", () => {
      ended = true;
      cleanup();
    });
  };
}

function health(state) {
  const known = new Set(["", ENV_SERVICE]);
  const statusOf = (service) => (known.has(service) ? state.status : null);
  return {
    Check(call, callback) {
      const status = statusOf(call.request.service);
      if (status === null) {
        callback({ code: S.NOT_FOUND, details: `unknown service ${JSON.stringify(call.request.service)}` });
      } else {
        callback(null, { status });
      }
    },
    Watch(call) {
      call.write({ status: statusOf(call.request.service) || "SERVICE_UNKNOWN" });
      state.watchers.add(call);
      call.on("cancelled", () => state.watchers.delete(call));
    },
  };
}

// The contract as FileDescriptorProtos for reflection, one per proto package (protobufjs
// merges a package's files into one), each listing the files whose types it uses, so that
// clients that resolve dependencies by file name (grpcurl, descriptor pools) can build it.
function contractDescriptors() {
  const root = new protobuf.Root();
  root.resolvePath = (origin, target) =>
    target.startsWith("google/protobuf/") ? target : path.join(PROTO_ROOT, target);
  root.loadSync(["sciproto/v1/environment_service.proto"], { keepCase: true });
  const files = root.toDescriptor("proto3").file;
  const typeNames = (file) => {
    const names = [];
    const visit = (message) => {
      for (const field of message.field || []) if (field.typeName) names.push(field.typeName.replace(/^\./, ""));
      for (const nested of message.nestedType || []) visit(nested);
    };
    for (const message of file.messageType || []) visit(message);
    for (const service of file.service || []) {
      for (const method of service.method || []) names.push(method.inputType.replace(/^\./, ""), method.outputType.replace(/^\./, ""));
    }
    return names;
  };
  // A relative type name may resolve in the file's package or any package enclosing it.
  const candidates = (file, name) => {
    const scopes = file.package.split(".").map((_, i, parts) => parts.slice(0, parts.length - i).join("."));
    return [...scopes.map((scope) => `${scope}.${name}`), name];
  };
  for (const file of files) {
    const used = typeNames(file).flatMap((name) => candidates(file, name));
    file.dependency = files
      .filter((other) => other !== file && used.some((name) => name.startsWith(`${other.package}.`)))
      .map((other) => other.name);
  }
  return new Map(files.map((file) => [file.name, Buffer.from(descriptor.FileDescriptorProto.encode(file).finish())]));
}

function reflection(services) {
  const files = contractDescriptors();
  return {
    ServerReflectionInfo(call) {
      call.on("data", (request) => {
        const answer = { validHost: request.host, originalRequest: request };
        const kind = request.messageRequest;
        if (kind === "listServices") {
          answer.listServicesResponse = { service: services.map((name) => ({ name })) };
        } else if ((kind === "fileContainingSymbol" && request.fileContainingSymbol.startsWith("sciproto.v1.")) ||
                   (kind === "fileByFilename" && files.has(request.fileByFilename))) {
          // Every file of the contract: the asked one and everything it uses.
          answer.fileDescriptorResponse = { fileDescriptorProto: [...files.values()] };
        } else {
          answer.errorResponse = { errorCode: S.NOT_FOUND, errorMessage: `not found: ${request[kind]}` };
        }
        call.write(answer);
      });
      call.on("end", () => call.end());
    },
  };
}

function main() {
  const settings = options(process.argv.slice(2));
  const environments = new Environments(settings);
  const server = new grpc.Server({
    "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
  });
  server.addService(sciproto.EnvironmentService.service, {
    Describe: unary(environments, "describe"),
    Reset: unary(environments, "reset"),
    Step: unary(environments, "step"),
    Verify: unary(environments, "verify"),
    Close: unary(environments, "close"),
    Reference: unary(environments, "reference"),
    Session: session(environments),
  });
  const state = { status: "SERVING", watchers: new Set() };
  server.addService(standard.health.v1.Health.service, health(state));
  server.addService(standard.reflection.v1alpha.ServerReflection.service,
    reflection([ENV_SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]));

  server.bindAsync(`${settings.host}:${settings.port}`, grpc.ServerCredentials.createInsecure(), (error, port) => {
    if (error) {
      console.error(`cannot listen on ${settings.host}:${settings.port}: ${error.message}`);
      process.exit(1);
    }
    console.log(`hosting ${ENV_NAME} on ${settings.host}:${port}`);
    console.log(`SCIPROTO_READY env port=${port}`);
  });

  const drain = () => {
    state.status = "NOT_SERVING";
    for (const watcher of state.watchers) watcher.write({ status: "NOT_SERVING" });
    const force = setTimeout(() => server.forceShutdown(), 5000).unref();
    server.tryShutdown(() => {
      clearTimeout(force);
      process.exit(0);
    });
  };
  process.on("SIGTERM", drain);
  process.on("SIGINT", drain);
}

main();
