// C++ client of sciproto's EnvironmentService, on stubs generated from proto/
// at build time (see CMakeLists.txt).
//
//   sciproto::EnvClient env("127.0.0.1:50051", std::chrono::seconds(30));
//   auto reset = env.Reset("gsm8k", sciproto::InlineTask({{"question", q}, {"answer", "408"}}));
//   auto step = env.Step(reset.episode_id(),
//                        sciproto::ToolCallsAction({{"calculator", {{"expr", "17 * 24"}}}}));
//
// Every call carries a fresh request_id (so a retried call is never applied
// twice) and a deadline; a failed call throws RpcError.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "sciproto/v1/environment_service.grpc.pb.h"

namespace sciproto {

namespace v1 = ::sciproto::v1;

// The MAJOR of the protocol this client speaks; a server of another MAJOR is refused.
inline constexpr const char* kProtocolMajor = "1";

// A call that ended in a non-OK status: "<Method> failed: <CODE>: <details>".
class RpcError : public std::runtime_error {
 public:
  RpcError(const std::string& method, const grpc::Status& status);
  grpc::StatusCode code() const { return code_; }

 private:
  grpc::StatusCode code_;
};

// The canonical name of a status code, e.g. "UNAVAILABLE".
std::string StatusCodeName(grpc::StatusCode code);

// Text arguments of one tool call, encoded as a JSON object of strings.
using ToolArguments = std::map<std::string, std::string>;

// An assistant action calling tools, in order: {{name, arguments}, ...}.
v1::ChatMessage ToolCallsAction(const std::vector<std::pair<std::string, ToolArguments>>& calls,
                                const std::string& content = "");

// An inline task from its fields (e.g. "question", "answer").
v1::InlineTask InlineTask(const std::map<std::string, std::string>& fields);

// A fresh random id (UUID v4 text) for request_id.
std::string NewRequestId();

// Throws std::runtime_error if the server speaks another protocol MAJOR.
void RequireCompatibleProtocol(const v1::ServerInfo& server);

class EnvClient {
 public:
  // target: "HOST:PORT" (plaintext); deadline: the deadline of every call.
  EnvClient(const std::string& target, std::chrono::milliseconds deadline);

  v1::EnvironmentServiceDescribeResponse Describe();
  v1::ResetResponse Reset(const std::string& env, const v1::InlineTask& task);
  v1::ResetResponse Reset(const std::string& env, const v1::TaskRef& task);
  v1::StepResponse Step(const std::string& episode_id, const v1::ChatMessage& action);
  v1::VerifyResponse Verify(const std::string& episode_id);
  v1::CloseResponse Close(const std::string& episode_id);

 private:
  template <typename Request, typename Response>
  using Rpc = grpc::Status (v1::EnvironmentService::Stub::*)(grpc::ClientContext*, const Request&,
                                                             Response*);

  // Stamps a fresh request_id on `request`, calls `rpc` with the deadline, and
  // throws RpcError naming `method` on failure.
  template <typename Request, typename Response>
  Response Call(const char* method, Rpc<Request, Response> rpc, Request request);

  std::unique_ptr<v1::EnvironmentService::Stub> stub_;
  std::chrono::milliseconds deadline_;
};

}  // namespace sciproto
