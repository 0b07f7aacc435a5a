#include "c_engine.h"

#include <algorithm>
#include <set>

#include "boundary.h"
#include "cuda/driver.h"
#include "options.h"

namespace tidekv::capi {
namespace {

constexpr int kStatusPending = 1;
constexpr int kStatusCompleted = 4;
constexpr int kStatusFailed = 6;
constexpr double kPollWaitS = 0.001;  // longest a status poll of an unfinished task blocks

std::string bracketed(const std::string& host) { return host.find(':') != std::string::npos ? "[" + host + "]" : host; }

// Mooncake's location strings: "*" (detect), "cpu" or "cpu:<numa node>", "cuda:N".
std::string location_of(uint64_t addr, const std::string& location) {
  if (location.empty() || location == "*") {
    int device = cuda::Driver::get().device_of(addr);
    return device >= 0 ? "cuda:" + std::to_string(device) : "cpu";
  }
  if (location == "cpu" || location.rfind("cpu:", 0) == 0) return "cpu";
  if (location == "cuda" || location.rfind("cuda:", 0) == 0) return location;
  refuse(-1, "location '" + location + "' is not supported; use \"*\" (detect), \"cpu\", \"cpu:N\" or \"cuda:N\"");
}

}  // namespace

CEngine::CEngine(const std::string& metadata, const std::string& host, int rpc_port) : host_(host) {
  if (metadata != "P2PHANDSHAKE")
    refuse(-200, "metadata '" + metadata + "' is not supported: tidekv's C API finds peers through their endpoints "
                 "(segment names \"ip:port\"); pass \"P2PHANDSHAKE\" (a metadata service such as etcd, redis or "
                 "http is not served)");
  if (rpc_port < 0 || rpc_port > 65535) refuse(-1, "rpc_port " + std::to_string(rpc_port) + " is out of range 0..65535");
  EngineOptions options = engine_options_from_env(host);
  handshake_timeout_ms_ = options.handshake_timeout_ms;
  engine_ = std::make_unique<Engine>(options);
  std::string engine_host;
  int engine_port = 0;
  split_host_port(engine_->name(), &engine_host, &engine_port);
  endpoint_ = std::make_unique<Endpoint>(host, rpc_port, options.secret, engine_->descriptor(), engine_port,
                                         options.handshake_timeout_ms);
  segments_.push_back(Segment{local_name(), engine_->name(), 0, false, nullptr});  // opened on first use
  notifier_ = std::thread([this] { notifier_loop(); });
  logger_ = std::thread([this] { log_loop(); });
  log(LogLevel::kInfo, "engine " + local_name() + " started (transfer listener " + engine_->name() + ", transport " +
                           options.transport + ")");
}

CEngine::~CEngine() {
  magic = 0;
  engine_->close();  // fails whatever is in flight at once, so the notifier's wait ends
  {
    std::lock_guard<std::mutex> lock(notify_mu_);
    stopping_ = true;
  }
  notify_cv_.notify_all();
  notifier_.join();
  endpoint_->stop();
  logger_.join();
}

std::string CEngine::local_name() const { return bracketed(host_) + ":" + std::to_string(endpoint_->port()); }

void CEngine::register_memory(uint64_t addr, uint64_t length, const std::string& location) {
  if (addr == 0 || length == 0) refuse(-1, "address and length must be non-zero");
  engine_->register_region(addr, length, location_of(addr, location));
}

void CEngine::unregister_memory(uint64_t addr) { engine_->unregister_region(addr); }

int32_t CEngine::open_segment(const std::string& name, bool refresh) {
  bool is_local = name == local_name();
  {
    std::lock_guard<std::mutex> lock(segments_mu_);
    if (is_local && segments_[0].is_open && !refresh) return 0;
    auto it = segment_ids_.find(name);
    if (it != segment_ids_.end() && segments_[it->second].is_open && !refresh) return it->second;
  }
  std::string host;
  int port = 0;
  split_host_port(name, &host, &port);
  // What listens there: a C API endpoint (its descriptor has the endpoint section) or a plain
  // tidekv TransferEngine (Python), which takes transfers but no notifications. Asked with a
  // descriptor fetch, which both answer: greeting a plain engine as an endpoint would be a
  // connection it refuses and logs (it serves no transport of that id).
  std::string descriptor = engine_->fetch_descriptor(host, port);
  std::string peer_name = name;
  std::shared_ptr<EndpointLink> link;
  if (Descriptor::decode(descriptor, name).section(kEndpointWireId) != nullptr) {
    link = std::make_shared<EndpointLink>(host, port, engine_->context().instance, engine_->context().options.secret,
                                          handshake_timeout_ms_);
    peer_name = bracketed(host) + ":" + std::to_string(link->engine_port());
    descriptor = link->descriptor();
  }
  uint32_t peer_id = engine_->add_peer(peer_name, descriptor);
  std::lock_guard<std::mutex> lock(segments_mu_);
  int32_t id;
  if (is_local) {
    id = 0;
  } else if (auto it = segment_ids_.find(name); it != segment_ids_.end()) {
    id = it->second;
  } else {
    id = int32_t(segments_.size());
    segments_.push_back({});
    segment_ids_[name] = id;
  }
  segments_[id] = Segment{name, peer_name, peer_id, true, std::move(link)};
  log(LogLevel::kInfo, "segment " + std::to_string(id) + " is " + name + " (transfers go to " + peer_name + ")");
  return id;
}

void CEngine::close_segment(int32_t id) {
  std::lock_guard<std::mutex> lock(segments_mu_);
  if (id < 0 || size_t(id) >= segments_.size()) refuse(-1, "segment id " + std::to_string(id) + " was never opened");
  if (id == 0) return;  // this engine's own segment stays usable
  segments_[id].is_open = false;
  segments_[id].link.reset();
}

CEngine::Segment CEngine::segment(int32_t id) {
  if (id == 0) open_segment(local_name(), false);
  std::lock_guard<std::mutex> lock(segments_mu_);
  if (id < 0 || size_t(id) >= segments_.size() || !segments_[id].is_open)
    refuse(-1, "segment id " + std::to_string(id) + " is not open on engine " + local_name() + "; openSegment() it first");
  return segments_[id];
}

uint64_t CEngine::allocate_batch(size_t capacity) {
  if (capacity == 0) refuse(-1, "batch_size must be at least 1");
  auto b = std::make_shared<CBatch>();
  b->capacity = capacity;
  std::lock_guard<std::mutex> lock(batches_mu_);
  uint64_t id = next_batch_++;
  batches_[id] = std::move(b);
  return id;
}

std::shared_ptr<CBatch> CEngine::find_batch(uint64_t id) {
  std::lock_guard<std::mutex> lock(batches_mu_);
  auto it = batches_.find(id);
  if (it == batches_.end())
    refuse(-1, "batch id " + std::to_string(id) + " is not allocated on engine " + local_name() +
                   " (never allocated, or freed); allocateBatchID() first");
  return it->second;
}

void CEngine::submit(uint64_t batch_id, const std::vector<RequestSpec>& specs, const Notification* notify) {
  auto b = find_batch(batch_id);
  std::vector<Request> requests;
  requests.reserve(specs.size());
  std::vector<std::pair<uint32_t, std::string>> names;
  std::set<int32_t> targets;
  int32_t last_target = -1;
  Segment seg;
  for (size_t i = 0; i < specs.size(); ++i) {
    const RequestSpec& s = specs[i];
    if (s.opcode != 0 && s.opcode != 1)
      refuse(-1, "request " + std::to_string(i) + " has opcode " + std::to_string(s.opcode) +
                     "; use OPCODE_READ (0) or OPCODE_WRITE (1)");
    if (s.length == 0) refuse(-1, "request " + std::to_string(i) + " has length 0");
    if (s.source == 0) refuse(-1, "request " + std::to_string(i) + " has a NULL source");
    if (s.target_id != last_target) {
      seg = segment(s.target_id);
      last_target = s.target_id;
      if (targets.insert(s.target_id).second) names.emplace_back(seg.peer_id, seg.name);
    }
    requests.push_back(Request{s.opcode == 0 ? wire::Op::kRead : wire::Op::kWrite, s.source, s.length, seg.peer_id,
                               s.target_offset});
  }
  std::shared_ptr<Batch> native;
  {
    std::lock_guard<std::mutex> lock(b->mu);
    if (b->used + specs.size() > b->capacity)
      refuse(-2, "batch id " + std::to_string(batch_id) + " holds " + std::to_string(b->capacity) + " tasks, " +
                     std::to_string(b->used) + " submitted already; " + std::to_string(specs.size()) + " more do not fit");
    if (!requests.empty()) {
      native = engine_->submit(std::move(requests));
      native->set_peer_names(std::move(names));
      b->submissions.push_back(Submission{native, b->used, {}});
      b->used += specs.size();
    }
  }
  if (notify == nullptr) return;
  std::lock_guard<std::mutex> lock(notify_mu_);
  for (int32_t t : targets) pending_.push_back(PendingNotification{native, t, *notify});
  notify_cv_.notify_one();
}

TaskStatus CEngine::status(uint64_t batch_id, size_t task) {
  auto b = find_batch(batch_id);
  std::unique_lock<std::mutex> lock(b->mu);
  if (task >= b->used)
    refuse(-1, "task " + std::to_string(task) + " is out of range: batch id " + std::to_string(batch_id) + " has " +
                   std::to_string(b->used) + " tasks submitted");
  auto find = [&] {
    auto it = std::upper_bound(b->submissions.begin(), b->submissions.end(), task,
                               [](size_t t, const Submission& s) { return t < s.first_task; });
    return it - 1;
  };
  if (find()->states.empty() && !find()->native->is_done()) {
    // The caller polls because it waits: its thread runs the submission's unclaimed work and
    // then sleeps on its completion, at most kPollWaitS (as TransferHandle.wait() does, so a
    // polling loop neither burns a core the workers need nor adds a sleep's latency).
    std::shared_ptr<Batch> native = find()->native;
    lock.unlock();
    native->wait(kPollWaitS);
    lock.lock();
  }
  Submission& s = *find();
  size_t i = task - s.first_task;
  if (s.states.empty()) {
    // A task's state is read once its whole submission has finished: one snapshot of the
    // results then, instead of one per poll of each of its (up to 1,024) tasks.
    if (!s.native->is_done()) return {kStatusPending, 0};
    auto results = s.native->results();
    s.states.resize(results.size());
    for (size_t r = 0; r < results.size(); ++r)
      s.states[r] = results[r].state == RequestState::kDone ? kStatusCompleted : kStatusFailed;
  }
  int state = s.states[i];
  return {state, state == kStatusCompleted ? s.native->requests()[i].length : 0};
}

void CEngine::free_batch(uint64_t batch_id) {
  auto b = find_batch(batch_id);
  {
    std::lock_guard<std::mutex> lock(b->mu);
    for (const auto& s : b->submissions)
      if (!s.native->is_done())
        refuse(-4, "batch id " + std::to_string(batch_id) + " still has tasks in flight; poll getTransferStatus() "
                   "until they finish, then free it");
  }
  std::lock_guard<std::mutex> lock(batches_mu_);
  batches_.erase(batch_id);
}

void CEngine::send_notification(int32_t id, const std::string& name, const std::string& message) {
  Segment seg = segment(id);
  if (!seg.link)
    refuse(-1, "segment " + std::to_string(id) + " (" + seg.name + ") is a tidekv TransferEngine without a C API "
               "endpoint: it takes transfers, not notifications");
  seg.link->notify(name, message);
}

void CEngine::notifier_loop() {
  for (;;) {
    PendingNotification p;
    {
      std::unique_lock<std::mutex> lock(notify_mu_);
      notify_cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
      if (stopping_) {
        if (!pending_.empty())
          log(LogLevel::kWarning, std::to_string(pending_.size()) + " notifications not sent: engine " +
                                      local_name() + " is being destroyed");
        return;
      }
      p = std::move(pending_.front());
      pending_.pop_front();
    }
    try {
      if (p.batch) p.batch->wait(-1);
      if (p.batch && p.batch->has_failures()) {
        log(LogLevel::kWarning, "notification '" + p.message.name + "' to segment " + std::to_string(p.segment) +
                                    " not sent: requests of its batch failed (their data did not all land)");
        continue;
      }
      send_notification(p.segment, p.message.name, p.message.message);
    } catch (const std::exception& e) {
      log(LogLevel::kError, "notification '" + p.message.name + "' to segment " + std::to_string(p.segment) +
                                " failed: " + e.what());
    }
  }
}

void CEngine::log_loop() {
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(notify_mu_);
      if (stopping_) break;
    }
    try {
      for (auto& [level, message] : engine_->context().log.drain(200)) log(level, message);
    } catch (const std::exception&) {
      // Logging must never end the engine; the record is lost.
    }
  }
  for (auto& [level, message] : engine_->context().log.drain(0)) log(level, message);
}

}  // namespace tidekv::capi
