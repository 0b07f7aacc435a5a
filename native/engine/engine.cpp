#include "engine/engine.h"

#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include "common/errors.h"
#include "engine/handshake.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it and the fallback touches each page
#endif

namespace tidekv {
namespace {

void fill_random(uint8_t* out, size_t n) {
  std::random_device rd;
  for (size_t i = 0; i < n; ++i) out[i] = uint8_t(rd());
}

std::string hex(uint64_t v) {
  char b[24];
  snprintf(b, sizeof(b), "0x%llx", (unsigned long long)v);
  return b;
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
    : ctx_{std::move(options), {}, {}},
      regions_([&] {
        fill_random(token_, sizeof(token_));
        return RegionTable::create(ctx_.options.max_regions, token_);
      }()) {
  if (ctx_.options.enable_cross_memory_attach) {
    // Lets same-host peers use process_vm_readv/writev on us under Yama ptrace_scope=1.
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  }
  self_.magic = wire::kMagic;
  self_.version = wire::kProtocolVersion;
  self_.pid = getpid();
  self_.table_fd = regions_.fd();
  std::memcpy(self_.token, token_, sizeof(token_));
  self_.token_addr = reinterpret_cast<uint64_t>(token_);
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(boot, boot_id);
  std::strncpy(self_.boot_id, boot_id.c_str(), sizeof(self_.boot_id) - 1);
  ctx_.enqueue_task = [this](std::shared_ptr<Task> task) {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (!closed_.load()) {
        queue_.push_back(std::move(task));
        queue_cv_.notify_one();
        return;
      }
    }
    task->try_run();  // no workers any more: run it here (transports are closed, it fails fast)
  };
  server_ = std::make_unique<Server>(ctx_, regions_, self_);
  int n = std::max(1, ctx_.options.worker_threads);
  for (int i = 0; i < n; ++i) workers_.emplace_back([this] { worker_loop(); });
}

Engine::~Engine() { close(); }

std::string Engine::name() const {
  const std::string& h = ctx_.options.host;
  std::string host = h.find(':') != std::string::npos ? "[" + h + "]" : h;
  return host + ":" + std::to_string(server_->port());
}

void Engine::close() {
  if (closed_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    for (auto& p : peers_) {
      if (p->tcp) p->tcp->close();
      if (p->shm) p->shm->close();
    }
  }
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queue_cv_.notify_all();
  }
  for (auto& w : workers_) w.join();
  workers_.clear();
  std::deque<std::shared_ptr<Task>> leftover;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    leftover.swap(queue_);
  }
  for (auto& task : leftover) task->try_run();
  server_->stop();
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
  if (location != "cpu")
    TIDEKV_THROW(kConfig, "location '" + location + "' is not supported by this build (only 'cpu')");
  regions_.add(addr, length, -1, location);
}

void Engine::Allocation::release() {
  munmap(base, mapped);
  if (memfd >= 0) ::close(memfd);
}

uint64_t Engine::allocate(uint64_t length, bool huge) {
  TIDEKV_CHECK(!closed_.load(), kClosed, "engine " + name() + " is closed");
  TIDEKV_CHECK(length > 0, kConfig, "allocate() needs a size > 0");
  Allocation a;
  uint8_t* start = nullptr;
  if (huge) {
    // Private anonymous memory on 2 MiB boundaries with transparent huge pages: same-host peers
    // reach it by cross-memory attach instead of mapping it, and reads of it stay fast after it
    // sat idle (on some VMs idle 4 KiB pages read 3-4x slower the first time; huge pages do not).
    constexpr uint64_t kHuge = 2ull << 20;
    a.mapped = (length + kHuge - 1) / kHuge * kHuge + kHuge;
    a.base = mmap(nullptr, a.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a.base == MAP_FAILED)
      TIDEKV_THROW(kConfig, "cannot map " + std::to_string(length) + " bytes of memory: " + strerror(errno));
    uint64_t b = reinterpret_cast<uint64_t>(a.base);
    start = reinterpret_cast<uint8_t*>((b + kHuge - 1) / kHuge * kHuge);
    madvise(start, length, MADV_HUGEPAGE);  // advisory: without THP the memory is still usable
    // Fault it in now (huge pages where the kernel has them) rather than inside the first transfers.
    if (madvise(start, length, MADV_POPULATE_WRITE) != 0) {
      if (errno != EINVAL) {  // EINVAL: a kernel before 5.14; anything else: the memory is not there
        int err = errno;
        a.release();
        TIDEKV_THROW(kConfig, "cannot allocate " + std::to_string(length) + " bytes of memory: " + strerror(err));
      }
      for (uint64_t off = 0; off < length; off += 4096) start[off] = 0;
    }
  } else {
    a.memfd = memfd_create("tidekv-buffer", MFD_CLOEXEC);
    if (a.memfd < 0) TIDEKV_THROW(kConfig, std::string("memfd_create failed: ") + strerror(errno));
    if (ftruncate(a.memfd, off_t(length)) != 0) {
      ::close(a.memfd);
      TIDEKV_THROW(kConfig, "cannot allocate " + std::to_string(length) + " bytes of shared memory: " + strerror(errno));
    }
    // MAP_POPULATE: pay the page faults now rather than inside the first transfers into it.
    a.mapped = length;
    a.base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, a.memfd, 0);
    if (a.base == MAP_FAILED) {
      ::close(a.memfd);
      TIDEKV_THROW(kConfig, "cannot map " + std::to_string(length) + " bytes of shared memory: " + strerror(errno));
    }
    start = static_cast<uint8_t*>(a.base);
  }
  uint64_t addr = reinterpret_cast<uint64_t>(start);
  try {
    regions_.add(addr, length, a.memfd, "cpu");
  } catch (...) {
    a.release();
    throw;
  }
  std::lock_guard<std::mutex> lock(alloc_mu_);
  allocations_[addr] = a;
  return addr;
}

void Engine::unregister_region(uint64_t addr) {
  auto removed = regions_.remove(addr, ctx_.options.unregister_timeout_ms);
  if (!removed) TIDEKV_THROW(kNotRegistered, "no registered region starts at " + hex(addr) + " on engine " + name());
  std::lock_guard<std::mutex> lock(alloc_mu_);
  auto it = allocations_.find(addr);
  if (it != allocations_.end()) {
    it->second.release();
    allocations_.erase(it);
  }
}

wire::Descriptor Engine::fetch_descriptor(const std::string& host, int port) {
  std::string what = host + ":" + std::to_string(port);
  SocketOptions sopts{ctx_.options.socket_buffer_bytes, std::min(ctx_.options.io_timeout_ms, 10000)};
  int fd = connect_tcp(host, port, sopts);
  try {
    SocketReader reader(fd, what);
    wire::Descriptor d = client_handshake(fd, reader, wire::ConnType::kDescriptor, ctx_.options.secret, what);
    ::close(fd);
    return d;
  } catch (...) {
    ::close(fd);
    throw;
  }
}

void Engine::refresh_same_host(Peer& peer, const wire::Descriptor& d) {
  // Called with peer.mu held.
  if (ctx_.options.transport == TransportChoice::kTcp) return;
  if (peer.shm && std::memcmp(peer.shm->token(), d.token, sizeof(d.token)) == 0) return;
  if (peer.shm) peer.shm->close();
  peer.shm = ShmTransport::open(ctx_, peer.name, d);
}

uint32_t Engine::add_peer(const std::string& name, const wire::Descriptor& d) {
  TIDEKV_CHECK(!closed_.load(), kClosed, "engine " + this->name() + " is closed");
  if (d.magic != wire::kMagic) TIDEKV_THROW(kConfig, "descriptor for peer '" + name + "' is malformed");
  if (d.version != wire::kProtocolVersion)
    TIDEKV_THROW(kProtocolVersion, "peer " + name + " speaks tidekv transfer protocol v" + std::to_string(d.version) +
                                       ", this engine speaks v" + std::to_string(wire::kProtocolVersion));
  std::string host;
  int port = 0;
  split_host_port(name, &host, &port);
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto it = peer_ids_.find(name);
  Peer* peer;
  uint32_t id;
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
    peer->tcp = std::make_unique<TcpTransport>(ctx_, name, host, port, [this, peer](const wire::Descriptor& fresh) {
      std::lock_guard<std::mutex> plock(peer->mu);
      if (std::memcmp(fresh.token, peer->descriptor.token, sizeof(fresh.token)) != 0) {
        ctx_.log.emit(LogLevel::kInfo, "peer " + peer->name + " restarted (new descriptor)");
        peer->descriptor = fresh;
        refresh_same_host(*peer, fresh);
      }
    });
    peer_ids_[name] = id;
  }
  std::lock_guard<std::mutex> plock(peer->mu);
  peer->descriptor = d;
  refresh_same_host(*peer, d);
  return id;
}

uint32_t Engine::peer_id(const std::string& name) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto it = peer_ids_.find(name);
  if (it == peer_ids_.end()) TIDEKV_THROW(kUnknownPeer, name);
  return it->second;
}

std::string Engine::peer_transport(const std::string& name) {
  Peer* peer;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peer_ids_.find(name);
    if (it == peer_ids_.end()) TIDEKV_THROW(kUnknownPeer, name);
    peer = peers_[it->second].get();
  }
  std::lock_guard<std::mutex> plock(peer->mu);
  return peer->shm ? "shm" : "tcp";
}

std::shared_ptr<Batch> Engine::submit(std::vector<Request> requests) {
  TIDEKV_CHECK(!closed_.load(), kClosed, "engine " + name() + " is closed");
  auto batch = std::make_shared<Batch>(std::move(requests));
  const auto& reqs = batch->requests();
  std::map<uint32_t, std::vector<uint32_t>> by_peer;
  size_t npeers;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    npeers = peers_.size();
  }
  for (uint32_t i = 0; i < reqs.size(); ++i) {
    const Request& r = reqs[i];
    if (r.length == 0) TIDEKV_THROW(kConfig, "request " + std::to_string(i) + " has length 0");
    if (r.peer >= npeers) TIDEKV_THROW(kConfig, "request " + std::to_string(i) + " names an unknown peer id");
    auto guard = regions_.acquire(r.local_addr, r.length, /*is_local=*/true);
    if (!guard)
      TIDEKV_THROW(kNotRegistered, "request " + std::to_string(i) + ": local range [" + hex(r.local_addr) + ", +" +
                                       std::to_string(r.length) + ") is not inside a region registered on engine " +
                                       name() + "; register() it first");
    batch->hold(std::move(*guard));
    by_peer[r.peer].push_back(i);
  }
  for (auto& [id, idx] : by_peer) {
    Peer* peer;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      peer = peers_[id].get();
    }
    plan_peer(batch, *peer, idx);
  }
  batch->seal();
  ctx_.counters.batches.fetch_add(1, std::memory_order_relaxed);
  uint64_t total = 0;
  for (const auto& r : reqs) total += r.length;
  bool all_shm = true;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    for (auto& entry : by_peer) all_shm = all_shm && peers_[entry.first]->shm != nullptr;
  }
  const auto& tasks = batch->tasks();
  if (all_shm && total <= ctx_.options.inline_bytes) {
    // A small same-host copy costs less than waking a worker: do it before returning.
    for (const auto& t : tasks) t->try_run();
    return batch;
  }
  if (tasks.size() == 1 && total <= ctx_.options.defer_bytes) {
    // One small task: the submitter usually waits right away and runs it itself (a hand-off to
    // a worker costs a wake-up on each side). A worker still takes it after a grace period, so
    // a batch nobody waits for makes progress.
    tasks.front()->defer_until(std::chrono::steady_clock::now() +
                               std::chrono::microseconds(ctx_.options.defer_grace_us));
  }
  enqueue(batch);
  return batch;
}

void Engine::plan_peer(const std::shared_ptr<Batch>& batch, Peer& peer, const std::vector<uint32_t>& requests) {
  std::lock_guard<std::mutex> plock(peer.mu);
  if (peer.shm && !peer.shm->is_peer_alive()) {
    // The process behind the cached descriptor is gone; a new one may listen on the same port.
    peer.shm.reset();
    try {
      wire::Descriptor d = fetch_descriptor(peer.host, peer.port);
      peer.descriptor = d;
      refresh_same_host(peer, d);
    } catch (const Error&) {
      // Unreachable now: plan over tcp, whose connect reports the failure per request.
    }
  }
  const auto& reqs = batch->requests();
  std::vector<uint32_t> via_shm, via_tcp;
  for (uint32_t i : requests) {
    const Request& r = reqs[i];
    bool shm_ok = peer.shm && peer.shm->can_serve(r.remote_addr, r.length);
    if (ctx_.options.transport == TransportChoice::kShm && !shm_ok) {
      batch->fail_slice(i, ErrorKind::kTransfer,
                        "transport 'shm' is forced but peer " + peer.name +
                            (peer.shm ? " cannot be reached by shared memory for this range"
                                      : " is not on this host (or its memory is not reachable from here)"));
      continue;
    }
    (shm_ok ? via_shm : via_tcp).push_back(i);
  }
  if (!via_shm.empty()) peer.shm->plan(batch, via_shm);
  if (!via_tcp.empty()) peer.tcp->plan(batch, via_tcp);
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
  for (;;) {
    std::shared_ptr<Task> task;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return !queue_.empty() || closed_.load(); });
      if (queue_.empty()) return;  // closed and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    auto until = task->deferred_until();
    if (until > std::chrono::steady_clock::now() && !task->is_claimed()) std::this_thread::sleep_until(until);
    task->try_run();
  }
}

}  // namespace tidekv
