#include "batch/batch.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace tidekv {

Batch::Batch(std::vector<Request> requests)
    : requests_(std::move(requests)),
      slices_left_(new std::atomic<uint32_t>[requests_.size()]),
      results_(requests_.size(), RequestResult{RequestState::kPending, ErrorKind::kTransfer, {}}),
      requests_left_(requests_.size()) {
  for (size_t i = 0; i < requests_.size(); ++i) slices_left_[i].store(0);
}

void Batch::seal() {
  // Workers take tasks in this order and a waiter starts with the last one: network tasks go
  // out first, so their requests are on the wire while local copies run (on the waiter, and on
  // workers as they come free), instead of copies holding the cores while peers sit idle.
  if (tasks_.size() > 1)
    std::stable_partition(tasks_.begin(), tasks_.end(), [](const auto& t) { return !t->is_local_copy(); });
  for (size_t i = 0; i < requests_.size(); ++i)
    if (slices_left_[i].load() == 0) finish_request(i);
}

void Batch::complete_slice(size_t request, uint64_t bytes) {
  bytes_done_.fetch_add(bytes, std::memory_order_relaxed);
  if (slices_left_[request].fetch_sub(1, std::memory_order_acq_rel) == 1) finish_request(request);
}

void Batch::fail_slice(size_t request, ErrorKind kind, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    RequestResult& r = results_[request];
    if (r.message.empty()) {  // the first failure explains the request best
      r.kind = kind;
      r.message = message;
    }
  }
  if (slices_left_[request].load() == 0) {  // failed while planning: no slices were expected
    return;
  }
  if (slices_left_[request].fetch_sub(1, std::memory_order_acq_rel) == 1) finish_request(request);
}

void Batch::finish_request(size_t request) {
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RequestResult& r = results_[request];
    r.state = r.message.empty() ? RequestState::kDone : RequestState::kFailed;
    if (r.state == RequestState::kFailed) failed_.fetch_add(1, std::memory_order_release);
    last = requests_left_.fetch_sub(1, std::memory_order_acq_rel) == 1;
    if (last) guards_.clear();
  }
  if (last) cv_.notify_all();
}

bool Batch::wait(double timeout_s) {
  Deadline deadline;
  if (timeout_s >= 0)
    deadline = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
  // Run the last task here and leave the others to the workers woken for them, so that a
  // batch split over several connections runs them side by side; whatever is still unclaimed
  // afterwards is run here too, from the back: workers take tasks from the front, and the back
  // holds the batch's local copies (seal()), which this thread should do while the workers wait
  // on peers, not after it has taken a network task of its own.
  for (auto it = tasks_.rbegin(); it != tasks_.rend(); ++it) (*it)->try_run(deadline);
  if (is_done()) return true;
  // A short spin catches completions that arrive within microseconds; a futex sleep and
  // wake-up costs far more than that on a loaded or virtualised core. It yields on every turn:
  // the thread that completes the batch may be queued on this very core.
  auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(30);
  while (std::chrono::steady_clock::now() < spin_until) {
    if (is_done()) return true;
    std::this_thread::yield();
  }
  std::unique_lock<std::mutex> lock(mu_);
  auto done = [&] { return requests_left_.load(std::memory_order_acquire) == 0; };
  if (!deadline) {
    cv_.wait(lock, done);
    return true;
  }
  return cv_.wait_until(lock, *deadline, done);
}

std::vector<RequestResult> Batch::results() {
  std::lock_guard<std::mutex> lock(mu_);
  return results_;
}

}  // namespace tidekv

namespace tidekv {

const std::string& Batch::peer_name(uint32_t id) const {
  static const std::string unknown = "?";
  for (const auto& [pid, name] : peer_names_)
    if (pid == id) return name;
  return unknown;
}

}  // namespace tidekv
