#include "tcp/tcp_link.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <cstring>

#include "common/errors.h"
#include "common/handshake.h"
#include "common/text.h"
#include "cuda/driver.h"

namespace tidekv {
namespace {

constexpr size_t kRoundSlices = 256;  // the acks of one round must fit in socket buffers
constexpr uint64_t kStageBytes = 8 << 20;  // pinned bounce memory per connection (GPU bytes of one round)
constexpr size_t kNoMark = SIZE_MAX;


}  // namespace

TcpLink::Connection::~Connection() {
  if (fd < 0) return;
  {
    std::lock_guard<std::mutex> lock(owner->mu_);
    owner->live_fds_.erase(fd);
  }
  ::close(fd);
}

TcpLink::TcpLink(EngineContext& ctx, PeerAddress peer)
    : ctx_(ctx), peer_(std::move(peer)), peer_name_(peer_.name), max_open_(ctx.options.tcp.connections_per_peer) {}

TcpLink::~TcpLink() { close(); }

int TcpLink::preference(const Request& r, MemoryLocation local) const {
  // Anything the peer registered (it stages its own GPU memory); local GPU memory is staged here.
  if (local.kind == MemoryKind::kCpu) return 1;
  return cuda::Driver::get().available() ? 1 : 0;
}

std::string TcpLink::refusal(const Request& r, MemoryLocation local) const {
  return "tcp stages " + local.str() + " memory through host memory only with a CUDA driver, and " +
         cuda::Driver::get().reason();
}

void TcpLink::close() {
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

std::unique_ptr<TcpLink::Connection> TcpLink::checkout(const Deadline& deadline) {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        if (closed_) TIDEKV_THROW(kClosed, "engine closed");
        while (!idle_.empty()) {
          auto conn = std::move(idle_.back());
          idle_.pop_back();
          if (is_usable(*conn)) return conn;
          --open_;  // the peer closed it while idle (its idle timeout, or a restart): open another
          lock.unlock();
          conn.reset();
          lock.lock();
        }
        if (open_ < max_open_) break;
        if (!deadline) {
          cv_.wait(lock);
        } else if (cv_.wait_until(lock, *deadline) == std::cv_status::timeout) {
          return nullptr;
        }
      }
      ++open_;
    }
    try {
      return open_connection();
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lock(mu_);
      --open_;
      cv_.notify_one();
      // The peer has no room for one more of ours (its max_connections_per_peer is below our
      // connections_per_peer): make do with the connections we have, if any.
      if (e.kind() != ErrorKind::kRefused || open_ == 0) throw;
      max_open_ = std::max(1, open_);
      ctx_.log.emit_once("tcp-fewer:" + peer_name_, LogLevel::kWarning,
                         "peer " + peer_name_ + " refused more than " + std::to_string(max_open_) +
                             " connections from us (its max_connections_per_peer); using " +
                             std::to_string(max_open_));
    }
  }
}

std::unique_ptr<TcpLink::Connection> TcpLink::open_connection() {
  auto conn = std::make_unique<Connection>();
  conn->owner = this;
  SocketOptions sopts{ctx_.options.socket_buffer_bytes, ctx_.options.io_timeout_ms};
  conn->fd = connect_tcp(peer_.host, peer_.port, sopts);
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_fds_.insert(conn->fd);
  }
  conn->reader = std::make_unique<SocketReader>(conn->fd, peer_name_);
  Descriptor d = client_handshake(conn->fd, *conn->reader, wire::ConnType::kData, uint16_t(TransportId::kTcp),
                                  ctx_.instance, ctx_.options.secret, peer_name_);
  if (peer_.on_descriptor) peer_.on_descriptor(d);
  ctx_.counters.connections_opened.fetch_add(1, std::memory_order_relaxed);
  return conn;
}

bool TcpLink::is_usable(const Connection& conn) const {
  // The peer closes connections idle past its idle timeout: retire ours well before that, and
  // any that turned readable while idle (a hang-up, since no reply is owed).
  auto idle = std::chrono::steady_clock::now() - conn.idle_since;
  if (idle > std::chrono::milliseconds(ctx_.options.idle_timeout_ms / 2)) return false;
  pollfd p{conn.fd, POLLIN, 0};
  return poll(&p, 1, 0) == 0;
}

void TcpLink::checkin(std::unique_ptr<Connection> conn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (conn && !closed_) {
    conn->idle_since = std::chrono::steady_clock::now();
    idle_.push_back(std::move(conn));
  } else {
    --open_;
  }
  cv_.notify_one();
}

void TcpLink::plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) {
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
  size_t groups = std::min<size_t>(slices.size(), size_t(std::max(1, ctx_.options.tcp.connections_per_peer)));
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
    g->device.resize(g->slices.size());
    for (size_t i = 0; i < g->slices.size(); ++i) {
      MemoryLocation where = batch->local_location(g->slices[i].request);
      g->device[i] = int16_t(where.kind == MemoryKind::kCuda ? where.device : -1);
    }
    batch->add_task(std::make_shared<Task>(
        [self = shared_from_this(), g](const Deadline& deadline) { self->run(g, deadline); }));
  }
}

void TcpLink::run(const std::shared_ptr<Group>& group, const Deadline& deadline) {
  if (step(*group, deadline)) {
    group->keep.reset();
    return;
  }
  // The waiting thread that ran this has to go: a worker finishes the group.
  ctx_.enqueue_task(
      std::make_shared<Task>([self = shared_from_this(), group](const Deadline&) { self->run(group, std::nullopt); }));
}

void TcpLink::begin_window(Group& g) {
  g.window_begin = g.done;
  // A round holds at most kRoundSlices slices, and no more GPU bytes than the bounce memory.
  const uint64_t stage_cap = std::max<uint64_t>(kStageBytes, ctx_.options.slice_bytes);
  uint64_t staged = 0;
  size_t end = g.done;
  while (end < g.slices.size() && end - g.done < kRoundSlices) {
    if (g.device[end] >= 0) {
      if (staged + g.slices[end].length + 64 > stage_cap && end > g.done) break;
      staged += g.slices[end].length + 64;
    }
    ++end;
  }
  g.window_end = end;
  size_t count = g.window_end - g.window_begin;
  g.headers.resize(count);
  g.iov.clear();
  g.iov_mark.clear();
  g.staged_reads.clear();
  g.iov_next = 0;
  if (staged && !g.conn->stager) g.conn->stager = std::make_unique<cuda::Stager>(stage_cap);
  for (size_t i = 0; i < count; ++i) {
    const Slice& s = g.slices[g.window_begin + i];
    const Request& q = g.batch->requests()[s.request];
    g.headers[i] = wire::RequestHeader{wire::kMagic, uint8_t(s.op), {0, 0, 0}, s.remote, s.length, uint64_t(i),
                                       q.remote_addr, q.length};
    g.iov.push_back(iovec{&g.headers[i], sizeof(wire::RequestHeader)});
    g.iov_mark.push_back(kNoMark);
    if (s.op != wire::Op::kWrite) continue;
    int device = g.device[g.window_begin + i];
    if (device < 0) {
      g.iov.push_back(iovec{reinterpret_cast<void*>(s.local), s.length});
      g.iov_mark.push_back(kNoMark);
      continue;
    }
    uint8_t* bounce = g.conn->stager->take(s.length, device);
    if (!bounce) TIDEKV_THROW(kTransfer, "internal: the round's GPU bytes exceed the staging memory");
    g.iov.push_back(iovec{bounce, s.length});
    g.iov_mark.push_back(g.conn->stager->to_host(bounce, s.local, s.length, device));
  }
}

bool TcpLink::send_window(Group& g, const Deadline& deadline) {
  const int count = int(g.iov.size());
  while (g.iov_next < count) {
    size_t& mark = g.iov_mark[g.iov_next];
    if (mark != kNoMark) {
      g.conn->stager->wait(mark);  // this payload is off the GPU; later ones are still copying
      mark = kNoMark;
    }
    int end = g.iov_next + 1;
    while (end < count && g.iov_mark[end] == kNoMark) ++end;
    if (!send_until(g.conn->fd, g.iov.data(), end, &g.iov_next, deadline, ctx_.options.io_timeout_ms, peer_name_))
      return false;
  }
  return true;
}

void TcpLink::finish_staged(Group& g) {
  g.conn->stager->drain();
  for (size_t i : g.staged_reads) {
    const Slice& s = g.slices[i];
    ctx_.counters.bytes_read.fetch_add(s.length, std::memory_order_relaxed);
    g.batch->complete_slice(s.request, s.length);
  }
  g.staged_reads.clear();
}

bool TcpLink::step(Group& g, const Deadline& deadline) {
  try {
    if (!g.conn) {
      g.conn = checkout(deadline);
      if (!g.conn) return false;
    }
    while (g.done < g.slices.size()) {
      if (g.window_end <= g.done) begin_window(g);
      if (!send_window(g, deadline)) return false;
      while (g.done < g.window_end) {
        if (g.conn->reader->buffered() < sizeof(wire::ResponseHeader) &&
            !spin_until_readable(g.conn->fd, ctx_.options.tcp.reply_spin_us) && deadline &&
            !wait_readable(g.conn->fd, *deadline, ctx_.options.io_timeout_ms, peer_name_))
          return false;
        handle_reply(g);
      }
      if (g.conn->stager && !g.conn->stager->idle()) finish_staged(g);
    }
    checkin(std::move(g.conn));
  } catch (const Error& e) {
    if (g.conn) {
      g.conn.reset();  // a connection that failed mid-round is out of sync: drop it
      checkin(nullptr);
    }
    ErrorKind kind = e.kind() == ErrorKind::kHangup ? ErrorKind::kPeerUnavailable : e.kind();
    {
      // close() shuts our live sockets down, and the peer may answer that with a reset: a round
      // cut short by our own close fails as the engine closing, not as the peer's fault.
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) kind = ErrorKind::kClosed;
    }
    // READs whose bytes arrived but had not reached the GPU yet fail with the rest.
    for (size_t i : g.staged_reads)
      g.batch->fail_slice(g.slices[i].request, kind,
                          std::string(e.what()) + " during " + range_text("READ", g.slices[i].remote, g.slices[i].length));
    g.staged_reads.clear();
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

void TcpLink::handle_reply(Group& g) {
  const Slice& s = g.slices[g.done];
  Connection& conn = *g.conn;
  wire::ResponseHeader resp{};
  // A large READ payload follows this header: read none of it into the buffer (it would be
  // copied twice), let it go straight into the destination.
  bool is_large_read = s.op == wire::Op::kRead && s.length >= (16 << 10);
  conn.reader->read_exact(&resp, sizeof(resp), false, is_large_read ? 0 : SIZE_MAX);
  if (resp.magic != wire::kMagic || resp.tag != g.done - g.window_begin)
    TIDEKV_THROW(kTransfer, "peer " + peer_name_ + " sent a malformed reply");
  if (resp.status == uint32_t(wire::Status::kOk)) {
    if (s.op == wire::Op::kRead) {
      if (resp.length != s.length) TIDEKV_THROW(kTransfer, "peer " + peer_name_ + " sent a short READ reply");
      int device = g.device[g.done];
      if (device >= 0) {
        // Into bounce memory, then on to the GPU while the next replies arrive; done at round end.
        uint8_t* bounce = conn.stager->take(s.length, device);
        if (!bounce) TIDEKV_THROW(kTransfer, "internal: the round's GPU bytes exceed the staging memory");
        conn.reader->read_exact(bounce, s.length);
        conn.stager->to_device(s.local, bounce, s.length, device);
        g.staged_reads.push_back(g.done);
        ++g.done;
        return;
      }
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
  const char* why = kind == ErrorKind::kNotRegistered ? ": not inside a region registered there"
                    : resp.status == uint32_t(wire::Status::kNotHostMemory)
                        ? ": the range is GPU memory there, which tcp does not move (no same-host cuda path to it)"
                        : "";
  g.batch->fail_slice(s.request, kind, "peer " + peer_name_ + " refused " + range_text(op, s.remote, s.length) + why);
}

}  // namespace tidekv
