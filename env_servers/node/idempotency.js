// Answers for retried requests: an operation with a request_id runs once; a retry with the
// same id gets the first result. Only successes are kept (a failure may be retried); an entry
// unused for `ttlS` is dropped, and at most `size` are kept (least recently used first out).
// Operations here are synchronous, so a retry can never race its first attempt.
"use strict";

const grpc = require("@grpc/grpc-js");
const { fail } = require("./errors");

class IdempotencyCache {
  constructor(size, ttlS) {
    this.size = size;
    this.ttlS = ttlS;
    this.entries = new Map(); // "operation request_id" -> { fingerprint, result, lastUsed }
  }

  run(operation, requestId, fingerprint, compute) {
    if (!requestId) return compute();
    const key = `${operation} ${requestId}`;
    const now = Date.now();
    const entry = this.entries.get(key);
    if (entry && now - entry.lastUsed <= this.ttlS * 1000) {
      if (entry.fingerprint !== fingerprint) {
        throw fail(grpc.status.INVALID_ARGUMENT, "DUPLICATE_REQUEST",
          `request_id ${JSON.stringify(requestId)} was already used for a different ${operation}; give every ` +
          "new request a new id (a uuid) and reuse an id only to retry");
      }
      this.entries.delete(key); // re-inserted below: most recently used last
      entry.lastUsed = now;
      this.entries.set(key, entry);
      return entry.result;
    }
    const result = compute();
    this.entries.set(key, { fingerprint, result, lastUsed: now });
    while (this.entries.size > this.size) this.entries.delete(this.entries.keys().next().value);
    return result;
  }
}

module.exports = { IdempotencyCache };
