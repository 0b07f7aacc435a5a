// The engine's listener: one thread and an epoll set. It accepts connections, runs the server
// half of the handshake on non-blocking sockets (a silent or slow client holds no thread and
// is dropped at handshake_timeout), answers descriptor requests and region proofs, and hands each authenticated
// data connection to the transport its greeting names. Resource failures are refused and
// counted, never fatal: out of descriptors, it sheds the backlog through a reserve descriptor
// and logs once per interval; past max_connections it refuses.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>

#include "common/context.h"
#include "common/handshake.h"
#include "transport/transport.h"

namespace tidekv {

class Listener {
 public:
  // The transport that serves data connections with this wire id (nullptr: none).
  using Router = std::function<Transport*(uint16_t)>;
  // Binds host:port (throws kConfig); serving starts with start(). `verify` answers region proofs.
  Listener(EngineContext& ctx, Router route, RegionVerifier verify);
  ~Listener();
  int port() const { return port_; }
  // Starts the thread (throws kConfig when it cannot be had). `descriptor`: what descriptor
  // requests and every handshake send.
  void start(std::string descriptor);
  void stop();

 private:
  struct Pending {
    Pending(int fd_, std::string what_, const std::string& secret, std::chrono::steady_clock::time_point deadline_)
        : fd(fd_), what(std::move(what_)), handshake(secret, what), deadline(deadline_) {}
    int fd;
    std::string what;
    ServerHandshake handshake;
    uint8_t buf[std::max(sizeof(wire::Hello), sizeof(wire::RegionProof))] = {};
    size_t got = 0;
    std::chrono::steady_clock::time_point deadline;
  };
  void loop();
  void accept_ready();
  void shed_one(int err);
  void advance(Pending* p);
  void drop(Pending* p);
  void sweep();
  void watch_listener(bool on);

  EngineContext& ctx_;
  Router route_;
  RegionVerifier verify_;
  std::string descriptor_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  int reserve_fd_ = -1;  // spent to accept-and-close when descriptors run out
  int port_ = 0;
  bool listening_ = true;
  std::chrono::steady_clock::time_point resume_at_{};
  std::unordered_map<int, std::unique_ptr<Pending>> pending_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace tidekv
