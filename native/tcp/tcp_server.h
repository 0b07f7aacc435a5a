// The serving half of tcp: peers' data connections, after the listener authenticated them.
// A fixed pool of threads waits on one epoll set (EPOLLONESHOT: one thread per connection at a
// time) and serves a connection while it has frames, then hands it back to epoll; an idle
// connection costs a descriptor and a little memory, never a thread. WRITEs are read straight
// into the registered region, READ replies stream straight out of it; GPU regions go through
// the connection's pinned bounce memory (cuda/staging.h): a WRITE is acknowledged, and a READ's
// bytes sent, only after their device copy has finished.
//
// Limits: at most max_connections_per_peer connections of one peer engine (checked by admit()
// before the handshake completes); a connection idle for idle_timeout is closed; a hang-up is
// reaped as soon as epoll reports it. Nothing here terminates the process: a thread that cannot
// be started fails the engine's start-up with kConfig.
#pragma once

#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/context.h"
#include "common/socket.h"
#include "cuda/staging.h"
#include "regions/region_table.h"
#include "transport/transport.h"

namespace tidekv {

class TcpServer {
 public:
  TcpServer(EngineContext& ctx, const RegionTable& regions);
  ~TcpServer();
  bool admit(const uint8_t instance[16]);
  void adopt(Connection conn);
  void stop();

 private:
  using Instance = std::array<uint8_t, 16>;
  struct Conn {
    int fd;
    std::string what;
    Instance instance;
    std::unique_ptr<SocketReader> reader;  // made on first use: an idle connection holds no buffer
    std::unique_ptr<cuda::Stager> stager;  // made on the first frame into GPU memory
    std::atomic<int64_t> last_active_ms{0};
    bool busy = false;                     // a thread is serving it (guarded by mu_)
  };
  void run();
  // Serves frames while they come; false when the connection is finished (closed or broken).
  bool serve(Conn& c);
  // A READ or WRITE of GPU memory larger than the bounce memory: piece by piece, synchronously.
  void serve_large_staged(Conn& c, const wire::RequestHeader& h, const RegionView& region);
  void close_conn(Conn* c);
  void sweep_idle();

  EngineContext& ctx_;
  const RegionTable& regions_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::map<Conn*, std::unique_ptr<Conn>> conns_;
  std::map<Instance, int> per_peer_;
  std::atomic<int64_t> next_sweep_ms_{0};
  std::vector<std::thread> threads_;
};

}  // namespace tidekv
