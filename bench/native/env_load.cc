// A native gRPC load generator for bench/env_step.py: GSM8K episodes (reset, calculator step,
// submit step, close) against an env server, from C++ on one thread polling a gRPC completion
// queue, so that the client's own CPU and thread hops stay small beside the server's. Python's
// grpc.aio client spends 0.5-0.7 ms of CPU per step; on a machine whose cores the client shares
// with the server, that client is what a latency or scaling figure would measure.
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
// Every call and every wait has a deadline; a failed operation is an {"error"} answer (the
// process goes on), a run past its 600 s deadline exits 1, bad usage exits 2.
#include <sys/resource.h>

#include <chrono>
#include <cstdlib>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
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
  std::string Next() { return prefix_ + std::to_string(counter_++); }

 private:
  std::string prefix_;
  unsigned long counter_ = 0;  // one thread makes every request
};

// ------------------------------------------------------------------ the completion queue

// Every operation in flight names a Tag. The one thread that runs the episodes takes each
// finished operation off the completion queue and calls its tag, so no other thread touches
// episode state and nothing here takes a lock (and no reply waits for a thread to wake).
struct Tag {
  virtual ~Tag() = default;
  virtual void Done(bool ok) = 0;
};

// A tag calling a function: a stream's own operations, one tag reused for every read or write.
struct FunctionTag : Tag {
  std::function<void(bool)> on_done;
  void Done(bool ok) override { on_done(ok); }
};

// ------------------------------------------------------------------ one run of episode loops

// What one `run` command records; each loop calls Finish when it starts no more episodes.
class Run {
 public:
  Run(unsigned loops, double seconds, unsigned episodes_per_loop)
      : stop_at_(Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds))),
        episodes_per_loop_(episodes_per_loop), running_(loops), latencies_(loops), episodes_(loops, 0) {}

  // Whether loop `loop` starts another episode.
  bool Continues(unsigned loop) const {
    if (!error_.empty()) return false;
    if (episodes_per_loop_ != 0) return episodes_[loop] < episodes_per_loop_;
    return Clock::now() < stop_at_;
  }

  void Step(unsigned loop, Clock::time_point started) {
    latencies_[loop].push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - started).count());
  }
  void Episode(unsigned loop) { ++episodes_[loop]; }
  void Fail(const std::string& error) {
    if (error_.empty()) error_ = error;
  }
  void Finish() { --running_; }
  bool Running() const { return running_ > 0; }

  std::string Json(double elapsed_s, double cpu_s) const {
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
  unsigned running_;
  std::string error_;
  std::vector<std::vector<long long>> latencies_;
  std::vector<unsigned long> episodes_;
};

// ------------------------------------------------------------------ Session streams

// One Session stream: requests written in order, one write in flight at a time (as gRPC
// allows); each answer is handed to the callback of its request_id. When the stream ends,
// every request still waiting is answered with an error.
class Stream {
 public:
  using Callback = std::function<void(const v1::SessionResponse&)>;

  Stream(v1::EnvironmentService::Stub* stub, grpc::CompletionQueue* queue) {
    started_.on_done = [this](bool ok) {
      if (!ok) return End();
      live_ = true;
      call_->Read(&answer_, &read_);
      WriteNext();
    };
    read_.on_done = [this](bool ok) { OnRead(ok); };
    written_.on_done = [this](bool ok) {
      writing_ = false;
      if (!ok) return;  // the stream broke: the pending read fails too, and ends it
      if (!queue_.empty()) queue_.pop_front();
      WriteNext();
    };
    finished_.on_done = [this](bool) { OnFinished(); };
    call_ = stub->PrepareAsyncSession(&context_, queue);
    call_->StartCall(&started_);
  }

  void Send(v1::SessionRequest request, const std::string& request_id, Callback callback) {
    if (ended_) return callback(EndedAnswer());
    waiting_.emplace(request_id, std::move(callback));
    queue_.push_back(std::move(request));  // deque: the message being written keeps its address
    WriteNext();
  }

  // Half-close once every queued request is written; the server then ends the stream.
  void HalfClose() {
    closing_ = true;
    WriteNext();
  }

  // Ends the call from this side: its pending operations complete, failed, and it finishes.
  void Cancel() { context_.TryCancel(); }

  bool Ended() const { return ended_; }
  const grpc::Status& status() const { return status_; }

 private:
  void WriteNext() {
    if (!live_ || writing_ || ended_) return;
    if (!queue_.empty()) {
      writing_ = true;
      call_->Write(queue_.front(), &written_);
    } else if (closing_ && !half_closed_) {
      half_closed_ = writing_ = true;
      call_->WritesDone(&written_);
    }
  }

  void OnRead(bool ok) {
    if (!ok) return End();  // nothing more to read: the server ended the stream, or it broke
    if (answer_.result_case() != v1::SessionResponse::kHeartbeat) {
      auto found = waiting_.find(answer_.request_id());
      if (found == waiting_.end()) {
        std::cerr << "env_load: an answer to no request: " << answer_.request_id() << std::endl;
      } else {
        Callback callback = std::move(found->second);
        waiting_.erase(found);
        callback(answer_);  // may Send: a write, never a read, so answer_ is still ours
      }
    }
    call_->Read(&answer_, &read_);
  }

  void End() {
    if (finishing_) return;
    finishing_ = true;
    call_->Finish(&status_, &finished_);
  }

  void OnFinished() {
    ended_ = true;
    queue_.clear();
    std::unordered_map<std::string, Callback> orphans;
    orphans.swap(waiting_);
    for (auto& [id, callback] : orphans) callback(EndedAnswer());
  }

  v1::SessionResponse EndedAnswer() const {
    v1::SessionResponse ended;
    ended.mutable_error()->set_code(status_.ok() ? static_cast<int>(grpc::StatusCode::ABORTED)
                                                 : static_cast<int>(status_.error_code()));
    ended.mutable_error()->set_message("the Session stream ended: " + status_.error_message());
    return ended;
  }

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::SessionRequest, v1::SessionResponse>> call_;
  FunctionTag started_, read_, written_, finished_;
  v1::SessionResponse answer_;
  std::deque<v1::SessionRequest> queue_;
  std::unordered_map<std::string, Callback> waiting_;
  bool live_ = false, writing_ = false, closing_ = false, half_closed_ = false, finishing_ = false,
       ended_ = false;
  grpc::Status status_;
};

// One unary call in flight: it deletes itself when its answer (or its error) has been handled.
template <typename Response>
struct UnaryCall : Tag {
  const char* method = "";
  grpc::ClientContext context;
  Response response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> reader;
  std::function<void(const Response&)> done;
  std::function<void(const std::string&)> fail;

  void Done(bool) override {
    std::unique_ptr<UnaryCall> self(this);
    if (!status.ok()) {
      return fail(std::string(method) + " failed: " + sciproto::StatusCodeName(status.error_code()) + ": " +
                  status.error_message());
    }
    done(response);
  }
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
      for (auto& stub : stubs_) streams_.push_back(std::make_unique<Stream>(stub.get(), &queue_));
    }
  }

  ~Load() {
    queue_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (queue_.Next(&tag, &ok)) {
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
    if (!Pump([&run] { return !run.Running(); }, started + kRunDeadline)) {
      // Operations still name `run`: end the process rather than free it under them.
      std::cout << "{\"error\": \"the episode loops did not finish within 600 s\"}" << std::endl;
      std::exit(1);
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
    return run.Json(elapsed, CpuSeconds() - cpu_before);
  }

  // Half-closes every stream and waits (30 s at most) for the server to end them; a stream it
  // does not end is cancelled, so that no operation is left pending on the queue (its drain,
  // in ~Load, would wait for it forever).
  void Close() {
    for (auto& stream : streams_) stream->HalfClose();
    auto all_ended = [this] {
      for (auto& stream : streams_) {
        if (!stream->Ended()) return false;
      }
      return true;
    };
    if (!Pump(all_ended, Clock::now() + std::chrono::seconds(30))) {
      std::cerr << "env_load: a Session stream did not end within 30 s after its half-close; cancelling it"
                << std::endl;
      for (auto& stream : streams_) {
        if (!stream->Ended()) stream->Cancel();
      }
      if (!Pump(all_ended, Clock::now() + std::chrono::seconds(5))) std::exit(1);
    }
    for (auto& stream : streams_) {
      if (stream->Ended() && !stream->status().ok()) {
        std::cerr << "env_load: Session ended with " << stream->status().error_message() << std::endl;
      }
    }
  }

 private:
  // Handles finished operations until `done()` holds; false if `deadline` comes first.
  template <typename Predicate>
  bool Pump(Predicate done, Clock::time_point deadline) {
    while (!done()) {
      void* tag = nullptr;
      bool ok = false;
      const auto wait = std::chrono::system_clock::now() + (deadline - Clock::now());
      const auto status = queue_.AsyncNext(&tag, &ok, wait);
      if (status != grpc::CompletionQueue::GOT_EVENT) return false;
      static_cast<Tag*>(tag)->Done(ok);
    }
    return true;
  }

  void NextEpisode(Run& run, unsigned loop, unsigned concurrency, unsigned index) {
    if (!run.Continues(loop)) {
      run.Finish();
      return;
    }
    auto next = [this, &run, loop, concurrency, index] {
      run.Episode(loop);
      NextEpisode(run, loop, concurrency, index + concurrency);
    };
    auto fail = [&run](const std::string& error) {
      run.Fail(error);
      run.Finish();
    };
    if (options_.mode == "unary") {
      UnaryEpisode(run, loop, index, next, fail);
    } else {
      StreamEpisode(run, loop, index, next, fail);
    }
  }

  v1::ResetRequest ResetOf(unsigned index) {
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

  // Reset, calculator step, submit step, close on the episode's stream, each sent when the
  // answer before it arrives; the two steps are timed.
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
    *request.mutable_reset() = ResetOf(index);
    const std::string id = request.reset().request_id();
    stream->Send(std::move(request), id, [steps, fail](const v1::SessionResponse& answer) {
      if (answer.result_case() != v1::SessionResponse::kReset) return fail(ErrorOf("Reset", answer));
      steps(answer.reset().episode_id());
    });
  }

  // One unary call through `prepare` (the stub's PrepareAsync<Method>), with its deadline.
  template <typename Response, typename Prepare>
  void Call(const char* method, Prepare prepare, std::function<void(const Response&)> done, Fail fail) {
    auto* call = new UnaryCall<Response>();
    call->method = method;
    call->done = std::move(done);
    call->fail = std::move(fail);
    call->context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    call->reader = prepare(&call->context);
    call->reader->StartCall();
    call->reader->Finish(&call->response, &call->status, call);
  }

  void UnaryEpisode(Run& run, unsigned loop, unsigned index, Next next, Fail fail) {
    auto* stub = stubs_[index % stubs_.size()].get();
    auto closing = [this, stub, next, fail](const std::string& episode_id) {
      const auto request = CloseOf(episode_id);
      Call<v1::CloseResponse>(
          "Close", [this, stub, &request](grpc::ClientContext* c) { return stub->PrepareAsyncClose(c, request, &queue_); },
          [next](const v1::CloseResponse&) { next(); }, fail);
    };
    auto steps = [this, &run, loop, stub, closing, fail](const std::string& episode_id) {
      const auto calculate = StepOf(episode_id, calculate_);
      const auto started = Clock::now();
      Call<v1::StepResponse>(
          "Step", [this, stub, &calculate](grpc::ClientContext* c) { return stub->PrepareAsyncStep(c, calculate, &queue_); },
          [this, &run, loop, stub, closing, fail, episode_id, started](const v1::StepResponse&) {
            run.Step(loop, started);
            const auto submit = StepOf(episode_id, submit_);
            const auto submitted = Clock::now();
            Call<v1::StepResponse>(
                "Step", [this, stub, &submit](grpc::ClientContext* c) { return stub->PrepareAsyncStep(c, submit, &queue_); },
                [&run, loop, closing, fail, episode_id, submitted](const v1::StepResponse& answer) {
                  run.Step(loop, submitted);
                  if (!answer.terminated()) return fail("submit_answer did not end the gsm8k episode");
                  closing(episode_id);
                },
                fail);
          },
          fail);
    };
    const auto reset = ResetOf(index);
    Call<v1::ResetResponse>(
        "Reset", [this, stub, &reset](grpc::ClientContext* c) { return stub->PrepareAsyncReset(c, reset, &queue_); },
        [steps](const v1::ResetResponse& answer) { steps(answer.episode_id()); }, fail);
  }

  Options options_;
  grpc::CompletionQueue queue_;  // before the streams, which name it
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
