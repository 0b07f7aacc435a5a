#include "endpoint.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <system_error>

#include "boundary.h"
#include "common/errors.h"
#include "common/handshake.h"
#include "common/socket.h"

namespace tidekv::capi {
namespace {

constexpr size_t kMaxConnections = 1024;

void send_reply(int fd, uint32_t status, uint64_t value, const std::string& what) {
  EndpointReply reply{kEndpointMagic, status, value};
  send_all(fd, &reply, sizeof(reply), what);
}

}  // namespace

Endpoint::Endpoint(const std::string& host, int port, const std::string& secret, std::string descriptor,
                   int engine_port, int handshake_timeout_ms)
    : secret_(secret), engine_port_(engine_port), handshake_timeout_ms_(handshake_timeout_ms) {
  // What this address serves, for a peer that fetches the descriptor here: the engine's
  // transports plus a section that says a C API endpoint answers (and its version).
  Descriptor d = Descriptor::decode(descriptor, "this engine");
  uint32_t version = kEndpointVersion;
  d.sections.emplace_back(kEndpointWireId, std::string(reinterpret_cast<const char*>(&version), sizeof(version)));
  descriptor_ = d.encode();
  listen_fd_ = listen_tcp(host, port, &port_);
  try {
    acceptor_ = std::thread([this] { accept_loop(); });
  } catch (const std::system_error& e) {
    ::close(listen_fd_);
    TIDEKV_THROW(kConfig, std::string("cannot start the endpoint's thread: ") + e.what());
  }
}

Endpoint::~Endpoint() { stop(); }

void Endpoint::stop() {
  if (stopping_.exchange(true)) return;
  ::shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
  if (acceptor_.joinable()) acceptor_.join();
  ::close(listen_fd_);
  std::list<Server> servers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);  // wakes their reads
    servers.swap(servers_);
  }
  for (auto& s : servers) s.thread.join();
}

std::vector<Notification> Endpoint::take() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Notification> out(std::make_move_iterator(received_.begin()), std::make_move_iterator(received_.end()));
  received_.clear();
  return out;
}

void Endpoint::accept_loop() {
  while (!stopping_.load()) {
    int fd = ::accept(listen_fd_, nullptr, nullptr);
    if (fd < 0) {
      if (stopping_.load()) return;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      log(LogLevel::kWarning, std::string("endpoint accept failed: ") + std::strerror(errno) + "; retrying in 100 ms");
      usleep(100000);
      continue;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_.load() || open_fds_.size() >= kMaxConnections) {
      ::close(fd);
      continue;
    }
    // A descriptor fetch per openSegment and a connection per link come and go: their
    // finished threads are joined here instead of piling up until stop().
    for (auto it = servers_.begin(); it != servers_.end();) {
      if (!it->is_finished) {
        ++it;
        continue;
      }
      it->thread.join();
      it = servers_.erase(it);
    }
    open_fds_.insert(fd);
    auto server = servers_.emplace(servers_.end());
    try {
      server->thread = std::thread([this, fd, server] {
        serve(fd, "endpoint peer fd " + std::to_string(fd));
        std::lock_guard<std::mutex> lock(mu_);
        server->is_finished = true;
      });
    } catch (const std::system_error&) {
      servers_.erase(server);
      open_fds_.erase(fd);
      ::close(fd);
    }
  }
}

void Endpoint::serve(int fd, std::string what) {
  try {
    tune_socket(fd, SocketOptions{1 << 20, handshake_timeout_ms_});
    SocketReader reader(fd, what);
    ServerHandshake handshake(secret_, what);
    std::vector<uint8_t> buf(256);
    while (handshake.step() != ServerHandshake::Step::kDone) {
      size_t n = handshake.wanted();
      reader.read_exact(buf.data(), n);
      std::string reply;
      const wire::Hello& hello = handshake.hello();
      bool is_endpoint = hello.conn_type == uint32_t(wire::ConnType::kDescriptor) || hello.transport == kEndpointWireId;
      Admission admission = handshake.step() != ServerHandshake::Step::kAuth || is_endpoint ? Admission::kAdmit
                                                                                             : Admission::kNoTransport;
      try {
        handshake.feed(buf.data(), descriptor_, admission, &reply);
      } catch (...) {
        if (!reply.empty()) send_all(fd, reply.data(), reply.size(), what);
        throw;
      }
      if (!reply.empty()) send_all(fd, reply.data(), reply.size(), what);
    }
    // A descriptor fetch (openSegment asking what listens here) ends with the descriptor.
    bool is_lookup_only = handshake.hello().conn_type == uint32_t(wire::ConnType::kDescriptor);
    std::string name, message;
    while (!is_lookup_only && !stopping_.load()) {
      EndpointFrame frame{};
      reader.read_exact(&frame, sizeof(frame), /*at_frame_boundary=*/true);
      if (frame.magic != kEndpointMagic || frame.version != kEndpointVersion || frame.name_bytes > kMaxNameBytes ||
          frame.message_bytes > kMaxMessageBytes) {
        send_reply(fd, 1, 0, what);
        TIDEKV_THROW(kPeerUnavailable, "malformed endpoint frame (or endpoint version " +
                                           std::to_string(frame.version) + ", this one speaks " +
                                           std::to_string(kEndpointVersion) + ")");
      }
      name.resize(frame.name_bytes);
      message.resize(frame.message_bytes);
      if (!name.empty()) reader.read_exact(name.data(), name.size());
      if (!message.empty()) reader.read_exact(message.data(), message.size());
      if (frame.kind == uint16_t(FrameKind::kLookup)) {
        send_reply(fd, 0, uint64_t(engine_port_), what);
      } else if (frame.kind == uint16_t(FrameKind::kNotify)) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          received_.push_back(Notification{name, message});
        }
        send_reply(fd, 0, 0, what);
      } else {
        send_reply(fd, 1, 0, what);
      }
    }
  } catch (const Error& e) {
    if (!stopping_.load() && e.kind() != ErrorKind::kHangup)
      log(LogLevel::kDebug, "endpoint connection closed: " + std::string(e.what()));
  } catch (const std::exception& e) {
    log(LogLevel::kWarning, "endpoint connection failed: " + std::string(e.what()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  open_fds_.erase(fd);
  ::close(fd);
}

EndpointLink::EndpointLink(const std::string& host, int port, const uint8_t instance[16], const std::string& secret,
                           int timeout_ms)
    : host_(host), port_(port), secret_(secret), timeout_ms_(timeout_ms) {
  std::memcpy(instance_, instance, sizeof(instance_));
  what_ = "endpoint " + host + ":" + std::to_string(port);
  std::lock_guard<std::mutex> lock(mu_);
  connect();
}

EndpointLink::~EndpointLink() {
  if (fd_ >= 0) ::close(fd_);
}

void EndpointLink::connect() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  int fd = connect_tcp(host_, port_, SocketOptions{1 << 20, timeout_ms_});
  try {
    SocketReader reader(fd, what_);
    Descriptor d = client_handshake(fd, reader, wire::ConnType::kData, kEndpointWireId, instance_, secret_, what_);
    fd_ = fd;
    descriptor_ = d.encode();
    EndpointReply r = exchange(FrameKind::kLookup, {}, {});
    if (r.value == 0 || r.value > 65535) TIDEKV_THROW(kPeerUnavailable, what_ + " named no engine port");
    engine_port_ = int(r.value);
  } catch (...) {
    ::close(fd);
    fd_ = -1;
    throw;
  }
}

EndpointReply EndpointLink::exchange(FrameKind kind, const std::string& name, const std::string& message) {
  EndpointFrame frame{kEndpointMagic, uint16_t(kind), kEndpointVersion, uint32_t(name.size()),
                      uint32_t(message.size())};
  struct iovec iov[3] = {{&frame, sizeof(frame)},
                         {const_cast<char*>(name.data()), name.size()},
                         {const_cast<char*>(message.data()), message.size()}};
  send_all(fd_, iov, 3, what_);
  EndpointReply reply{};
  SocketReader reader(fd_, what_);  // replies are the only bytes the endpoint sends: nothing is read ahead
  reader.read_exact(&reply, sizeof(reply), false, 0);
  if (reply.magic != kEndpointMagic || reply.status != 0)
    TIDEKV_THROW(kPeerUnavailable, what_ + " refused the request (status " + std::to_string(reply.status) + ")");
  return reply;
}

void EndpointLink::notify(const std::string& name, const std::string& message) {
  if (name.size() > kMaxNameBytes || message.size() > kMaxMessageBytes)
    refuse(-1, "notification too large (name " + std::to_string(name.size()) + " bytes, at most " +
                   std::to_string(kMaxNameBytes) + "; message " + std::to_string(message.size()) +
                   " bytes, at most " + std::to_string(kMaxMessageBytes) + ")");
  std::lock_guard<std::mutex> lock(mu_);
  try {
    if (fd_ < 0) connect();
    exchange(FrameKind::kNotify, name, message);
  } catch (const Error&) {
    // The connection may have outlived a peer restart on the same address: one fresh attempt.
    connect();
    exchange(FrameKind::kNotify, name, message);
  }
}

}  // namespace tidekv::capi
