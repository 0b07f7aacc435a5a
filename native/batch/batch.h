// A submitted batch: its requests, their per-request state, and the tasks that carry them out
// (planned by the transports' links, see transport/transport.h).
// Tasks are claimed exactly once, either by a worker thread or by a thread waiting on the batch
// (so a waiter never sleeps while its own work sits in the queue).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "common/wire.h"
#include "regions/region_table.h"

namespace tidekv {

struct Request {
  wire::Op op;
  uint64_t local_addr;
  uint64_t length;
  uint32_t peer;
  uint64_t remote_addr;
};

enum class RequestState : uint8_t { kPending = 0, kDone = 1, kFailed = 2 };

struct RequestResult {
  RequestState state;
  ErrorKind kind;
  std::string message;
};

// When a thread waiting on its batch runs a task itself, the task must give the thread back by
// this time: work that would wait on a peer past it is handed to a worker instead.
using Deadline = std::optional<std::chrono::steady_clock::time_point>;

class Task {
 public:
  explicit Task(std::function<void(const Deadline&)> body) : body_(std::move(body)) {}
  bool is_claimed() const { return claimed_.load(std::memory_order_acquire); }
  // A plain memory copy on the running thread (its link's is_local_copy()): it never waits on a peer.
  bool is_local_copy() const { return is_local_copy_; }
  void set_local_copy() { is_local_copy_ = true; }
  // A deferred task nobody claimed by this time is handed to a worker (Engine::defer).
  void defer_until(std::chrono::steady_clock::time_point t) { defer_until_ = t; }
  std::chrono::steady_clock::time_point deferred_until() const { return defer_until_; }
  // Called once, by whichever thread claims the task, before its body runs (the engine stops
  // the fallback timer of a deferred task there). Set before the task is visible to others.
  void set_on_claim(std::function<void()> on_claim) { on_claim_ = std::move(on_claim); }
  // Runs the body if nobody claimed it yet; drops the body afterwards (it holds the batch).
  bool try_run(const Deadline& deadline = std::nullopt) {
    if (claimed_.exchange(true, std::memory_order_acq_rel)) return false;
    if (on_claim_) std::exchange(on_claim_, nullptr)();
    body_(deadline);
    body_ = nullptr;
    return true;
  }

 private:
  std::atomic<bool> claimed_{false};
  bool is_local_copy_ = false;
  std::function<void(const Deadline&)> body_;
  std::function<void()> on_claim_;
  std::chrono::steady_clock::time_point defer_until_{};
};

class Batch {
 public:
  explicit Batch(std::vector<Request> requests);

  const std::vector<Request>& requests() const { return requests_; }
  // Planning (before the batch is visible to any other thread).
  void expect_slices(size_t request, uint32_t count) { slices_left_[request] += count; }
  // One guard per request, in request order (the engine holds them before planning).
  void hold(RegionTable::Guard guard) { guards_.push_back(std::move(guard)); }
  // Where request r's local memory is (valid from planning on).
  MemoryLocation local_location(size_t request) const { return guards_[request].view().location; }
  void add_task(std::shared_ptr<Task> task) { tasks_.push_back(std::move(task)); }
  const std::vector<std::shared_ptr<Task>>& tasks() const { return tasks_; }
  // Seals planning: requests with no slices (failed during planning) count as finished, and
  // tasks that wait on peers go before local copies (see seal()).
  void seal();

  // Execution (any thread).
  void complete_slice(size_t request, uint64_t bytes);
  void fail_slice(size_t request, ErrorKind kind, const std::string& message);

  bool is_done() const { return requests_left_.load(std::memory_order_acquire) == 0; }
  bool has_failures() const { return failed_.load(std::memory_order_acquire) != 0; }
  // Names of the peers its requests go to (by peer id), for errors; set before submitting.
  void set_peer_names(std::vector<std::pair<uint32_t, std::string>> names) { peer_names_ = std::move(names); }
  const std::string& peer_name(uint32_t id) const;
  // Runs unclaimed tasks on the calling thread (within the deadline), then waits; false on
  // timeout (timeout_s < 0: no limit). The batch keeps running after a timeout.
  bool wait(double timeout_s);
  std::vector<RequestResult> results();
  uint64_t bytes_done() const { return bytes_done_.load(); }

 private:
  void finish_request(size_t request);

  std::vector<Request> requests_;
  std::unique_ptr<std::atomic<uint32_t>[]> slices_left_;
  std::vector<RequestResult> results_;  // guarded by mu_
  std::atomic<size_t> requests_left_;
  std::atomic<size_t> failed_{0};
  std::vector<std::pair<uint32_t, std::string>> peer_names_;
  std::atomic<uint64_t> bytes_done_{0};
  std::vector<RegionTable::Guard> guards_;  // local regions pinned until the batch ends
  std::vector<std::shared_ptr<Task>> tasks_;
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace tidekv
