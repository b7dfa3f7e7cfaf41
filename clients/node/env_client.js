// Node.js client of sciproto's EnvironmentService, built at run time from the
// contracts in proto/ (no generated code to keep in sync).
//
//   const { EnvClient, toolCallsAction } = require("./env_client");
//   const env = new EnvClient("127.0.0.1:50051");
//   const reset = await env.reset({ env: "gsm8k", inlineTask: { fields: { question, answer } } });
//   const step = await env.step(reset.episodeId, toolCallsAction([["calculator", { expr: "6*7" }]]));
"use strict";

const crypto = require("node:crypto");
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");

// Field names in camelCase, enums as their names, 64-bit ints as strings,
// unset scalars filled with defaults: the shape the proto3 JSON mapping uses.
const definition = protoLoader.loadSync("sciproto/v1/environment_service.proto", {
  includeDirs: [PROTO_ROOT],
  keepCase: false,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});
const sciproto = grpc.loadPackageDefinition(definition).sciproto.v1;

// An assistant action calling tools: [[name, argumentsObject], ...].
function toolCallsAction(calls, content = "") {
  return {
    role: "ROLE_ASSISTANT",
    content,
    toolCalls: calls.map(([name, args]) => ({
      id: `call_${crypto.randomUUID().slice(0, 12)}`,
      name,
      arguments: JSON.stringify(args),
    })),
  };
}

class EnvClient {
  // target: "HOST:PORT"; deadlineMs: deadline of every call.
  constructor(target, { deadlineMs = 60000 } = {}) {
    this.stub = new sciproto.EnvironmentService(target, grpc.credentials.createInsecure());
    this.deadlineMs = deadlineMs;
  }

  // Every request carries a fresh request_id, so a retry never applies it twice.
  call(method, request) {
    const deadline = new Date(Date.now() + this.deadlineMs);
    return new Promise((resolve, reject) => {
      this.stub[method]({ requestId: crypto.randomUUID(), ...request }, { deadline }, (error, response) => {
        if (error) {
          const reason = new Error(`${method} failed: ${grpc.status[error.code]}: ${error.details}`);
          reason.code = error.code;
          reject(reason);
        } else {
          resolve(response);
        }
      });
    });
  }

  describe() {
    return this.call("Describe", {});
  }

  // task: { taskRef: { split, index } } or { inlineTask: { fields } }
  reset(env, task) {
    return this.call("Reset", { env, ...task });
  }

  step(episodeId, action) {
    return this.call("Step", { episodeId, action });
  }

  verify(episodeId) {
    return this.call("Verify", { episodeId });
  }

  close(episodeId) {
    return this.call("Close", { episodeId });
  }

  shutdown() {
    // The stub's own close() is the Close RPC; close the channel with the base method.
    grpc.Client.prototype.close.call(this.stub);
  }
}

module.exports = { EnvClient, toolCallsAction };
