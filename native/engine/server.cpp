#include "engine/server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "common/errors.h"
#include "common/socket.h"
#include "engine/handshake.h"
#include "tcp/tcp_transport.h"

namespace tidekv {
namespace {

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

Server::Server(EngineContext& ctx, const RegionTable& regions, const wire::Descriptor& self)
    : ctx_(ctx), regions_(regions), self_(self) {
  listen_fd_ = listen_tcp(ctx.options.host, ctx.options.port, &port_);
  acceptor_ = std::thread([this] { accept_loop(); });
}

Server::~Server() { stop(); }

void Server::stop() {
  if (stopping_.exchange(true)) return;
  ::shutdown(listen_fd_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  ::close(listen_fd_);
  std::list<std::unique_ptr<Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& c : conns_) ::shutdown(c->fd, SHUT_RDWR);
    conns.swap(conns_);
  }
  for (auto& c : conns) {
    if (c->thread.joinable()) c->thread.join();
    ::close(c->fd);
  }
}

void Server::reap_finished() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = conns_.begin(); it != conns_.end();) {
    if ((*it)->finished.load()) {
      (*it)->thread.join();
      ::close((*it)->fd);
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void Server::accept_loop() {
  while (!stopping_.load()) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
    if (fd < 0) {
      if (stopping_.load()) return;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      ctx_.log.emit(LogLevel::kError, std::string("accept failed: ") + strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    ctx_.counters.connections_accepted.fetch_add(1, std::memory_order_relaxed);
    reap_finished();
    tune_socket(fd, SocketOptions{ctx_.options.socket_buffer_bytes, ctx_.options.io_timeout_ms});
    auto conn = std::make_unique<Conn>();
    conn->fd = fd;
    Conn* raw = conn.get();
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_.load()) {
      ::close(fd);
      return;
    }
    conn->thread = std::thread([this, raw, what = peer_address(addr)] { serve(raw, what); });
    conns_.push_back(std::move(conn));
  }
}

void Server::serve(Conn* conn, std::string what) {
  SocketReader reader(conn->fd, what);
  try {
    wire::ConnType type = server_handshake(conn->fd, reader, ctx_.options.secret, self_, what);
    if (type == wire::ConnType::kData) serve_tcp(conn->fd, reader, regions_, ctx_, what);
  } catch (const Error& e) {
    if (!stopping_.load() && e.kind() != ErrorKind::kClosed) {  // kClosed: the peer hung up between frames
      ctx_.counters.connections_refused.fetch_add(1, std::memory_order_relaxed);
      ctx_.log.emit(LogLevel::kWarning, std::string("dropped connection from ") + what + ": " + e.what());
    }
  }
  ::shutdown(conn->fd, SHUT_RDWR);
  conn->finished.store(true);
}

}  // namespace tidekv
