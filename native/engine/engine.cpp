#include "engine/engine.h"

#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <system_error>

#include "common/errors.h"
#include "common/handshake.h"
#include "common/region_proof.h"
#include "common/socket.h"
#include "common/text.h"
#include "transport/registry.h"


namespace tidekv {
namespace {

void fill_random(uint8_t* out, size_t n) {
  std::random_device rd;
  for (size_t i = 0; i < n; ++i) out[i] = uint8_t(rd());
}


}  // namespace

void split_host_port(const std::string& name, std::string* host, int* port) {
  size_t colon = name.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == name.size())
    TIDEKV_THROW(kConfig, "peer name '" + name + "' is not of the form host:port");
  std::string h = name.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  char* end = nullptr;
  long p = std::strtol(name.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || p <= 0 || p > 65535)
    TIDEKV_THROW(kConfig, "peer name '" + name + "' has an invalid port (1..65535)");
  *host = h;
  *port = int(p);
}

Engine::Engine(EngineOptions options)
    : ctx_{std::move(options), {}, {}, {}, {}},
      regions_([&] {
        fill_random(ctx_.instance, sizeof(ctx_.instance));
        return RegionTable::create(ctx_.options.max_regions, ctx_.instance);
      }()) {
  std::string names;
  for (const auto& entry : transport_registry()) {
    transports_.push_back(entry.make(TransportEnv{ctx_, regions_}));
    availability_.push_back(transports_.back()->availability());
    names += (names.empty() ? "" : ", ") + std::string(entry.name);
  }
  if (ctx_.options.transport != "auto") {
    for (size_t i = 0; i < transports_.size(); ++i)
      if (ctx_.options.transport == transports_[i]->name()) forced_ = int(i);
    if (forced_ < 0)
      TIDEKV_THROW(kConfig, "transport '" + ctx_.options.transport + "' is unknown; this build has auto, " + names);
    if (!availability_[forced_].available)
      TIDEKV_THROW(kConfig, "transport '" + ctx_.options.transport + "' is forced but not available here: " +
                                availability_[forced_].reason);
  }
  ctx_.enqueue_task = [this](std::shared_ptr<Task> task) {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (!closed_.load()) {
        queue_.push_back(std::move(task));
        queue_cv_.notify_one();
        return;
      }
    }
    task->try_run();  // no workers any more: run it here (links are closed, it fails fast)
  };
  proof_key_.resize(32);
  random_bytes(reinterpret_cast<uint8_t*>(proof_key_.data()), proof_key_.size());
  listener_ = std::make_unique<Listener>(
      ctx_,
      [this](uint16_t id) -> Transport* {
        for (size_t i = 0; i < transports_.size(); ++i)
          if (uint16_t(transports_[i]->id()) == id && availability_[i].available &&
              transports_[i]->accepts_connections())
            return transports_[i].get();
        return nullptr;
      },
      [this](const wire::RegionProof& proof) { return verify_region(proof); });
  Descriptor self;
  std::memcpy(self.instance, ctx_.instance, sizeof(self.instance));
  for (size_t i = 0; i < transports_.size(); ++i)
    if (availability_[i].available) self.sections.emplace_back(uint16_t(transports_[i]->id()), transports_[i]->describe());
  descriptor_bytes_ = self.encode();
  listener_->start(descriptor_bytes_);
  defer_timer_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);  // steady_clock's clock
  if (defer_timer_fd_ < 0) {
    int err = errno;
    close();
    TIDEKV_THROW(kConfig, std::string("cannot create the engine's timer: ") + strerror(err));
  }
  try {
    for (int i = 0; i < std::max(1, ctx_.options.worker_threads); ++i) workers_.emplace_back([this] { worker_loop(); });
    watcher_ = std::thread([this] { watch_deferred(); });
  } catch (const std::system_error& e) {
    close();
    TIDEKV_THROW(kConfig, std::string("cannot start the engine's worker threads: ") + e.what());
  }
}

Engine::~Engine() { close(); }

std::string Engine::name() const {
  const std::string& h = ctx_.options.host;
  std::string host = h.find(':') != std::string::npos ? "[" + h + "]" : h;
  return host + ":" + std::to_string(listener_->port());
}

std::vector<TransportStatus> Engine::transports() const {
  std::vector<TransportStatus> out;
  for (size_t i = 0; i < transports_.size(); ++i)
    out.push_back(TransportStatus{transports_[i]->name(), availability_[i].available, availability_[i].reason});
  return out;
}

void Engine::close() {
  if (closed_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    for (auto& p : peers_) {
      std::lock_guard<std::mutex> plock(p->mu);
      for (auto& link : p->links)
        if (link) link->close();
    }
  }
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queue_cv_.notify_all();
    if (defer_timer_fd_ >= 0) {  // fires at once: the watcher sees closed_ and leaves
      itimerspec soon{};
      soon.it_value.tv_nsec = 1;
      timerfd_settime(defer_timer_fd_, 0, &soon, nullptr);
    }
  }
  if (watcher_.joinable()) watcher_.join();
  for (auto& w : workers_) w.join();
  workers_.clear();
  std::deque<std::shared_ptr<Task>> leftover;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    leftover.swap(queue_);
    leftover.insert(leftover.end(), deferred_.begin(), deferred_.end());
    deferred_.clear();
  }
  for (auto& task : leftover) task->try_run();
  {
    std::lock_guard<std::mutex> lock(queue_mu_);  // (a late waiter's claim touches it under this lock)
    if (defer_timer_fd_ >= 0) ::close(defer_timer_fd_);
    defer_timer_fd_ = -1;
  }
  if (listener_) listener_->stop();
  regions_.retire();  // same-host peers see this engine gone (and look it up again) from here on
  for (auto& t : transports_) t->close();
  std::lock_guard<std::mutex> lock(alloc_mu_);
  for (auto& [addr, a] : allocations_) {
    regions_.remove(addr, 0);
    a.release();
  }
  allocations_.clear();
  ctx_.log.close();
}

void Engine::register_region(uint64_t addr, uint64_t length, const std::string& location) {
  TIDEKV_CHECK(!closed_.load(), kClosed, "engine " + name() + " is closed");
  MemoryLocation where = MemoryLocation::parse(location);
  bool handled = false;
  std::string why;
  for (size_t i = 0; i < transports_.size(); ++i) {
    if (!transports_[i]->handles(where.kind)) continue;
    handled = handled || availability_[i].available;
    if (!availability_[i].available)
      why += std::string(why.empty() ? ": " : "; ") + transports_[i]->name() + " is unavailable (" + availability_[i].reason + ")";
  }
  if (!handled)
    TIDEKV_THROW(kConfig, "location '" + location + "' cannot be registered: no transport available here moves " +
                              (where.kind == MemoryKind::kCpu ? "host" : "GPU") + " memory" + why + " (see `tidekv doctor`)");
  add_region(addr, length, -1, where);
}

void Engine::add_region(uint64_t addr, uint64_t length, int memfd, MemoryLocation where) {
  regions_.add(addr, length, memfd, where);
  RegionView view = *regions_.find(addr, length);  // with its generation, which peers check
  try {
    for (auto& t : transports_) t->on_register(view);
  } catch (...) {
    regions_.remove(addr, 0);
    throw;
  }
}

uint64_t Engine::allocate(uint64_t length, bool huge) {
  TIDEKV_CHECK(!closed_.load(), kClosed, "engine " + name() + " is closed");
  TIDEKV_CHECK(length > 0, kConfig, "allocate() needs a size > 0");
  HostMemory memory = HostMemory::allocate(length, huge);
  uint64_t addr = reinterpret_cast<uint64_t>(memory.start);
  try {
    add_region(addr, length, memory.memfd, MemoryLocation{});
  } catch (...) {
    memory.release();
    throw;
  }
  std::lock_guard<std::mutex> lock(alloc_mu_);
  allocations_[addr] = memory;
  return addr;
}

void Engine::unregister_region(uint64_t addr) {
  auto removed = regions_.remove(addr, ctx_.options.unregister_timeout_ms);
  if (!removed) TIDEKV_THROW(kNotRegistered, "no registered region starts at " + hex(addr) + " on engine " + name());
  for (auto& t : transports_) t->on_unregister(*removed);
  std::lock_guard<std::mutex> lock(alloc_mu_);
  auto it = allocations_.find(addr);
  if (it != allocations_.end()) {
    it->second.release();
    allocations_.erase(it);
  }
}

std::string Engine::region_proof(const std::string& context, uint64_t addr, uint64_t length) const {
  if (context.size() != 32) TIDEKV_THROW(kConfig, "a region proof's context is 32 bytes, not " + std::to_string(context.size()));
  if (length == 0 || !regions_.find(addr, length))
    TIDEKV_THROW(kNotRegistered, "[" + hex(addr) + ", +" + std::to_string(length) +
                                     ") is not inside a live region of this engine; only its own memory has a proof");
  Digest mac = region_proof_mac(proof_key_, reinterpret_cast<const uint8_t*>(context.data()), addr, length);
  return std::string(reinterpret_cast<const char*>(mac.data()), mac.size());
}

wire::Status Engine::verify_region(const wire::RegionProof& proof) const {
  if (proof.length == 0 || !regions_.find(proof.base, proof.length)) return wire::Status::kNotRegistered;
  Digest mac = region_proof_mac(proof_key_, proof.context, proof.base, proof.length);
  uint8_t diff = 0;
  for (size_t i = 0; i < mac.size(); ++i) diff |= uint8_t(mac[i] ^ proof.mac[i]);
  return diff == 0 ? wire::Status::kOk : wire::Status::kAuthFailed;
}

std::string Engine::fetch_descriptor(const std::string& host, int port) {
  std::string what = host + ":" + std::to_string(port);
  SocketOptions sopts{ctx_.options.socket_buffer_bytes, std::min(ctx_.options.io_timeout_ms, 10000)};
  int fd = connect_tcp(host, port, sopts);
  try {
    SocketReader reader(fd, what);
    Descriptor d = client_handshake(fd, reader, wire::ConnType::kDescriptor, 0, ctx_.instance, ctx_.options.secret, what);
    ::close(fd);
    return d.encode();
  } catch (...) {
    ::close(fd);
    throw;
  }
}

PeerAddress Engine::address_of(Peer& peer) {
  Peer* p = &peer;
  return PeerAddress{peer.name, peer.host, peer.port, [this, p](const Descriptor& fresh) {
                       {
                         std::lock_guard<std::mutex> lock(p->mu);
                         if (fresh.same_instance(p->descriptor)) return;
                       }
                       ctx_.log.emit(LogLevel::kInfo, "peer " + p->name + " restarted (new descriptor)");
                       relink(*p, fresh);
                     }};
}

void Engine::relink(Peer& peer, const Descriptor& d) {
  // A link whose peer section is unchanged and still current stays (tcp's, whose connections
  // outlive a peer restart on the same address); the others are replaced. Tasks already planned
  // on a replaced link keep it alive until they finish.
  std::vector<size_t> replace;
  std::vector<const std::string*> sections;
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(peer.mu);
    bool fresh = peer.links.empty();
    peer.links.resize(transports_.size());
    for (size_t i = 0; i < transports_.size(); ++i) {
      if (!availability_[i].available) continue;
      uint16_t id = uint16_t(transports_[i]->id());
      const std::string* before = fresh ? nullptr : peer.descriptor.section(id);
      const std::string* after = d.section(id);
      bool same = !fresh && (before == after || (before && after && *before == *after));
      if (same && (!peer.links[i] || peer.links[i]->is_current())) continue;
      replace.push_back(i);
      sections.push_back(after);  // points into `d`, which outlives this call
    }
    generation = ++peer.generation;
    if (replace.empty()) {
      peer.descriptor = d;
      return;
    }
  }
  PeerAddress address = address_of(peer);
  std::vector<std::shared_ptr<PeerLink>> made(replace.size());
  try {
    for (size_t k = 0; k < replace.size(); ++k) made[k] = transports_[replace[k]]->connect(address, sections[k]);
  } catch (...) {
    for (auto& link : made)
      if (link) link->close();
    throw;
  }
  std::vector<std::shared_ptr<PeerLink>> retired;
  {
    std::lock_guard<std::mutex> lock(peer.mu);
    if (peer.generation != generation || closed_.load()) {
      // A relink begun later installs its own links; a closed engine (close() sets closed_
      // before it closes the links under this lock) takes none.
      retired = std::move(made);
    } else {
      for (size_t k = 0; k < replace.size(); ++k) {
        retired.push_back(std::move(peer.links[replace[k]]));
        peer.links[replace[k]] = std::move(made[k]);
      }
      peer.descriptor = d;
    }
  }
  for (auto& link : retired)
    if (link) link->close();
}

uint32_t Engine::add_peer(const std::string& name, const std::string& descriptor) {
  TIDEKV_CHECK(!closed_.load(), kClosed, "engine " + this->name() + " is closed");
  Descriptor d = Descriptor::decode(descriptor, name);
  std::string host;
  int port = 0;
  split_host_port(name, &host, &port);
  Peer* peer;
  uint32_t id;
  bool is_new = false;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peer_ids_.find(name);
    if (it != peer_ids_.end()) {
      id = it->second;
      peer = peers_[id].get();
    } else {
      id = uint32_t(peers_.size());
      peers_.push_back(std::make_unique<Peer>());
      peer = peers_.back().get();
      peer->name = name;
      peer->host = host;
      peer->port = port;
      is_new = true;
    }
  }
  relink(*peer, d);
  if (!is_new) return id;
  // A new peer's name resolves only once its links are in place (relink connects without the
  // peer's lock): a submit naming it meanwhile is told it is unknown and connects it itself.
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto [it, inserted] = peer_ids_.emplace(name, id);
  if (!inserted) {  // another thread connected it first: use that one, drop this one's links
    std::lock_guard<std::mutex> plock(peer->mu);
    for (auto& link : peer->links)
      if (link) link->close();
    peer->links.clear();
  }
  return it->second;
}

uint32_t Engine::peer_id(const std::string& name) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto it = peer_ids_.find(name);
  if (it == peer_ids_.end()) TIDEKV_THROW(kConfig, "peer " + name + " is not known to engine " + this->name() + "; connect() it first");
  return it->second;
}

std::vector<std::string> Engine::peer_transports(const std::string& name) {
  Peer* peer;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peer_ids_.find(name);
    if (it == peer_ids_.end()) TIDEKV_THROW(kConfig, "peer " + name + " is not known to engine " + this->name());
    peer = peers_[it->second].get();
  }
  refresh_if_stale(*peer);
  std::lock_guard<std::mutex> plock(peer->mu);
  std::vector<std::pair<int, size_t>> ranked;  // best first, ties in registry order
  for (size_t i = 0; i < peer->links.size(); ++i) {
    if (!peer->links[i] || (forced_ >= 0 && int(i) != forced_)) continue;
    if (peer->links[i]->host_preference() <= 0) continue;  // moves no host memory (cuda)
    ranked.emplace_back(-peer->links[i]->host_preference(), i);
  }
  std::stable_sort(ranked.begin(), ranked.end());
  std::vector<std::string> out;
  for (auto& [score, i] : ranked) out.push_back(transports_[i]->name());
  return out;
}

bool Engine::has_stale_link(const Peer& peer) {
  for (const auto& link : peer.links)
    if (link && !link->is_current()) return true;
  return false;
}

void Engine::refresh_if_stale(Peer& peer) {
  {
    std::lock_guard<std::mutex> lock(peer.mu);
    if (!has_stale_link(peer)) return;
  }
  // The process behind the descriptor is gone; a new one may listen on the same address. Ask
  // it without holding the peer's lock (this can take up to the connect timeout).
  std::optional<Descriptor> fresh;
  try {
    fresh = Descriptor::decode(fetch_descriptor(peer.host, peer.port), peer.name);
  } catch (const Error&) {
    // Unreachable now: drop the stale links; what remains (tcp) reports the failure per request.
  }
  if (fresh) {
    relink(peer, *fresh);
    return;
  }
  std::lock_guard<std::mutex> lock(peer.mu);
  for (auto& link : peer.links)
    if (link && !link->is_current()) {
      link->close();
      link.reset();
    }
}

std::shared_ptr<Batch> Engine::submit(std::vector<Request> requests) {
  TIDEKV_CHECK(!closed_.load(), kClosed, "engine " + name() + " is closed");
  auto batch = std::make_shared<Batch>(std::move(requests));
  const auto& reqs = batch->requests();
  std::vector<MemoryLocation> locations(reqs.size());
  size_t npeers;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    npeers = peers_.size();
  }
  bool one_peer = true;
  uint64_t total = 0;
  for (uint32_t i = 0; i < reqs.size(); ++i) {
    const Request& r = reqs[i];
    if (r.length == 0) TIDEKV_THROW(kConfig, "request " + std::to_string(i) + " has length 0");
    if (r.peer >= npeers) TIDEKV_THROW(kConfig, "request " + std::to_string(i) + " names an unknown peer id");
    auto guard = regions_.acquire(r.local_addr, r.length, /*is_local=*/true);
    if (!guard)
      TIDEKV_THROW(kNotRegistered, "request " + std::to_string(i) + ": local range [" + hex(r.local_addr) + ", +" +
                                       std::to_string(r.length) + ") is not inside a region registered on engine " +
                                       name() + "; register() it first");
    locations[i] = guard->view().location;
    batch->hold(std::move(*guard));
    one_peer = one_peer && r.peer == reqs[0].peer;
    total += r.length;
  }
  bool all_local = true;
  auto plan = [&](uint32_t peer_id, const std::vector<uint32_t>& idx) {
    Peer* peer;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      peer = peers_[peer_id].get();
    }
    plan_peer(batch, *peer, idx, locations, &all_local);
  };
  if (reqs.empty()) {
  } else if (one_peer) {
    std::vector<uint32_t> idx(reqs.size());
    for (uint32_t i = 0; i < idx.size(); ++i) idx[i] = i;
    plan(reqs[0].peer, idx);
  } else {
    std::map<uint32_t, std::vector<uint32_t>> by_peer;
    for (uint32_t i = 0; i < reqs.size(); ++i) by_peer[reqs[i].peer].push_back(i);
    for (auto& [id, idx] : by_peer) plan(id, idx);
  }
  batch->seal();
  ctx_.counters.batches.fetch_add(1, std::memory_order_relaxed);
  const auto& tasks = batch->tasks();
  if (all_local && total <= ctx_.options.inline_bytes) {
    // A small same-host copy costs less than waking a worker: do it before returning.
    for (const auto& t : tasks) t->try_run();
    return batch;
  }
  if (tasks.size() == 1 && total <= ctx_.options.defer_bytes) {
    // One small task: the submitter usually waits right away and runs it itself (a hand-off to
    // a worker costs a wake-up on each side). A worker still takes it after a grace period, so
    // a batch nobody waits for makes progress.
    defer(tasks.front());
    return batch;
  }
  enqueue(batch);
  return batch;
}

void Engine::defer(const std::shared_ptr<Task>& task) {
  auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(ctx_.options.defer_grace_us);
  task->defer_until(until);
  task->set_on_claim([this] { deferred_claimed(); });
  std::lock_guard<std::mutex> lock(queue_mu_);
  deferred_.push_back(task);
  // No thread is woken here. Waking a worker to watch the deadline of every small request
  // cost more than the request itself on a 2-vCPU host: 2 context switches and ~6 futex calls
  // per request, and the woken thread took a core from the two busy with the request
  // (a 4 KiB store put: ~6.5 futex calls per put, a worker wake-up per put).
  if (!is_timer_armed_) arm_defer_timer(until);
}

void Engine::arm_defer_timer(std::chrono::steady_clock::time_point when) {
  if (defer_timer_fd_ < 0) return;
  itimerspec spec{};
  if (when != std::chrono::steady_clock::time_point{}) {
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(when.time_since_epoch()).count();
    spec.it_value.tv_sec = time_t(ns / 1000000000);
    spec.it_value.tv_nsec = long(ns % 1000000000);
    if (spec.it_value.tv_sec == 0 && spec.it_value.tv_nsec == 0) spec.it_value.tv_nsec = 1;  // (zero disarms)
  }
  timerfd_settime(defer_timer_fd_, TFD_TIMER_ABSTIME, &spec, nullptr);
  is_timer_armed_ = when != std::chrono::steady_clock::time_point{};
}

void Engine::deferred_claimed() {
  std::lock_guard<std::mutex> lock(queue_mu_);
  while (!deferred_.empty() && deferred_.front()->is_claimed()) deferred_.pop_front();
  // With tasks left the timer stays set for an earlier deadline; the watcher re-arms it.
  if (deferred_.empty() && is_timer_armed_) arm_defer_timer({});
}

void Engine::watch_deferred() {
  for (;;) {
    uint64_t expirations = 0;
    ssize_t n = ::read(defer_timer_fd_, &expirations, sizeof(expirations));
    if (closed_.load()) return;
    if (n < 0 && errno != EINTR && errno != EAGAIN) {
      ctx_.log.emit_once("defer-timer", LogLevel::kError,
                         std::string("the engine's timer failed; small batches nobody waits for may stall: ") +
                             strerror(errno));
      return;
    }
    size_t due = 0;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      is_timer_armed_ = false;
      auto now = std::chrono::steady_clock::now();
      while (!deferred_.empty()) {
        auto& front = deferred_.front();
        if (!front->is_claimed()) {
          if (front->deferred_until() > now) break;
          queue_.push_back(std::move(front));  // nobody waited for it: a worker runs it
          ++due;
        }
        deferred_.pop_front();
      }
      if (!deferred_.empty()) arm_defer_timer(deferred_.front()->deferred_until());
    }
    if (due == 1)
      queue_cv_.notify_one();
    else if (due > 1)
      queue_cv_.notify_all();
  }
}

void Engine::plan_peer(const std::shared_ptr<Batch>& batch, Peer& peer, const std::vector<uint32_t>& requests,
                       const std::vector<MemoryLocation>& locations, bool* all_local) {
  std::unique_lock<std::mutex> plock(peer.mu);
  if (has_stale_link(peer)) {  // (checked under the lock planning takes anyway: one lock per peer and batch)
    plock.unlock();
    refresh_if_stale(peer);
    plock.lock();
  }
  const auto& reqs = batch->requests();
  const size_t nlinks = peer.links.size();
  // Per request, the link that rates it highest; requests grouped by link in one pass each.
  std::vector<int8_t> choice(requests.size(), -1);
  uint32_t chosen_mask = 0;
  for (size_t k = 0; k < requests.size(); ++k) {
    uint32_t i = requests[k];
    const Request& r = reqs[i];
    int best = -1, best_score = 0;
    for (size_t j = 0; j < nlinks; ++j) {
      if (!peer.links[j] || (forced_ >= 0 && int(j) != forced_)) continue;
      int score = peer.links[j]->preference(r, locations[i]);
      if (score > best_score) best = int(j), best_score = score;
    }
    if (best < 0) {
      batch->fail_slice(i, ErrorKind::kTransfer, no_route(peer, r, locations[i]));
      continue;
    }
    choice[k] = int8_t(best);
    chosen_mask |= 1u << best;
  }
  std::vector<uint32_t> group;
  for (size_t j = 0; j < nlinks; ++j) {
    if (!(chosen_mask & (1u << j))) continue;
    group.clear();
    for (size_t k = 0; k < requests.size(); ++k)
      if (choice[k] == int8_t(j)) group.push_back(requests[k]);
    size_t first_task = batch->tasks().size();
    peer.links[j]->plan(batch, group);
    bool is_local = peer.links[j]->is_local_copy();
    if (is_local)
      for (size_t t = first_task; t < batch->tasks().size(); ++t) batch->tasks()[t]->set_local_copy();
    *all_local = *all_local && is_local;
  }
}

std::string Engine::no_route(const Peer& peer, const Request& r, MemoryLocation local) const {
  std::string what = std::string(r.op == wire::Op::kRead ? "READ" : "WRITE") + " of " + local.str() +
                     " memory with peer " + peer.name;
  if (forced_ >= 0) {
    const auto& link = peer.links.size() > size_t(forced_) ? peer.links[forced_] : nullptr;
    return "transport '" + std::string(transports_[forced_]->name()) + "' is forced (TransferConfig.transport) but " +
           "cannot serve this " + what + ": " +
           (link ? link->refusal(r, local) : "the peer is not reachable by it (not on this host, or it does not offer it)");
  }
  std::string why;
  for (size_t j = 0; j < peer.links.size(); ++j)
    if (peer.links[j]) why += std::string(why.empty() ? "" : "; ") + peer.links[j]->refusal(r, local);
  return "no transport can serve this " + what + (why.empty() ? "" : ": " + why);
}

void Engine::enqueue(const std::shared_ptr<Batch>& batch) {
  const auto& tasks = batch->tasks();
  if (tasks.empty()) return;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    for (const auto& t : tasks) queue_.push_back(t);
  }
  if (tasks.size() == 1)
    queue_cv_.notify_one();
  else
    queue_cv_.notify_all();
}

void Engine::worker_loop() {
  std::unique_lock<std::mutex> lock(queue_mu_);
  for (;;) {
    queue_cv_.wait(lock, [&] { return !queue_.empty() || closed_.load(); });
    if (queue_.empty()) return;  // closed and drained (close() runs what is deferred)
    std::shared_ptr<Task> task = std::move(queue_.front());
    queue_.pop_front();
    if (task->is_claimed()) continue;
    lock.unlock();
    task->try_run();
    task.reset();  // (outside the lock: it may hold the last reference to its batch)
    lock.lock();
  }
}

}  // namespace tidekv
