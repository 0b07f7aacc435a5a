#include "tcp/tcp_server.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <system_error>

#include "common/errors.h"
#include "cuda/driver.h"

namespace tidekv {
namespace {

constexpr uint64_t kMaxRefusedDrain = 1ULL << 30;
constexpr uint64_t kStageBytes = 8 << 20;  // pinned bounce memory per connection that touches GPU memory
constexpr int kSweepEveryMs = 1000;

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

TcpServer::TcpServer(EngineContext& ctx, const RegionTable& regions) : ctx_(ctx), regions_(regions) {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (epoll_fd_ < 0 || wake_fd_ < 0) {
    int err = errno;
    stop();
    TIDEKV_THROW(kConfig, std::string("cannot set up the tcp server: ") + strerror(err));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;  // level-triggered, never read: every thread sees it and leaves
  ev.data.ptr = nullptr;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  try {
    for (int i = 0; i < std::max(1, ctx.options.tcp.server_threads); ++i) threads_.emplace_back([this] { run(); });
  } catch (const std::system_error& e) {
    stop();
    TIDEKV_THROW(kConfig, std::string("cannot start the tcp server's threads: ") + e.what());
  }
}

TcpServer::~TcpServer() { stop(); }

void TcpServer::stop() {
  if (stopping_.exchange(true)) return;
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
  }
  for (auto& t : threads_) t.join();
  threads_.clear();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [raw, c] : conns_) ::close(c->fd);
  ctx_.counters.connections_open.fetch_sub(conns_.size(), std::memory_order_relaxed);
  conns_.clear();
  per_peer_.clear();
  for (int* fd : {&epoll_fd_, &wake_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

bool TcpServer::admit(const uint8_t instance[16]) {
  Instance id;
  std::memcpy(id.data(), instance, id.size());
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_.load()) return false;
  auto it = per_peer_.find(id);
  bool ok = it == per_peer_.end() || it->second < ctx_.options.max_connections_per_peer;
  if (!ok)
    ctx_.log.emit_every("tcp-per-peer", std::chrono::seconds(10), LogLevel::kWarning,
                        "refusing a data connection: the peer already holds " +
                            std::to_string(ctx_.options.max_connections_per_peer) +
                            " (TransferConfig.max_connections_per_peer)");
  return ok;
}

void TcpServer::adopt(Connection conn) {
  auto c = std::make_unique<Conn>();
  c->fd = conn.fd;
  c->what = std::move(conn.what);
  std::memcpy(c->instance.data(), conn.instance, c->instance.size());
  c->last_active_ms.store(now_ms());
  Conn* raw = c.get();
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_.load()) {
    ::close(raw->fd);
    ctx_.counters.connections_open.fetch_sub(1, std::memory_order_relaxed);
    return;
  }
  ++per_peer_[raw->instance];
  conns_[raw] = std::move(c);
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
  ev.data.ptr = raw;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, raw->fd, &ev) != 0) {
    raw->busy = true;  // no thread can see it: close it right here
    lock.unlock();
    close_conn(raw);
  }
}

void TcpServer::close_conn(Conn* c) {
  // The books first, the descriptor last: once the peer sees the close, a new connection of its
  // must find the slot free.
  int fd = c->fd;
  ctx_.counters.connections_open.fetch_sub(1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = per_peer_.find(c->instance);
    if (it != per_peer_.end() && --it->second <= 0) per_peer_.erase(it);
    conns_.erase(c);
  }
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  ::close(fd);
}

void TcpServer::sweep_idle() {
  // Idle connections are shut down, not closed: a thread then sees the hang-up through epoll and
  // closes the connection the one way connections are closed.
  int64_t now = now_ms();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [raw, c] : conns_) {
    if (c->busy || now - c->last_active_ms.load() < ctx_.options.idle_timeout_ms) continue;
    ctx_.counters.connections_idle_closed.fetch_add(1, std::memory_order_relaxed);
    c->last_active_ms.store(now);  // once per timeout, not on every sweep until it is reaped
    ::shutdown(c->fd, SHUT_RDWR);
  }
}

void TcpServer::run() {
  while (!stopping_.load()) {
    epoll_event ev{};
    int n = epoll_wait(epoll_fd_, &ev, 1, kSweepEveryMs);
    if (stopping_.load()) return;
    int64_t now = now_ms();
    int64_t due = next_sweep_ms_.load();
    if (now >= due && next_sweep_ms_.compare_exchange_strong(due, now + kSweepEveryMs)) sweep_idle();
    if (n <= 0 || ev.data.ptr == nullptr) continue;
    Conn* c = static_cast<Conn*>(ev.data.ptr);
    {
      std::lock_guard<std::mutex> lock(mu_);
      c->busy = true;
    }
    bool keep = !(ev.events & EPOLLERR) && serve(*c);
    if (!keep) {
      close_conn(c);
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      c->busy = false;
      c->last_active_ms.store(now_ms());
    }
    epoll_event again{};
    again.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
    again.data.ptr = c;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c->fd, &again) != 0) close_conn(c);
  }
}

bool TcpServer::serve(Conn& c) {
  // Replies are gathered while more frames are already queued and sent in one sendmsg: small
  // READ payloads go out straight from the region (its guard is held until the flush).
  constexpr size_t kFlushBytes = 4 << 20;
  constexpr size_t kFlushIovecs = 512;
  if (!c.reader) c.reader = std::make_unique<SocketReader>(c.fd, c.what);
  SocketReader& reader = *c.reader;
  std::deque<wire::ResponseHeader> headers;  // deque: stable addresses for the iovecs
  std::vector<iovec> iov;
  std::vector<RegionTable::Guard> held;
  size_t out_bytes = 0;
  auto flush = [&] {
    if (c.stager && !c.stager->idle()) c.stager->drain();  // staged bytes are in place before any reply goes
    if (!iov.empty()) send_all(c.fd, iov.data(), int(iov.size()), c.what);
    iov.clear();
    headers.clear();
    held.clear();
    out_bytes = 0;
  };
  auto reply = [&](const wire::ResponseHeader& h, const void* payload, uint64_t len) {
    headers.push_back(h);
    iov.push_back(iovec{&headers.back(), sizeof(wire::ResponseHeader)});
    if (payload) iov.push_back(iovec{const_cast<void*>(payload), len});
    out_bytes += sizeof(wire::ResponseHeader) + len;
  };
  try {
    for (;;) {
      wire::RequestHeader h{};
      if (reader.buffered() < sizeof(h) && !reader.has_pending()) {
        flush();
        // A peer in a request loop sends its next frame within microseconds: poll a little
        // before going back to epoll (a wake-up costs more than the spin).
        if (!spin_until_readable(c.fd, ctx_.options.tcp.reply_spin_us)) return true;
      }
      reader.read_exact(&h, sizeof(h), /*at_frame_boundary=*/iov.empty());
      if (h.magic != wire::kMagic || h.op > uint8_t(wire::Op::kWrite))
        TIDEKV_THROW(kTransfer, "malformed frame from " + c.what + " (bad magic or op)");
      if (h.remote_addr < h.span_addr || h.length > h.span_length || h.remote_addr - h.span_addr > h.span_length - h.length)
        TIDEKV_THROW(kTransfer, "malformed frame from " + c.what + " (slice outside its request)");
      auto guard = regions_.acquire(h.span_addr, h.span_length, /*is_local=*/true);
      wire::ResponseHeader resp{wire::kMagic, uint32_t(wire::Status::kOk), 0, h.tag, 0};
      int device = -1;
      if (guard && guard->view().location.kind != MemoryKind::kCpu) {
        device = guard->view().location.device;
        if (!cuda::Driver::get().available()) {
          guard.reset();  // GPU memory and no driver to stage it: not ours to serve from a socket
          resp.status = uint32_t(wire::Status::kNotHostMemory);
        } else if (!c.stager) {
          c.stager = std::make_unique<cuda::Stager>(std::max<uint64_t>(kStageBytes, ctx_.options.slice_bytes));
        }
      }
      if (!guard) {
        ctx_.counters.frames_refused.fetch_add(1, std::memory_order_relaxed);
        if (resp.status == uint32_t(wire::Status::kOk)) resp.status = uint32_t(wire::Status::kNotRegistered);
        if (h.op == uint8_t(wire::Op::kWrite)) {
          if (h.length > kMaxRefusedDrain)
            TIDEKV_THROW(kTransfer, "refused WRITE of " + std::to_string(h.length) + " bytes from " + c.what +
                                        " is too large to drain; dropping the connection");
          reader.discard(h.length);
        }
        reply(resp, nullptr, 0);
      } else if (device >= 0 && h.length > c.stager->capacity() / 2) {
        flush();
        serve_large_staged(c, h, guard->view());
        guard.reset();
        ctx_.counters.served_bytes.fetch_add(h.length, std::memory_order_relaxed);
        if (h.op == uint8_t(wire::Op::kWrite)) reply(resp, nullptr, 0);
      } else if (device >= 0) {
        // Through bounce memory; the reply (ack or bytes) goes at the next flush, after the copy.
        uint8_t* bounce = c.stager->take(h.length, device);
        if (!bounce) {
          flush();
          bounce = c.stager->take(h.length, device);
        }
        if (h.op == uint8_t(wire::Op::kWrite)) {
          reader.read_exact(bounce, h.length);
          c.stager->to_device(h.remote_addr, bounce, h.length, device);
          reply(resp, nullptr, 0);
        } else {
          c.stager->to_host(bounce, h.remote_addr, h.length, device);
          resp.length = h.length;
          reply(resp, bounce, h.length);
        }
        held.push_back(std::move(*guard));
        ctx_.counters.served_bytes.fetch_add(h.length, std::memory_order_relaxed);
      } else if (h.op == uint8_t(wire::Op::kWrite)) {
        reader.read_exact(reinterpret_cast<void*>(h.remote_addr), h.length);
        guard.reset();
        ctx_.counters.served_bytes.fetch_add(h.length, std::memory_order_relaxed);
        reply(resp, nullptr, 0);
      } else {
        resp.length = h.length;
        reply(resp, reinterpret_cast<const void*>(h.remote_addr), h.length);
        held.push_back(std::move(*guard));
        ctx_.counters.served_bytes.fetch_add(h.length, std::memory_order_relaxed);
      }
      if (out_bytes >= kFlushBytes || iov.size() >= kFlushIovecs) flush();
    }
  } catch (const Error& e) {
    if (!stopping_.load() && e.kind() != ErrorKind::kHangup) {
      ctx_.counters.connections_refused.fetch_add(1, std::memory_order_relaxed);
      ctx_.log.emit_every("tcp-serve", std::chrono::seconds(1), LogLevel::kWarning,
                          std::string("dropped connection from ") + c.what + ": " + e.what());
    }
    return false;
  }
}

void TcpServer::serve_large_staged(Conn& c, const wire::RequestHeader& h, const RegionView& region) {
  // The reply of a READ is its header and then the pieces; a WRITE is acknowledged by the caller.
  cuda::Stager& stager = *c.stager;
  const int device = region.location.device;
  const uint64_t piece_cap = stager.capacity();
  if (h.op == uint8_t(wire::Op::kRead)) {
    wire::ResponseHeader resp{wire::kMagic, uint32_t(wire::Status::kOk), h.length, h.tag, 0};
    send_all(c.fd, &resp, sizeof(resp), c.what);
  }
  for (uint64_t off = 0; off < h.length; off += piece_cap) {
    uint64_t n = std::min(piece_cap, h.length - off);
    uint8_t* bounce = stager.take(n, device);
    if (h.op == uint8_t(wire::Op::kWrite)) {
      c.reader->read_exact(bounce, n);
      stager.to_device(h.remote_addr + off, bounce, n, device);
      stager.drain();
    } else {
      stager.wait(stager.to_host(bounce, h.remote_addr + off, n, device));
      send_all(c.fd, bounce, n, c.what);
      stager.drain();
    }
  }
}

}  // namespace tidekv
