// A native gRPC load generator for bench/env_step.py: GSM8K episodes (reset, calculator step,
// submit step, close) against an env server, from C++ so that the client's own CPU and thread
// hops stay small beside the server's. Python's grpc.aio client spends 0.5-0.7 ms of CPU per
// step; on a machine whose cores the client shares with the server, that client is what a
// latency or scaling figure would measure.
//
//   env_load MODE TARGET[,TARGET...] [--split test] [--tasks 50] [--expr "12 * 34 + 5"] [--answer 413]
//
// MODE:
//   session       every episode on one Session stream per target (episode i on target i % targets)
//   unary         Reset, Step, Step, Close as unary calls
//   session_echo  two Step messages per episode, no Reset or Close (for the bench's echo server)
//
// Commands on stdin, one answer line of JSON on stdout each:
//   run CONCURRENCY SECONDS EPISODES   CONCURRENCY loops of whole episodes; a loop starts no
//                                      episode after SECONDS, nor more than EPISODES (0: no cap)
//      -> {"episodes": N, "elapsed_s": T, "cpu_s": C, "latencies_ns": [...]}  (the env steps)
//      -> {"error": "..."}                                                  (any failed operation)
//   quit
// Episode loop w runs problems w, w + CONCURRENCY, ... (mod --tasks), as the bench's Python loops.
// Every call and every wait has a deadline; exits 1 on a broken stream, 2 on bad usage.
#include <sys/resource.h>

#include <atomic>
#include <cstdlib>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "env_client.h"

namespace {

namespace v1 = sciproto::v1;
using Clock = std::chrono::steady_clock;

constexpr std::chrono::seconds kCallDeadline(60);
constexpr std::chrono::seconds kRunDeadline(600);

struct Options {
  std::string mode;
  std::vector<std::string> targets;
  std::string split = "test";
  unsigned tasks = 50;
  std::string expr = "12 * 34 + 5";
  std::string answer = "413";
};

double CpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// Request ids unique across this process and any other client of the server.
class RequestIds {
 public:
  RequestIds() : prefix_(sciproto::NewRequestId().substr(0, 8) + "-") {}
  std::string Next() { return prefix_ + std::to_string(counter_.fetch_add(1)); }

 private:
  std::string prefix_;
  std::atomic<unsigned long> counter_{0};
};

// ------------------------------------------------------------------ one run of episode loops

// What one `run` command records. Loops end by calling Finish; the runner waits for all.
class Run {
 public:
  Run(unsigned loops, double seconds, unsigned episodes_per_loop)
      : stop_at_(Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds))),
        episodes_per_loop_(episodes_per_loop), running_(loops), latencies_(loops), episodes_(loops, 0) {}

  // Whether loop `loop` starts another episode.
  bool Continues(unsigned loop) const {
    if (failed_.load()) return false;
    if (episodes_per_loop_ != 0 && episodes_[loop] >= episodes_per_loop_) return false;
    return episodes_per_loop_ != 0 || Clock::now() < stop_at_;
  }

  void Step(unsigned loop, Clock::time_point started) {
    latencies_[loop].push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - started).count());
  }
  void Episode(unsigned loop) { ++episodes_[loop]; }

  void Fail(const std::string& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_.empty()) error_ = error;
    failed_.store(true);
  }

  void Finish() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--running_ == 0) finished_.notify_all();
  }

  // Waits for every loop; false if they are not done within kRunDeadline.
  bool Wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    return finished_.wait_for(lock, kRunDeadline, [this] { return running_ == 0; });
  }

  std::string Json(double elapsed_s, double cpu_s) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::ostringstream out;
    if (!error_.empty()) {
      std::string escaped;
      for (char c : error_) {
        if (c == '"' || c == '\\') escaped += '\\';
        escaped += (c == '\n' ? ' ' : c);
      }
      out << "{\"error\": \"" << escaped << "\"}";
      return out.str();
    }
    unsigned long episodes = 0;
    for (unsigned long n : episodes_) episodes += n;
    out << "{\"episodes\": " << episodes << ", \"elapsed_s\": " << elapsed_s << ", \"cpu_s\": " << cpu_s
        << ", \"latencies_ns\": [";
    bool first = true;
    for (const auto& loop : latencies_) {
      for (long long ns : loop) {
        out << (first ? "" : ",") << ns;
        first = false;
      }
    }
    out << "]}";
    return out.str();
  }

 private:
  const Clock::time_point stop_at_;
  const unsigned episodes_per_loop_;
  std::mutex mutex_;
  std::condition_variable finished_;
  unsigned running_;
  std::string error_;
  std::atomic<bool> failed_{false};
  // Each loop has one operation in flight at a time, so its slots are touched by one callback
  // at a time; the runner reads them after Wait(), whose mutex orders the accesses.
  std::vector<std::vector<long long>> latencies_;
  std::vector<unsigned long> episodes_;
};

// ------------------------------------------------------------------ Session streams

// One Session stream: requests written in order, one write in flight at a time (as gRPC
// allows); each answer is handed to the callback of its request_id.
class Stream : public grpc::ClientBidiReactor<v1::SessionRequest, v1::SessionResponse> {
 public:
  using Callback = std::function<void(const v1::SessionResponse&)>;

  explicit Stream(v1::EnvironmentService::Stub* stub) {
    stub->async()->Session(&context_, this);
    StartRead(&answer_);
    StartCall();
  }

  void Send(v1::SessionRequest request, const std::string& request_id, Callback callback) {
    v1::SessionRequest* first = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      waiting_.emplace(request_id, std::move(callback));
      queue_.push_back(std::move(request));  // deque: the message in flight keeps its address
      if (!writing_) {
        writing_ = true;
        first = &queue_.front();
      }
    }
    if (first != nullptr) StartWrite(first);  // never under our lock: a reaction may run inline
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the stream is broken; OnDone reports it
    v1::SessionRequest* next = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.pop_front();
      if (queue_.empty()) {
        writing_ = false;
      } else {
        next = &queue_.front();
      }
    }
    if (next != nullptr) StartWrite(next);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (answer_.result_case() != v1::SessionResponse::kHeartbeat) {
      Callback callback;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto found = waiting_.find(answer_.request_id());
        if (found != waiting_.end()) {
          callback = std::move(found->second);
          waiting_.erase(found);
        }
      }
      if (callback) {
        callback(answer_);
      } else {
        std::cerr << "env_load: an answer to no request: " << answer_.request_id() << std::endl;
      }
    }
    StartRead(&answer_);
  }

  // The stream ended: every request still waiting is answered with its status as an error.
  void OnDone(const grpc::Status& status) override {
    std::unordered_map<std::string, Callback> orphans;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      status_ = status;
      done_ = true;
      orphans.swap(waiting_);
      ended_.notify_all();
    }
    v1::SessionResponse ended;
    ended.mutable_error()->set_code(status.ok() ? static_cast<int>(grpc::StatusCode::ABORTED) : status.error_code());
    ended.mutable_error()->set_message("the Session stream ended: " + status.error_message());
    for (auto& [id, callback] : orphans) callback(ended);
  }

  // Half-closes and waits for the server to end the stream; its status.
  grpc::Status Close() {
    StartWritesDone();
    std::unique_lock<std::mutex> lock(mutex_);
    if (!ended_.wait_for(lock, std::chrono::seconds(30), [this] { return done_; })) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "the Session stream did not end within 30 s");
    }
    return status_;
  }

  bool Ended() {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }

 private:
  grpc::ClientContext context_;
  v1::SessionResponse answer_;
  std::mutex mutex_;
  std::condition_variable ended_;
  std::deque<v1::SessionRequest> queue_;
  bool writing_ = false;
  std::unordered_map<std::string, Callback> waiting_;
  bool done_ = false;
  grpc::Status status_;
};

// ------------------------------------------------------------------ the episodes

class Load {
 public:
  explicit Load(Options options) : options_(std::move(options)) {
    calculate_ = sciproto::ToolCallsAction({{"calculator", {{"expr", options_.expr}}}});
    submit_ = sciproto::ToolCallsAction({{"submit_answer", {{"answer", options_.answer}}}});
    for (const auto& target : options_.targets) {
      stubs_.push_back(v1::EnvironmentService::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials())));
    }
    if (options_.mode != "unary") {
      for (auto& stub : stubs_) streams_.push_back(std::make_unique<Stream>(stub.get()));
    }
  }

  std::string RunCommand(unsigned concurrency, double seconds, unsigned episodes_per_loop) {
    for (auto& stream : streams_) {
      if (stream->Ended()) return "{\"error\": \"a Session stream ended; restart the load generator\"}";
    }
    Run run(concurrency, seconds, episodes_per_loop);
    const double cpu_before = CpuSeconds();
    const auto started = Clock::now();
    for (unsigned loop = 0; loop < concurrency; ++loop) NextEpisode(run, loop, concurrency, loop);
    if (!run.Wait()) {  // callbacks still hold `run`: end the process rather than free it under them
      std::cout << "{\"error\": \"the episode loops did not finish within 600 s\"}" << std::endl;
      std::exit(1);
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
    return run.Json(elapsed, CpuSeconds() - cpu_before);
  }

  void Close() {
    for (auto& stream : streams_) {
      const auto status = stream->Close();
      if (!status.ok()) std::cerr << "env_load: Session ended with " << status.error_message() << std::endl;
    }
  }

 private:
  void NextEpisode(Run& run, unsigned loop, unsigned concurrency, unsigned index) {
    if (!run.Continues(loop)) {
      run.Finish();
      return;
    }
    auto next = [this, &run, loop, concurrency, index] {
      run.Episode(loop);
      NextEpisode(run, loop, concurrency, index + concurrency);
    };
    auto fail = [&run, loop](const std::string& error) {
      run.Fail(error);
      run.Finish();
    };
    if (options_.mode == "unary") {
      UnaryEpisode(run, loop, index, next, fail);
    } else {
      StreamEpisode(run, loop, index, next, fail);
    }
  }

  v1::ResetRequest Reset(unsigned index) {
    v1::ResetRequest reset;
    reset.set_request_id(ids_.Next());
    reset.set_env("gsm8k");
    reset.mutable_task_ref()->set_split(options_.split);
    reset.mutable_task_ref()->set_index(index % options_.tasks);
    return reset;
  }

  v1::StepRequest StepOf(const std::string& episode_id, const v1::ChatMessage& action) {
    v1::StepRequest step;
    step.set_request_id(ids_.Next());
    step.set_episode_id(episode_id);
    *step.mutable_action() = action;
    return step;
  }

  v1::CloseRequest CloseOf(const std::string& episode_id) {
    v1::CloseRequest close;
    close.set_request_id(ids_.Next());
    close.set_episode_id(episode_id);
    return close;
  }

  using Next = std::function<void()>;
  using Fail = std::function<void(const std::string&)>;

  static std::string ErrorOf(const char* operation, const v1::SessionResponse& answer) {
    if (answer.result_case() == v1::SessionResponse::kError) {
      return std::string(operation) + " failed: " +
             sciproto::StatusCodeName(static_cast<grpc::StatusCode>(answer.error().code())) + ": " +
             answer.error().message();
    }
    return std::string(operation) + " got an answer of another kind";
  }

  // Reset, calculator step, submit step, close; each sent when the answer before it arrives.
  void StreamEpisode(Run& run, unsigned loop, unsigned index, Next next, Fail fail) {
    Stream* stream = streams_[index % streams_.size()].get();
    const bool echo = options_.mode == "session_echo";
    auto close = [this, stream, next, fail](const std::string& episode_id) {
      if (episode_id == "echo") return next();
      v1::SessionRequest request;
      *request.mutable_close() = CloseOf(episode_id);
      const std::string id = request.close().request_id();
      stream->Send(std::move(request), id, [next, fail](const v1::SessionResponse& answer) {
        if (answer.result_case() != v1::SessionResponse::kClose) return fail(ErrorOf("Close", answer));
        next();
      });
    };
    auto steps = [this, &run, loop, stream, echo, close, fail](const std::string& episode_id) {
      v1::SessionRequest request;
      *request.mutable_step() = StepOf(episode_id, calculate_);
      const std::string id = request.step().request_id();
      const auto started = Clock::now();
      stream->Send(std::move(request), id,
                   [this, &run, loop, stream, echo, close, fail, episode_id, started](const v1::SessionResponse& answer) {
        if (answer.result_case() != v1::SessionResponse::kStep) return fail(ErrorOf("Step", answer));
        run.Step(loop, started);
        v1::SessionRequest submit;
        *submit.mutable_step() = StepOf(episode_id, submit_);
        const std::string submit_id = submit.step().request_id();
        const auto submitted = Clock::now();
        stream->Send(std::move(submit), submit_id,
                     [&run, loop, echo, close, fail, episode_id, submitted](const v1::SessionResponse& answer) {
          if (answer.result_case() != v1::SessionResponse::kStep) return fail(ErrorOf("Step", answer));
          run.Step(loop, submitted);
          if (!echo && !answer.step().terminated()) return fail("submit_answer did not end the gsm8k episode");
          close(episode_id);
        });
      });
    };
    if (echo) return steps("echo");
    v1::SessionRequest request;
    *request.mutable_reset() = Reset(index);
    const std::string id = request.reset().request_id();
    stream->Send(std::move(request), id, [steps, fail](const v1::SessionResponse& answer) {
      if (answer.result_case() != v1::SessionResponse::kReset) return fail(ErrorOf("Reset", answer));
      steps(answer.reset().episode_id());
    });
  }

  // One unary call; `done` gets the response if the call succeeded.
  template <typename Request, typename Response, typename Method>
  void Call(const char* name, Method method, Request request, std::function<void(const Response&)> done, Fail fail) {
    struct Pending {
      grpc::ClientContext context;
      Request request;
      Response response;
    };
    auto pending = std::make_shared<Pending>();
    pending->request = std::move(request);
    pending->context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    auto* stub = stubs_[0]->async();
    (stub->*method)(&pending->context, &pending->request, &pending->response,
                    [pending, name, done, fail](grpc::Status status) {
      if (!status.ok()) {
        return fail(std::string(name) + " failed: " + sciproto::StatusCodeName(status.error_code()) + ": " +
                    status.error_message());
      }
      done(pending->response);
    });
  }

  void UnaryEpisode(Run& run, unsigned loop, unsigned index, Next next, Fail fail) {
    using Async = v1::EnvironmentService::Stub::async_interface;
    using StepMethod = void (Async::*)(grpc::ClientContext*, const v1::StepRequest*, v1::StepResponse*,
                                       std::function<void(grpc::Status)>);
    using ResetMethod = void (Async::*)(grpc::ClientContext*, const v1::ResetRequest*, v1::ResetResponse*,
                                        std::function<void(grpc::Status)>);
    using CloseMethod = void (Async::*)(grpc::ClientContext*, const v1::CloseRequest*, v1::CloseResponse*,
                                        std::function<void(grpc::Status)>);
    const StepMethod step = &Async::Step;
    const ResetMethod reset = &Async::Reset;
    const CloseMethod close = &Async::Close;
    auto closing = [this, close, next, fail](const std::string& episode_id) {
      Call<v1::CloseRequest, v1::CloseResponse>("Close", close, CloseOf(episode_id),
                                                [next](const v1::CloseResponse&) { next(); }, fail);
    };
    auto steps = [this, &run, loop, step, closing, fail](const std::string& episode_id) {
      const auto started = Clock::now();
      Call<v1::StepRequest, v1::StepResponse>(
          "Step", step, StepOf(episode_id, calculate_),
          [this, &run, loop, step, closing, fail, episode_id, started](const v1::StepResponse&) {
            run.Step(loop, started);
            const auto submitted = Clock::now();
            Call<v1::StepRequest, v1::StepResponse>(
                "Step", step, StepOf(episode_id, submit_),
                [&run, loop, closing, fail, episode_id, submitted](const v1::StepResponse& answer) {
                  run.Step(loop, submitted);
                  if (!answer.terminated()) return fail("submit_answer did not end the gsm8k episode");
                  closing(episode_id);
                },
                fail);
          },
          fail);
    };
    Call<v1::ResetRequest, v1::ResetResponse>("Reset", reset, Reset(index),
                                              [steps](const v1::ResetResponse& answer) { steps(answer.episode_id()); },
                                              fail);
  }

  Options options_;
  RequestIds ids_;
  v1::ChatMessage calculate_, submit_;
  std::vector<std::unique_ptr<v1::EnvironmentService::Stub>> stubs_;
  std::vector<std::unique_ptr<Stream>> streams_;
};

std::vector<std::string> Split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string part; std::getline(stream, part, separator);) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

bool Parse(int argc, char** argv, Options& options) {
  if (argc < 3) return false;
  options.mode = argv[1];
  if (options.mode != "session" && options.mode != "unary" && options.mode != "session_echo") return false;
  options.targets = Split(argv[2], ',');
  if (options.targets.empty()) return false;
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--split") {
      options.split = value;
    } else if (flag == "--tasks") {
      options.tasks = static_cast<unsigned>(std::stoul(value));
    } else if (flag == "--expr") {
      options.expr = value;
    } else if (flag == "--answer") {
      options.answer = value;
    } else {
      return false;
    }
  }
  return (argc - 3) % 2 == 0 && options.tasks > 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!Parse(argc, argv, options)) {
    std::cerr << "usage: " << argv[0]
              << " session|unary|session_echo HOST:PORT[,HOST:PORT...] [--split S] [--tasks N] [--expr E]"
                 " [--answer A]"
              << std::endl;
    return 2;
  }
  Load load(options);
  for (std::string line; std::getline(std::cin, line);) {
    std::istringstream command(line);
    std::string verb;
    command >> verb;
    if (verb == "quit") break;
    unsigned concurrency = 0, episodes = 0;
    double seconds = 0;
    if (verb != "run" || !(command >> concurrency >> seconds >> episodes) || concurrency == 0) {
      std::cout << "{\"error\": \"unknown command: " << verb << " (run CONCURRENCY SECONDS EPISODES | quit)\"}"
                << std::endl;
      continue;
    }
    std::cout << load.RunCommand(concurrency, seconds, episodes) << std::endl;
  }
  load.Close();
  return 0;
}
