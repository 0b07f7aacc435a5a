#include "engine/listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "common/errors.h"
#include "common/socket.h"

namespace tidekv {
namespace {

constexpr int kMaxEvents = 64;
constexpr auto kSweepEvery = std::chrono::milliseconds(100);
constexpr auto kPauseOnExhaustion = std::chrono::milliseconds(100);
constexpr auto kLogEvery = std::chrono::seconds(10);

std::string peer_address(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

}  // namespace

Listener::Listener(EngineContext& ctx, Router route, RegionVerifier verify)
    : ctx_(ctx), route_(std::move(route)), verify_(std::move(verify)) {
  listen_fd_ = listen_tcp(ctx.options.host, ctx.options.port, &port_);
  fcntl(listen_fd_, F_SETFL, fcntl(listen_fd_, F_GETFL) | O_NONBLOCK);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (epoll_fd_ < 0 || wake_fd_ < 0) {
    int err = errno;
    stop();
    TIDEKV_THROW(kConfig, std::string("cannot set up the listener: ") + strerror(err));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = &listen_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  ev.data.ptr = &wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
}

Listener::~Listener() { stop(); }

void Listener::start(std::string descriptor) {
  descriptor_ = std::move(descriptor);
  try {
    thread_ = std::thread([this] { loop(); });
  } catch (const std::system_error& e) {
    TIDEKV_THROW(kConfig, std::string("cannot start the listener thread: ") + e.what());
  }
}

void Listener::stop() {
  if (stopping_.exchange(true)) return;
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  for (auto& [fd, p] : pending_) ::close(fd);
  ctx_.counters.connections_open.fetch_sub(pending_.size(), std::memory_order_relaxed);
  pending_.clear();
  for (int* fd : {&listen_fd_, &epoll_fd_, &wake_fd_, &reserve_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

void Listener::loop() {
  epoll_event events[kMaxEvents];
  auto next_sweep = std::chrono::steady_clock::now() + kSweepEvery;
  while (!stopping_.load()) {
    int n = epoll_wait(epoll_fd_, events, kMaxEvents, int(kSweepEvery.count()));
    for (int i = 0; i < n; ++i) {
      void* tag = events[i].data.ptr;
      if (tag == &wake_fd_) return;
      if (tag == &listen_fd_) {
        accept_ready();
      } else {
        advance(static_cast<Pending*>(tag));
      }
    }
    if (std::chrono::steady_clock::now() >= next_sweep) {
      sweep();
      next_sweep = std::chrono::steady_clock::now() + kSweepEvery;
    }
  }
}

void Listener::watch_listener(bool on) {
  if (listening_ == on) return;
  listening_ = on;
  epoll_event ev{};
  ev.events = on ? uint32_t(EPOLLIN) : 0u;
  ev.data.ptr = &listen_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &ev);
  if (!on) resume_at_ = std::chrono::steady_clock::now() + kPauseOnExhaustion;
}

void Listener::shed_one(int err) {
  // Out of descriptors: the connection cannot even be accepted, and a listening socket with a
  // backlog stays readable, so the loop would spin. Spend the reserve descriptor to take the
  // connection off the backlog and close it, then win the reserve back; if that fails too,
  // stop watching the socket for a moment.
  ctx_.counters.connections_limited.fetch_add(1, std::memory_order_relaxed);
  ctx_.log.emit_every("listener-fds", kLogEvery, LogLevel::kWarning,
                      std::string("refusing connections: out of file descriptors (") + strerror(err) +
                          "); raise the open-file limit (ulimit -n) or lower connections_per_peer");
  if (reserve_fd_ >= 0) {
    ::close(reserve_fd_);
    reserve_fd_ = -1;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) ::close(fd);
    reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
  if (reserve_fd_ < 0) watch_listener(false);
}

void Listener::accept_ready() {
  for (int accepted = 0; accepted < kMaxEvents && !stopping_.load(); ++accepted) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        shed_one(errno);
        if (!listening_) return;
        continue;
      }
      ctx_.log.emit_every("listener-accept", kLogEvery, LogLevel::kError,
                          std::string("accept failed: ") + strerror(errno));
      watch_listener(false);
      return;
    }
    ctx_.counters.connections_accepted.fetch_add(1, std::memory_order_relaxed);
    if (ctx_.counters.connections_open.load(std::memory_order_relaxed) >= uint64_t(ctx_.options.max_connections)) {
      ::close(fd);
      ctx_.counters.connections_limited.fetch_add(1, std::memory_order_relaxed);
      ctx_.log.emit_every("listener-max", kLogEvery, LogLevel::kWarning,
                          "refusing connections: " + std::to_string(ctx_.options.max_connections) +
                              " open (TransferConfig.max_connections)");
      continue;
    }
    auto p = std::make_unique<Pending>(
        fd, peer_address(addr), ctx_.options.secret,
        std::chrono::steady_clock::now() + std::chrono::milliseconds(ctx_.options.handshake_timeout_ms));
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.ptr = p.get();
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      ::close(fd);
      ctx_.counters.connections_limited.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    ctx_.counters.connections_open.fetch_add(1, std::memory_order_relaxed);
    Pending* raw = p.get();
    pending_[fd] = std::move(p);
    advance(raw);  // the Hello often arrives with the connection
  }
}

void Listener::drop(Pending* p) {
  int fd = p->fd;
  ctx_.counters.connections_open.fetch_sub(1, std::memory_order_relaxed);  // before the peer can see the close
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  ::close(fd);
  pending_.erase(fd);
}

void Listener::advance(Pending* p) {
  for (;;) {
    size_t wanted = p->handshake.wanted();
    ssize_t n = ::recv(p->fd, p->buf + p->got, wanted - p->got, 0);
    if (n == 0) {
      // A connect-and-close (a port probe, a health check) is not worth a line; a client that
      // hangs up halfway through its handshake is.
      if (p->got > 0 || p->handshake.step() != ServerHandshake::Step::kGreeting) {
        ctx_.counters.connections_refused.fetch_add(1, std::memory_order_relaxed);
        ctx_.log.emit_every("listener-truncated", kLogEvery, LogLevel::kWarning,
                            "dropped connection from " + p->what + ": it closed in the middle of the handshake");
      }
      return drop(p);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      return drop(p);
    }
    p->got += size_t(n);
    if (p->got < wanted) continue;
    p->got = 0;
    const wire::Hello& hello = p->handshake.hello();
    Transport* transport = nullptr;
    Admission admission = Admission::kAdmit;
    if (p->handshake.step() == ServerHandshake::Step::kAuth && hello.conn_type == uint32_t(wire::ConnType::kData)) {
      transport = route_(hello.transport);
      if (transport == nullptr) {
        admission = Admission::kNoTransport;  // a bad or foreign client: counted as refused, not as a limit
      } else if (!transport->admit(hello.instance)) {
        admission = Admission::kLimit;
        ctx_.counters.connections_limited.fetch_add(1, std::memory_order_relaxed);
      }
    }
    std::string reply;
    try {
      if (p->handshake.step() == ServerHandshake::Step::kProof) {
        p->handshake.feed_proof(p->buf, verify_, &reply);
        (void)!::send(p->fd, reply.data(), reply.size(), MSG_NOSIGNAL);
        return drop(p);
      }
      if (p->handshake.step() == ServerHandshake::Step::kGreeting) {
        p->handshake.feed(p->buf, descriptor_, admission, &reply);
        continue;  // nothing to send yet, unless it threw
      }
      p->handshake.feed(p->buf, descriptor_, admission, &reply);
    } catch (const Error& e) {
      if (!reply.empty()) (void)!::send(p->fd, reply.data(), reply.size(), MSG_NOSIGNAL);
      ctx_.counters.connections_refused.fetch_add(1, std::memory_order_relaxed);
      ctx_.log.emit_every("listener-refused", std::chrono::seconds(1), LogLevel::kWarning,
                          std::string("dropped connection from ") + p->what + ": " + e.what());
      return drop(p);
    }
    // Replies are small and the socket is fresh: they fit its buffer, or the client is not
    // reading and is dropped.
    if (::send(p->fd, reply.data(), reply.size(), MSG_NOSIGNAL) != ssize_t(reply.size())) return drop(p);
    if (p->handshake.step() != ServerHandshake::Step::kDone) continue;  // (kProof: its RegionProof comes next)
    if (hello.conn_type == uint32_t(wire::ConnType::kDescriptor)) return drop(p);
    Connection conn{p->fd, p->what, {}};
    std::memcpy(conn.instance, hello.instance, sizeof(conn.instance));
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, p->fd, nullptr);
    pending_.erase(p->fd);  // p is gone from here on
    fcntl(conn.fd, F_SETFL, fcntl(conn.fd, F_GETFL) & ~O_NONBLOCK);
    tune_socket(conn.fd, SocketOptions{ctx_.options.socket_buffer_bytes, ctx_.options.io_timeout_ms});
    transport->adopt(std::move(conn));  // it owns the descriptor and the open-connection count now
    return;
  }
}

void Listener::sweep() {
  auto now = std::chrono::steady_clock::now();
  if (!listening_ && now >= resume_at_) {
    if (reserve_fd_ < 0) reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    watch_listener(true);
  }
  std::vector<Pending*> expired;
  for (auto& [fd, p] : pending_)
    if (now >= p->deadline) expired.push_back(p.get());
  for (Pending* p : expired) {
    ctx_.counters.connections_refused.fetch_add(1, std::memory_order_relaxed);
    ctx_.log.emit_every("listener-slow", kLogEvery, LogLevel::kWarning,
                        "dropped connection from " + p->what + ": no handshake within " +
                            std::to_string(ctx_.options.handshake_timeout_ms) + " ms");
    drop(p);
  }
}

}  // namespace tidekv
