#include "fabric/fabric_link.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/errors.h"
#include "common/handshake.h"
#include "common/text.h"
#include "common/wire.h"

namespace tidekv::fabric {
namespace {

std::string range_text(wire::Op op, uint64_t addr, uint64_t length) {
  return tidekv::range_text(op == wire::Op::kRead ? "READ" : "WRITE", addr, length);
}

ErrorKind kind_of(int err) {
  switch (err) {
    case FI_ETIMEDOUT:
      return ErrorKind::kTimeout;
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_ENOTCONN:
    case FI_EHOSTUNREACH:
    case FI_ENETUNREACH:
    case FI_ESHUTDOWN:
    case FI_ECANCELED:
    case FI_EIO:
      return ErrorKind::kPeerUnavailable;
    case FI_EKEYREJECTED:
    case FI_EACCES:
      return ErrorKind::kNotRegistered;
    default:
      return ErrorKind::kTransfer;
  }
}

// An RMA operation costs the provider a fixed amount however large it is (a software provider a
// wake-up of the target): pieces smaller than this only add operations (README, Benchmarks:
// "fabric").
constexpr uint64_t kMinSlice = 1 << 20;

bool covers(const FabricLink::Remote& r, uint64_t addr, uint64_t length) {
  return addr >= r.base && length <= r.length && addr - r.base <= r.length - length;
}

}  // namespace

// One plan()'s requests: per request, the slices still in flight and its first error; the
// writes that landed and wait for the read that confirms them (without delivery-complete).
struct FabricLink::Group {
  struct State {
    std::atomic<uint32_t> left{0};
    std::mutex mu;
    bool failed = false;
    ErrorKind kind = ErrorKind::kTransfer;
    std::string message;
    std::shared_ptr<Remote> remote;
  };
  std::shared_ptr<Batch> batch;
  std::shared_ptr<FabricLink> link;
  std::vector<uint32_t> requests;
  std::unique_ptr<State[]> state;  // by request index in the batch
  std::atomic<uint32_t> writes_left{0};
  std::atomic<uint32_t> write_rails{0};  // bit k: a write went over rail k (its own confirming read)
  std::mutex mu;
  std::vector<uint32_t> landed;  // writes waiting for the confirming reads
};

namespace {

struct SliceOp final : Op {
  std::shared_ptr<FabricLink::Group> group;
  uint32_t request;
  std::shared_ptr<FabricLink::Remote> remote;
  uint32_t rail;
  void finish(int err, const std::string& message) override {
    group->link->slice_finished(group, request, remote, rail, err, message);
  }
};

}  // namespace

FabricLink::FabricLink(EngineContext& ctx, std::vector<Rail> rails, PeerAddress peer)
    : ctx_(ctx),
      delivery_complete_(rails.front().domain->has_delivery_complete()),
      max_message_(rails.front().domain->max_message()),
      peer_(std::move(peer)) {
  for (Rail& r : rails) {
    rails_.push_back(std::make_unique<Path>(std::move(r)));
    rails_.back()->addr = rails_.back()->domain->insert_peer(rails_.back()->endpoint);
  }
}

uint32_t FabricLink::rails_for(int numa_node, const Remote& remote, uint32_t out[kMaxRails]) const {
  const uint32_t usable = uint32_t(std::min(rails_.size(), remote.keys.size()));
  uint32_t n = 0;
  if (numa_node >= 0)
    for (uint32_t k = 0; k < usable; ++k)
      if (rails_[k]->domain->numa_node() == numa_node) out[n++] = k;
  if (n == 0)
    for (uint32_t k = 0; k < usable; ++k) out[n++] = k;
  return n;
}

FabricLink::~FabricLink() {
  close();
  if (reader_.joinable()) {
    if (reader_.get_id() == std::this_thread::get_id()) {
      reader_.detach();
    } else {
      reader_.join();
    }
  }
  if (control_fd_ >= 0) ::close(control_fd_);
}

int FabricLink::preference(const Request& r, MemoryLocation local) const {
  return local.kind == MemoryKind::kCpu ? 5 : 0;
}

std::string FabricLink::refusal(const Request& r, MemoryLocation local) const {
  return "fabric moves host memory only (this libfabric provider has no GPU memory support here), not " + local.str();
}

void FabricLink::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }
  std::lock_guard<std::mutex> lock(control_mu_);
  if (control_fd_ >= 0) ::shutdown(control_fd_, SHUT_RDWR);
}

void FabricLink::open_control() {
  std::lock_guard<std::mutex> lock(control_mu_);
  if (control_fd_ >= 0 && !control_lost_.load(std::memory_order_acquire)) return;
  if (control_fd_ >= 0) {  // the reader ended (it sends nothing more): start over
    if (reader_.joinable()) reader_.join();
    ::close(control_fd_);
    control_fd_ = -1;
    control_lost_.store(false);
  }
  {
    std::lock_guard<std::mutex> state(mu_);
    TIDEKV_CHECK(!closed_, kClosed, "engine closed");
  }
  SocketOptions options{64 << 10, ctx_.options.io_timeout_ms};
  int fd = connect_tcp(peer_.host, peer_.port, options);
  auto reader = std::make_shared<SocketReader>(fd, peer_.name);
  try {
    Descriptor d = client_handshake(fd, *reader, wire::ConnType::kData, uint16_t(TransportId::kFabric), ctx_.instance,
                                    ctx_.options.secret, peer_.name);
    if (peer_.on_descriptor) peer_.on_descriptor(d);
  } catch (...) {
    ::close(fd);
    throw;
  }
  control_fd_ = fd;
  reader_ = std::thread([this, reader] {
    try {
      for (;;) {
        Msg m{};
        reader->read_exact(&m, sizeof(m), true);
        if (m.magic != kMsgMagic) TIDEKV_THROW(kTransfer, "peer " + peer_.name + " sent a malformed fabric frame");
        if (m.kind == uint32_t(MsgKind::kRegion)) {
          std::lock_guard<std::mutex> state(mu_);
          std::shared_ptr<Remote> remote;
          if (m.status == uint32_t(wire::Status::kOk) && m.rails >= 1 && m.rails <= kMaxRails) {
            remote = std::make_shared<Remote>();
            remote->base = m.addr;
            remote->length = m.length;
            remote->keys.assign(m.keys, m.keys + m.rails);
            cache_[m.addr] = remote;
          }
          auto it = answers_.find(m.tag);
          if (it != answers_.end()) it->second = Answer{true, m.status, remote};
          cv_.notify_all();
        } else if (m.kind == uint32_t(MsgKind::kRevoke)) {
          {
            // Forget the region, then wait until nothing of ours is in flight to it.
            std::unique_lock<std::mutex> state(mu_);
            auto it = cache_.find(m.addr);
            if (it != cache_.end() && it->second->keys.front() == m.keys[0]) {
              std::shared_ptr<Remote> remote = it->second;
              remote->revoked = true;
              cache_.erase(it);
              cv_.wait_for(state, std::chrono::milliseconds(ctx_.options.io_timeout_ms),
                           [&] { return remote->inflight == 0 || closed_; });
            }
          }
          send(Msg{kMsgMagic, uint32_t(MsgKind::kRevokeAck), m.tag, m.addr, 0, 0, 1, {m.keys[0]}});
        }
      }
    } catch (const std::exception&) {
    }
    // No revoke can reach us now: forget every region (operations in flight finish as they will).
    std::lock_guard<std::mutex> state(mu_);
    for (auto& [base, remote] : cache_) remote->revoked = true;
    cache_.clear();
    control_lost_.store(true, std::memory_order_release);
    cv_.notify_all();
  });
}

void FabricLink::check_peer() {
  if (!control_lost_.load(std::memory_order_acquire)) return;
  try {
    open_control();  // a live peer answers (a restarted one is reported by the handshake)
  } catch (const Error& e) {
    throw Error(e.kind(),
                std::string("the peer's fabric control connection closed and it takes no new one (") + e.what() +
                    "): it is gone, so the provider's connection to it will not come back",
                e.file(), e.line());
  }
}

void FabricLink::send(const Msg& m) {
  std::lock_guard<std::mutex> lock(control_mu_);
  TIDEKV_CHECK(control_fd_ >= 0, kPeerUnavailable, "no fabric control connection to peer " + peer_.name);
  send_all(control_fd_, &m, sizeof(m), peer_.name);
}

std::shared_ptr<FabricLink::Remote> FabricLink::resolve(uint64_t addr, uint64_t length, uint32_t* status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.upper_bound(addr);
    if (it != cache_.begin() && covers(*std::prev(it)->second, addr, length)) return std::prev(it)->second;
  }
  open_control();
  uint64_t tag;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tag = next_tag_++;
    answers_[tag] = Answer{};
  }
  send(Msg{kMsgMagic, uint32_t(MsgKind::kLookup), tag, addr, length, 0, 0, {}});
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::milliseconds(ctx_.options.io_timeout_ms),
               [&] { return answers_[tag].answered || closed_ || control_lost_.load(); });
  Answer a = answers_[tag];
  answers_.erase(tag);
  if (!a.answered) {
    if (closed_) TIDEKV_THROW(kClosed, "engine closed");
    if (control_lost_.load()) TIDEKV_THROW(kPeerUnavailable, "peer " + peer_.name + " closed the fabric control connection");
    TIDEKV_THROW(kTimeout, "peer " + peer_.name + " did not answer a fabric region lookup in io_timeout_ms");
  }
  *status = a.status;
  if (a.remote && (a.remote->revoked || !covers(*a.remote, addr, length))) {
    *status = uint32_t(wire::Status::kNotRegistered);
    return nullptr;
  }
  return a.remote;
}

void FabricLink::plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) {
  auto g = std::make_shared<Group>();
  g->batch = batch;
  g->link = shared_from_this();
  g->requests = requests;
  g->state.reset(new Group::State[batch->requests().size()]);
  for (uint32_t r : requests) {
    batch->expect_slices(r, 1);  // one report per request, once all its pieces have finished
    if (batch->requests()[r].op == wire::Op::kWrite && !delivery_complete_) g->writes_left++;
  }
  batch->add_task(std::make_shared<Task>([g](const Deadline&) { g->link->run(g); }));
}

void FabricLink::run(const std::shared_ptr<Group>& g) {
  fi_addr_t addrs[kMaxRails];
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t k = 0; k < rails_.size(); ++k) {
      Path& rail = *rails_[k];
      if (rail.needs_new_address.exchange(false)) {
        // An operation to the peer failed on the connection: start from a fresh address entry, so
        // the provider connects again instead of reporting the dead connection.
        rail.domain->remove_peer(rail.addr);
        try {
          rail.addr = rail.domain->insert_peer(rail.endpoint);
        } catch (const Error&) {
          rail.needs_new_address.store(true);
        }
      }
      addrs[k] = rail.addr;
    }
  }
  const uint64_t slice = std::min<uint64_t>(std::max<uint64_t>(kMinSlice, ctx_.options.slice_bytes), max_message_);
  const std::function<void()> check = [this] { check_peer(); };
  for (uint32_t r : g->requests) {
    const Request& q = g->batch->requests()[r];
    Group::State& s = g->state[r];
    auto fail = [&](ErrorKind kind, const std::string& message) {
      {
        std::lock_guard<std::mutex> lock(s.mu);
        if (!s.failed) {
          s.failed = true;
          s.kind = kind;
          s.message = message;
        }
      }
    };
    uint32_t status = uint32_t(wire::Status::kOk);
    std::shared_ptr<Remote> remote;
    Registration local[kMaxRails]{};
    uint32_t chosen[kMaxRails];
    uint32_t n_rails = 0;
    try {
      remote = resolve(q.remote_addr, q.length, &status);
    } catch (const Error& e) {
      fail(e.kind(), std::string(e.what()) + " during " + range_text(q.op, q.remote_addr, q.length));
    }
    if (!s.failed && !remote) {
      fail(status == uint32_t(wire::Status::kNotHostMemory) ? ErrorKind::kTransfer : ErrorKind::kNotRegistered,
           "peer " + peer_.name + " refused " + range_text(q.op, q.remote_addr, q.length) +
               (status == uint32_t(wire::Status::kNotHostMemory)
                    ? ": the range is GPU memory there, which fabric does not move"
                    : ": not inside a region registered there"));
    }
    if (!s.failed) {
      if (!rails_.front()->domain->find(q.local_addr, q.length, &local[0])) {
        fail(ErrorKind::kNotRegistered, "the local range of " + range_text(q.op, q.local_addr, q.length) +
                                            " is not registered with the fabric provider");
      } else {
        n_rails = rails_for(local[0].numa_node, *remote, chosen);
        // Each chosen rail's own registration of the same memory (its local descriptor).
        for (uint32_t i = 0; i < n_rails && !s.failed; ++i)
          if (chosen[i] != 0 && !rails_[chosen[i]]->domain->find(q.local_addr, q.length, &local[chosen[i]]))
            fail(ErrorKind::kNotRegistered, "the local range of " + range_text(q.op, q.local_addr, q.length) +
                                                " is not registered on NIC " + rails_[chosen[i]]->domain->domain_name());
      }
    }
    uint32_t slices = uint32_t((q.length + slice - 1) / slice);
    if (!s.failed) {
      std::lock_guard<std::mutex> lock(mu_);
      if (remote->revoked) {
        s.failed = true;
        s.kind = ErrorKind::kNotRegistered;
        s.message = "peer " + peer_.name + " refused " + range_text(q.op, q.remote_addr, q.length) +
                    ": the region was unregistered there";
      } else {
        remote->inflight += slices;
      }
    }
    if (s.failed) {
      request_done(g, r);
      continue;
    }
    s.remote = remote;
    s.left.store(slices + 1);  // +1: this loop's own hold, released after the last post
    uint32_t posted = 0;
    const uint32_t first = next_rail_.fetch_add(1, std::memory_order_relaxed);
    for (uint64_t off = 0; off < q.length; off += slice, ++posted) {
      const uint32_t k = chosen[(first + posted) % n_rails];
      Domain& domain = *rails_[k]->domain;
      auto* op = new SliceOp();
      op->group = g;
      op->request = r;
      op->remote = remote;
      op->rail = k;
      uint64_t len = std::min(slice, q.length - off);
      if (q.op == wire::Op::kWrite) g->write_rails.fetch_or(1u << k, std::memory_order_relaxed);
      try {
        domain.post(q.op == wire::Op::kRead, op, q.local_addr + off, len, local[k].desc, addrs[k],
                    domain.remote_address(q.remote_addr + off, remote->base), remote->keys[k], check);
      } catch (const Error& e) {
        delete op;
        fail(e.kind(), "peer " + peer_.name + ": " + e.what() + " during " + range_text(q.op, q.remote_addr, q.length));
        break;
      }
    }
    uint32_t unposted = slices - posted;
    if (unposted) {
      std::lock_guard<std::mutex> lock(mu_);
      remote->inflight -= unposted;
      if (remote->inflight == 0 && remote->revoked) cv_.notify_all();
    }
    if (s.left.fetch_sub(unposted + 1) == unposted + 1) request_done(g, r);
  }
}

void FabricLink::slice_finished(const std::shared_ptr<Group>& g, uint32_t request, const std::shared_ptr<Remote>& remote,
                                uint32_t rail, int err, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--remote->inflight == 0 && remote->revoked) cv_.notify_all();
  }
  Group::State& s = g->state[request];
  if (err) {
    const Request& q = g->batch->requests()[request];
    ErrorKind kind = kind_of(err);
    if (kind == ErrorKind::kPeerUnavailable || kind == ErrorKind::kTimeout || kind == ErrorKind::kTransfer)
      rails_[rail]->needs_new_address.store(true);
    bool closed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed = closed_;
    }
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.failed) {
      s.failed = true;
      s.kind = closed ? ErrorKind::kClosed : kind;
      s.message = "peer " + peer_.name + ": fabric " + range_text(q.op, q.remote_addr, q.length) + " failed: " + message;
    }
  }
  if (s.left.fetch_sub(1) == 1) request_done(g, request);
}

void FabricLink::request_done(const std::shared_ptr<Group>& g, uint32_t request) {
  const Request& q = g->batch->requests()[request];
  Group::State& s = g->state[request];
  const bool is_write = q.op == wire::Op::kWrite;
  const bool confirm = is_write && !delivery_complete_;
  if (s.failed) {
    g->batch->fail_slice(request, s.kind, s.message);
  } else if (!confirm) {
    (is_write ? ctx_.counters.bytes_written : ctx_.counters.bytes_read).fetch_add(q.length, std::memory_order_relaxed);
    ctx_.counters.fabric_bytes.fetch_add(q.length, std::memory_order_relaxed);
    g->batch->complete_slice(request, q.length);
  } else {
    std::lock_guard<std::mutex> lock(g->mu);
    g->landed.push_back(request);
  }
  if (confirm && g->writes_left.fetch_sub(1) == 1) post_flush(g);
}

namespace {

// A read after a batch's writes on one rail (FI_ORDER_RAW): once it is back, they have landed.
struct FlushOp final : Op {
  std::function<void(int, const std::string&)> done;
  void finish(int err, const std::string& message) override { done(err, message); }
};

// The confirming reads of one batch, one per rail its writes went over: the writes are done when
// the last read is back, failed with the first read's error.
struct Flush {
  std::atomic<uint32_t> left{0};
  std::mutex mu;
  int err = 0;
  std::string message;
};

}  // namespace

void FabricLink::post_flush(const std::shared_ptr<Group>& g) {
  std::vector<uint32_t> landed;
  {
    std::lock_guard<std::mutex> lock(g->mu);
    landed.swap(g->landed);
  }
  if (landed.empty()) return;
  auto flush = std::make_shared<Flush>();
  auto finish = [this, g, landed, flush](int err, const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(flush->mu);
      if (err && !flush->err) {
        flush->err = err;
        flush->message = message;
      }
    }
    if (flush->left.fetch_sub(1) != 1) return;
    for (uint32_t r : landed) {
      const Request& q = g->batch->requests()[r];
      if (flush->err) {
        g->batch->fail_slice(r, kind_of(flush->err), "peer " + peer_.name + ": the read confirming " +
                                                         range_text(q.op, q.remote_addr, q.length) +
                                                         " failed: " + flush->message);
      } else {
        ctx_.counters.bytes_written.fetch_add(q.length, std::memory_order_relaxed);
        ctx_.counters.fabric_bytes.fetch_add(q.length, std::memory_order_relaxed);
        g->batch->complete_slice(r, q.length);
      }
    }
  };
  const Request& last = g->batch->requests()[landed.back()];
  std::shared_ptr<Remote> remote = g->state[landed.back()].remote;
  std::vector<uint32_t> rails;
  const uint32_t mask = g->write_rails.load();
  for (uint32_t k = 0; k < rails_.size(); ++k)
    if (mask & (1u << k)) rails.push_back(k);
  if (rails.empty()) {  // no piece went out (nothing to confirm): never leave the batch waiting
    flush->left.store(1);
    finish(0, "");
    return;
  }
  flush->left.store(uint32_t(rails.size()));
  for (uint32_t k : rails) {
    Path& rail = *rails_[k];
    fi_addr_t addr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      addr = rail.addr;
      ++remote->inflight;
    }
    auto* op = new FlushOp();
    op->done = [this, remote, finish](int err, const std::string& message) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (--remote->inflight == 0 && remote->revoked) cv_.notify_all();
      }
      finish(err, message);
    };
    try {
      rail.domain->post(true, op, rail.scratch.base, 1, rail.scratch.desc, addr,
                        rail.domain->remote_address(last.remote_addr + last.length - 1, remote->base), remote->keys[k],
                        [this] { check_peer(); });
    } catch (const Error& e) {
      auto done = std::move(op->done);
      delete op;
      done(FI_EIO, e.what());
    }
  }
}

}  // namespace tidekv::fabric
