// The engine's listener: accepts connections, runs the server half of the handshake, answers
// descriptor requests and hands data connections to the tcp transport's serve_tcp(). A bad
// connection is dropped with a logged reason; the others keep being served.
#pragma once

#include <atomic>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/wire.h"
#include "engine/context.h"
#include "regions/region_table.h"

namespace tidekv {

class Server {
 public:
  Server(EngineContext& ctx, const RegionTable& regions, const wire::Descriptor& self);
  ~Server();
  int port() const { return port_; }
  void stop();

 private:
  struct Conn {
    int fd;
    std::thread thread;
    std::atomic<bool> finished{false};
  };
  void accept_loop();
  void serve(Conn* conn, std::string what);
  void reap_finished();

  EngineContext& ctx_;
  const RegionTable& regions_;
  wire::Descriptor self_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::mutex mu_;
  std::list<std::unique_ptr<Conn>> conns_;
};

}  // namespace tidekv
