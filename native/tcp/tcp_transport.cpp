#include "tcp/tcp_transport.h"

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <cstring>

#include "common/errors.h"
#include "engine/handshake.h"

namespace tidekv {
namespace {

constexpr size_t kRoundSlices = 256;  // the acks of one round must fit in socket buffers
constexpr uint64_t kMaxRefusedDrain = 1ULL << 30;

std::string range_text(const char* op, uint64_t addr, uint64_t len) {
  return std::string(op) + " [0x" + [](uint64_t v) {
    char b[32];
    snprintf(b, sizeof(b), "%llx", (unsigned long long)v);
    return std::string(b);
  }(addr) + ", +" + std::to_string(len) + ")";
}

}  // namespace

TcpTransport::Connection::~Connection() {
  if (fd < 0) return;
  {
    std::lock_guard<std::mutex> lock(owner->mu_);
    owner->live_fds_.erase(fd);
  }
  ::close(fd);
}

TcpTransport::TcpTransport(EngineContext& ctx, std::string peer_name, std::string host, int port,
                           DescriptorCallback on_connect)
    : ctx_(ctx), peer_name_(std::move(peer_name)), host_(std::move(host)), port_(port),
      on_connect_(std::move(on_connect)) {}

TcpTransport::~TcpTransport() { close(); }

void TcpTransport::close() {
  std::vector<std::unique_ptr<Connection>> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    idle.swap(idle_);
    // Connections in use: wake their blocked send/recv so the rounds fail now, not at the I/O timeout.
    for (int fd : live_fds_) ::shutdown(fd, SHUT_RDWR);
    cv_.notify_all();
  }
}

std::unique_ptr<TcpTransport::Connection> TcpTransport::checkout(const Deadline& deadline) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (closed_) TIDEKV_THROW(kClosed, "engine closed");
      if (!idle_.empty()) {
        auto conn = std::move(idle_.back());
        idle_.pop_back();
        return conn;
      }
      if (open_ < ctx_.options.connections_per_peer) break;
      if (!deadline) {
        cv_.wait(lock);
      } else if (cv_.wait_until(lock, *deadline) == std::cv_status::timeout) {
        return nullptr;
      }
    }
    ++open_;
  }
  try {
    auto conn = std::make_unique<Connection>();
    conn->owner = this;
    SocketOptions sopts{ctx_.options.socket_buffer_bytes, ctx_.options.io_timeout_ms};
    conn->fd = connect_tcp(host_, port_, sopts);
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_fds_.insert(conn->fd);
    }
    conn->reader = std::make_unique<SocketReader>(conn->fd, peer_name_);
    wire::Descriptor d = client_handshake(conn->fd, *conn->reader, wire::ConnType::kData, ctx_.options.secret, peer_name_);
    if (on_connect_) on_connect_(d);
    ctx_.counters.connections_opened.fetch_add(1, std::memory_order_relaxed);
    return conn;
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    --open_;
    cv_.notify_one();
    throw;
  }
}

void TcpTransport::checkin(std::unique_ptr<Connection> conn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (conn && !closed_) {
    idle_.push_back(std::move(conn));
  } else {
    --open_;
  }
  cv_.notify_one();
}

void TcpTransport::plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) {
  const uint64_t slice_bytes = ctx_.options.slice_bytes;
  std::vector<Slice> slices;
  for (uint32_t r : requests) {
    const Request& q = batch->requests()[r];
    uint32_t n = 0;
    for (uint64_t off = 0; off < q.length; off += slice_bytes, ++n) {
      uint64_t len = std::min(slice_bytes, q.length - off);
      slices.push_back(Slice{r, q.op, q.local_addr + off, q.remote_addr + off, len});
    }
    batch->expect_slices(r, n);
  }
  size_t groups = std::min<size_t>(slices.size(), size_t(std::max(1, ctx_.options.connections_per_peer)));
  std::vector<std::shared_ptr<Group>> parts;
  for (size_t i = 0; i < groups; ++i) {
    parts.push_back(std::make_shared<Group>());
    parts.back()->batch = batch.get();
    parts.back()->keep = batch;
  }
  for (size_t i = 0; i < slices.size(); ++i) parts[i % groups]->slices.push_back(slices[i]);
  for (auto& g : parts) {
    // WRITEs first within each round: the peer then only ever owes us small acks while we send.
    std::stable_partition(g->slices.begin(), g->slices.end(), [](const Slice& s) { return s.op == wire::Op::kWrite; });
    batch->add_task(std::make_shared<Task>([this, g](const Deadline& deadline) { run(g, deadline); }));
  }
}

void TcpTransport::run(const std::shared_ptr<Group>& group, const Deadline& deadline) {
  if (step(*group, deadline)) {
    group->keep.reset();
    return;
  }
  // The waiting thread that ran this has to go: a worker finishes the group.
  ctx_.enqueue_task(std::make_shared<Task>([this, group](const Deadline&) { run(group, std::nullopt); }));
}

void TcpTransport::begin_window(Group& g) {
  g.window_begin = g.done;
  g.window_end = std::min(g.slices.size(), g.done + kRoundSlices);
  size_t count = g.window_end - g.window_begin;
  g.headers.resize(count);
  g.iov.clear();
  g.iov_next = 0;
  for (size_t i = 0; i < count; ++i) {
    const Slice& s = g.slices[g.window_begin + i];
    g.headers[i] = wire::RequestHeader{wire::kMagic, uint8_t(s.op), {0, 0, 0}, s.remote, s.length, uint64_t(i)};
    g.iov.push_back(iovec{&g.headers[i], sizeof(wire::RequestHeader)});
    if (s.op == wire::Op::kWrite) g.iov.push_back(iovec{reinterpret_cast<void*>(s.local), s.length});
  }
}

bool TcpTransport::step(Group& g, const Deadline& deadline) {
  try {
    if (!g.conn) {
      g.conn = checkout(deadline);
      if (!g.conn) return false;
    }
    while (g.done < g.slices.size()) {
      if (g.window_end <= g.done) begin_window(g);
      if (!send_until(g.conn->fd, g.iov.data(), int(g.iov.size()), &g.iov_next, deadline, peer_name_)) return false;
      while (g.done < g.window_end) {
        if (g.conn->reader->buffered() < sizeof(wire::ResponseHeader) &&
            !spin_until_readable(g.conn->fd, ctx_.options.reply_spin_us) && deadline &&
            !wait_readable(g.conn->fd, *deadline))
          return false;
        handle_reply(g);
      }
    }
    checkin(std::move(g.conn));
  } catch (const Error& e) {
    if (g.conn) {
      g.conn.reset();  // a connection that failed mid-round is out of sync: drop it
      checkin(nullptr);
    }
    ErrorKind kind = e.kind() == ErrorKind::kClosed ? ErrorKind::kPeerUnavailable : e.kind();
    for (size_t i = g.done; i < g.slices.size(); ++i) {
      const Slice& s = g.slices[i];
      g.batch->fail_slice(s.request, kind,
                          std::string(e.what()) + " during " +
                              range_text(s.op == wire::Op::kRead ? "READ" : "WRITE", s.remote, s.length));
    }
    g.done = g.slices.size();
  }
  return true;
}

void TcpTransport::handle_reply(Group& g) {
  const Slice& s = g.slices[g.done];
  Connection& conn = *g.conn;
  wire::ResponseHeader resp{};
  conn.reader->read_exact(&resp, sizeof(resp));
  if (resp.magic != wire::kMagic || resp.tag != g.done - g.window_begin)
    TIDEKV_THROW(kTransfer, "peer " + peer_name_ + " sent a malformed reply");
  if (resp.status == uint32_t(wire::Status::kOk)) {
    if (s.op == wire::Op::kRead) {
      if (resp.length != s.length) TIDEKV_THROW(kTransfer, "peer " + peer_name_ + " sent a short READ reply");
      conn.reader->read_exact(reinterpret_cast<void*>(s.local), s.length);
      ctx_.counters.bytes_read.fetch_add(s.length, std::memory_order_relaxed);
    } else {
      ctx_.counters.bytes_written.fetch_add(s.length, std::memory_order_relaxed);
    }
    ++g.done;
    g.batch->complete_slice(s.request, s.length);
    return;
  }
  const char* op = s.op == wire::Op::kRead ? "READ" : "WRITE";
  ErrorKind kind =
      resp.status == uint32_t(wire::Status::kNotRegistered) ? ErrorKind::kNotRegistered : ErrorKind::kTransfer;
  ++g.done;
  g.batch->fail_slice(s.request, kind,
                      "peer " + peer_name_ + " refused " + range_text(op, s.remote, s.length) +
                          (kind == ErrorKind::kNotRegistered ? ": not inside a region registered there" : ""));
}

void serve_tcp(int fd, SocketReader& reader, const RegionTable& regions, EngineContext& ctx, const std::string& what) {
  // Replies are gathered while more frames are already queued and sent in one sendmsg: small
  // READ payloads go out straight from the region (its guard is held until the flush).
  constexpr size_t kFlushBytes = 4 << 20;
  constexpr size_t kFlushIovecs = 512;
  std::deque<wire::ResponseHeader> headers;  // deque: stable addresses for the iovecs
  std::vector<iovec> iov;
  std::vector<RegionTable::Guard> held;
  size_t out_bytes = 0;
  auto flush = [&] {
    if (!iov.empty()) send_all(fd, iov.data(), int(iov.size()), what);
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
  for (;;) {
    wire::RequestHeader h{};
    // A peer in a request loop sends its next frame within microseconds: poll a little before
    // sleeping in recv (a wake-up costs more than the spin).
    if (reader.buffered() < sizeof(h)) spin_until_readable(fd, ctx.options.reply_spin_us);
    reader.read_exact(&h, sizeof(h), /*at_frame_boundary=*/iov.empty());
    if (h.magic != wire::kMagic || h.op > uint8_t(wire::Op::kWrite))
      TIDEKV_THROW(kTransfer, "malformed frame from " + what + " (bad magic or op)");
    auto guard = regions.acquire(h.remote_addr, h.length, /*is_local=*/true);
    wire::ResponseHeader resp{wire::kMagic, uint32_t(wire::Status::kOk), 0, h.tag, 0};
    if (!guard) {
      ctx.counters.frames_refused.fetch_add(1, std::memory_order_relaxed);
      resp.status = uint32_t(wire::Status::kNotRegistered);
      if (h.op == uint8_t(wire::Op::kWrite)) {
        if (h.length > kMaxRefusedDrain)
          TIDEKV_THROW(kTransfer, "refused WRITE of " + std::to_string(h.length) + " bytes from " + what +
                                      " is too large to drain; dropping the connection");
        reader.discard(h.length);
      }
      reply(resp, nullptr, 0);
    } else if (h.op == uint8_t(wire::Op::kWrite)) {
      reader.read_exact(reinterpret_cast<void*>(h.remote_addr), h.length);
      guard.reset();
      ctx.counters.served_bytes.fetch_add(h.length, std::memory_order_relaxed);
      reply(resp, nullptr, 0);
    } else {
      resp.length = h.length;
      reply(resp, reinterpret_cast<const void*>(h.remote_addr), h.length);
      held.push_back(std::move(*guard));
      ctx.counters.served_bytes.fetch_add(h.length, std::memory_order_relaxed);
    }
    if (!reader.has_pending() || out_bytes >= kFlushBytes || iov.size() >= kFlushIovecs) flush();
  }
}

}  // namespace tidekv
