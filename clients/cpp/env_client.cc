#include "env_client.h"

#include <array>
#include <random>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

namespace sciproto {

namespace {

// Indexed by grpc::StatusCode (0..16), as named in grpc/status.h.
constexpr std::array<const char*, 17> kStatusCodeNames = {
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
    "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};

// Random hex digits from the OS's entropy source.
std::string RandomHex(std::size_t digits) {
  static thread_local std::random_device entropy;
  static constexpr char kHex[] = "0123456789abcdef";
  std::uniform_int_distribution<int> digit(0, 15);
  std::string text(digits, '0');
  for (char& c : text) c = kHex[digit(entropy)];
  return text;
}

// The JSON object {"key": "value", ...} with the string escaping of the proto3 JSON mapping.
std::string JsonObjectOfStrings(const ToolArguments& arguments) {
  google::protobuf::Struct object;
  for (const auto& [key, value] : arguments) (*object.mutable_fields())[key].set_string_value(value);
  std::string json;
  const auto status = google::protobuf::util::MessageToJsonString(object, &json);
  if (!status.ok()) {
    throw std::runtime_error("tool arguments are not JSON-encodable: " + status.ToString());
  }
  return json;
}

}  // namespace

std::string StatusCodeName(grpc::StatusCode code) {
  const auto index = static_cast<std::size_t>(code);
  return index < kStatusCodeNames.size() ? kStatusCodeNames[index] : "CODE_" + std::to_string(index);
}

RpcError::RpcError(const std::string& method, const grpc::Status& status)
    : std::runtime_error(method + " failed: " + StatusCodeName(status.error_code()) + ": " +
                         status.error_message()),
      code_(status.error_code()) {}

std::string NewRequestId() {
  // UUID v4 layout: version nibble 4, variant bits 10xx.
  std::string id = RandomHex(32);
  id[12] = '4';
  id[16] = "89ab"[std::stoi(id.substr(16, 1), nullptr, 16) & 3];
  return id.substr(0, 8) + "-" + id.substr(8, 4) + "-" + id.substr(12, 4) + "-" + id.substr(16, 4) + "-" +
         id.substr(20);
}

v1::ChatMessage ToolCallsAction(const std::vector<std::pair<std::string, ToolArguments>>& calls,
                                const std::string& content) {
  v1::ChatMessage action;
  action.set_role(v1::ROLE_ASSISTANT);
  action.set_content(content);
  for (const auto& [name, arguments] : calls) {
    v1::ToolCall* call = action.add_tool_calls();
    call->set_id("call_" + RandomHex(12));
    call->set_name(name);
    call->set_arguments(JsonObjectOfStrings(arguments));
  }
  return action;
}

v1::InlineTask InlineTask(const std::map<std::string, std::string>& fields) {
  v1::InlineTask task;
  task.mutable_fields()->insert(fields.begin(), fields.end());
  return task;
}

void RequireCompatibleProtocol(const v1::ServerInfo& server) {
  const std::string& version = server.protocol_version();
  if (version.substr(0, version.find('.')) != kProtocolMajor) {
    throw std::runtime_error("the server speaks sciproto protocol " + version + "; this client speaks " +
                             kProtocolMajor + ".x: use a client and server of the same MAJOR");
  }
}

EnvClient::EnvClient(const std::string& target, std::chrono::milliseconds deadline)
    : stub_(v1::EnvironmentService::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))),
      deadline_(deadline) {}

template <typename Request, typename Response>
Response EnvClient::Call(const char* method, Rpc<Request, Response> rpc, Request request) {
  request.set_request_id(NewRequestId());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline_);
  Response response;
  const grpc::Status status = ((*stub_).*rpc)(&context, request, &response);
  if (!status.ok()) throw RpcError(method, status);
  return response;
}

v1::EnvironmentServiceDescribeResponse EnvClient::Describe() {
  return Call("Describe", &v1::EnvironmentService::Stub::Describe, v1::EnvironmentServiceDescribeRequest());
}

v1::ResetResponse EnvClient::Reset(const std::string& env, const v1::InlineTask& task) {
  v1::ResetRequest request;
  request.set_env(env);
  *request.mutable_inline_task() = task;
  return Call("Reset", &v1::EnvironmentService::Stub::Reset, std::move(request));
}

v1::ResetResponse EnvClient::Reset(const std::string& env, const v1::TaskRef& task) {
  v1::ResetRequest request;
  request.set_env(env);
  *request.mutable_task_ref() = task;
  return Call("Reset", &v1::EnvironmentService::Stub::Reset, std::move(request));
}

v1::StepResponse EnvClient::Step(const std::string& episode_id, const v1::ChatMessage& action) {
  v1::StepRequest request;
  request.set_episode_id(episode_id);
  *request.mutable_action() = action;
  return Call("Step", &v1::EnvironmentService::Stub::Step, std::move(request));
}

v1::VerifyResponse EnvClient::Verify(const std::string& episode_id) {
  v1::VerifyRequest request;
  request.set_episode_id(episode_id);
  return Call("Verify", &v1::EnvironmentService::Stub::Verify, std::move(request));
}

v1::CloseResponse EnvClient::Close(const std::string& episode_id) {
  v1::CloseRequest request;
  request.set_episode_id(episode_id);
  return Call("Close", &v1::EnvironmentService::Stub::Close, std::move(request));
}

}  // namespace sciproto
