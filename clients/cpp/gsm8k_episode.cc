// Runs one GSM8K episode against an env server and prints it as JSON:
//   clients/cpp/build/gsm8k_episode HOST:PORT
// The task is inline (the question and its answer are ours), the agent asks the
// calculator, then submits the calculator's result; a last Describe shows the
// episode is gone. Exits 0 only if the reward is 1, 1 on any failure, 2 on bad usage.
#include <chrono>
#include <iostream>
#include <string>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "env_client.h"

namespace {

namespace v1 = sciproto::v1;
using google::protobuf::Struct;

const char* const kQuestion = "A baker makes 17 trays of 24 rolls. How many rolls is that?";
const char* const kAnswer = "408";
constexpr std::chrono::seconds kCallDeadline(30);

void Put(Struct& object, const std::string& key, const std::string& value) {
  (*object.mutable_fields())[key].set_string_value(value);
}

void Put(Struct& object, const std::string& key, double value) {
  (*object.mutable_fields())[key].set_number_value(value);
}

void Put(Struct& object, const std::string& key, bool value) {
  (*object.mutable_fields())[key].set_bool_value(value);
}

bool HostsGsm8k(const v1::EnvironmentServiceDescribeResponse& described) {
  for (const auto& env : described.environments()) {
    if (env.name() == "gsm8k") return true;
  }
  return false;
}

// The whole episode as a JSON object; throws on any failed call.
Struct RunEpisode(sciproto::EnvClient& client) {
  const auto described = client.Describe();
  sciproto::RequireCompatibleProtocol(described.server());
  if (!HostsGsm8k(described)) throw std::runtime_error("the server does not host gsm8k");

  const auto task = sciproto::InlineTask({{"question", kQuestion}, {"answer", kAnswer}});
  const auto reset = client.Reset("gsm8k", task);
  const auto calculation =
      client.Step(reset.episode_id(), sciproto::ToolCallsAction({{"calculator", {{"expr", "17 * 24"}}}}));
  if (calculation.observations_size() == 0) {
    throw std::runtime_error("the calculator step returned no observation");
  }
  const std::string result = calculation.observations(0).content();
  const auto submission =
      client.Step(reset.episode_id(), sciproto::ToolCallsAction({{"submit_answer", {{"answer", result}}}}));
  const auto verified = client.Verify(reset.episode_id());
  const auto closed = client.Close(reset.episode_id());
  const auto after = client.Describe();

  Struct episode;
  Put(episode, "protocol_version", described.server().protocol_version());
  Put(episode, "episode_id", reset.episode_id());
  auto* tools = (*episode.mutable_fields())["tools"].mutable_list_value();
  for (const auto& tool : reset.tools()) tools->add_values()->set_string_value(tool.name());
  Put(episode, "calculator_result", result);
  Put(episode, "step_reward", submission.reward().value());
  Put(episode, "terminated", submission.terminated());
  Put(episode, "reward", verified.reward().value());
  Put(episode, "reward_status", v1::RewardStatus_Name(verified.reward().status()));
  Put(episode, "step_count", static_cast<double>(submission.step_count()));
  Put(episode, "closed", closed.closed());
  Put(episode, "live_episodes_before", static_cast<double>(described.counters().live_episodes()));
  Put(episode, "live_episodes_after", static_cast<double>(after.counters().live_episodes()));
  return episode;
}

bool Rewarded(const Struct& episode) {
  const auto& fields = episode.fields();
  return fields.at("reward").number_value() == 1.0 &&
         fields.at("reward_status").string_value() == v1::RewardStatus_Name(v1::REWARD_STATUS_SCORED);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " HOST:PORT" << std::endl;
    return 2;
  }
  try {
    sciproto::EnvClient client(argv[1], kCallDeadline);
    const Struct episode = RunEpisode(client);
    std::string json;
    const auto status = google::protobuf::util::MessageToJsonString(episode, &json);
    if (!status.ok()) {
      throw std::runtime_error("could not encode the episode as JSON: " + status.ToString());
    }
    std::cout << json << std::endl;
    return Rewarded(episode) ? 0 : 1;
  } catch (const std::exception& error) {
    std::cerr << error.what() << std::endl;
    return 1;
  }
}
