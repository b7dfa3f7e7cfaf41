// sciproto's error model in grpc-js: a status code, a message saying what to fix, and a
// google.rpc.Status in the grpc-status-details-bin trailer carrying ErrorInfo (domain
// "sciproto", a stable reason) and, when worth retrying later, RetryInfo.
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protobuf = require("protobufjs");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");
const root = new protobuf.Root();
root.resolvePath = (origin, target) =>
  target.startsWith("google/protobuf/") ? target : path.join(PROTO_ROOT, target);
root.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"], { keepCase: true });
const Status = root.lookupType("google.rpc.Status");
const ErrorInfo = root.lookupType("google.rpc.ErrorInfo");
const RetryInfo = root.lookupType("google.rpc.RetryInfo");

class SciprotoError extends Error {
  // code: a grpc.status value; reason: the ErrorInfo reason; retryAfterS: RetryInfo delay.
  constructor(code, reason, message, { metadata = {}, retryAfterS = null } = {}) {
    super(message);
    this.code = code;
    this.reason = reason;
    this.metadata = metadata;
    this.retryAfterS = retryAfterS;
  }

  // The details as google.protobuf.Any objects: [{ type_url, value }].
  details() {
    const details = [{
      type_url: "type.googleapis.com/google.rpc.ErrorInfo",
      value: ErrorInfo.encode(ErrorInfo.create({ reason: this.reason, domain: "sciproto", metadata: this.metadata })).finish(),
    }];
    if (this.retryAfterS !== null) {
      const seconds = Math.floor(this.retryAfterS);
      const retry = RetryInfo.create({ retry_delay: { seconds, nanos: Math.round((this.retryAfterS - seconds) * 1e9) } });
      details.push({ type_url: "type.googleapis.com/google.rpc.RetryInfo", value: RetryInfo.encode(retry).finish() });
    }
    return details;
  }

  // What a unary handler passes to its callback.
  toServiceError() {
    const metadata = new grpc.Metadata();
    const status = Status.create({ code: this.code, message: this.message, details: this.details() });
    metadata.set("grpc-status-details-bin", Buffer.from(Status.encode(status).finish()));
    return { code: this.code, details: this.message, metadata };
  }

  // SessionResponse.error, in the shape @grpc/proto-loader encodes (camelCase fields, except
  // google.protobuf.Any's, which protobufjs keeps as type_url and value).
  toInBand() {
    return {
      code: this.code,
      message: this.message,
      details: this.details().map((any) => ({ type_url: any.type_url, value: Buffer.from(any.value) })),
    };
  }
}

const fail = (code, reason, message, options) => new SciprotoError(code, reason, message, options);

// Any exception as a SciprotoError: a bug becomes INTERNAL naming the exception.
function asSciproto(error) {
  if (error instanceof SciprotoError) return error;
  return fail(grpc.status.INTERNAL, "INTERNAL", `internal error: ${error && error.stack ? error.stack.split("\n")[0] : error}`);
}

module.exports = { SciprotoError, asSciproto, fail };
