// tcp: always available. Client side: a pool of connections per peer; each request is cut into
// slices and the slices are striped over the connections, pipelined (all WRITEs of a round are
// sent before its READs, so a round never waits on itself). Server side: serve_tcp() reads a
// WRITE straight into the registered region and streams a READ reply straight out of it.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/socket.h"
#include "engine/context.h"
#include "regions/region_table.h"
#include "transport/transport.h"

namespace tidekv {

class TcpTransport final : public Transport {
 public:
  using DescriptorCallback = std::function<void(const wire::Descriptor&)>;
  TcpTransport(EngineContext& ctx, std::string peer_name, std::string host, int port, DescriptorCallback on_connect);
  ~TcpTransport() override;
  const char* name() const override { return "tcp"; }
  void plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) override;
  void close() override;

 private:
  struct Slice {
    uint32_t request;
    wire::Op op;
    uint64_t local;
    uint64_t remote;
    uint64_t length;
  };
  struct Connection {
    TcpTransport* owner = nullptr;
    int fd = -1;
    std::unique_ptr<SocketReader> reader;
    ~Connection();
  };

  std::unique_ptr<Connection> checkout();
  void checkin(std::unique_ptr<Connection> conn);
  void run_group(Batch& batch, std::vector<Slice>& slices);
  void run_round(Connection& conn, Batch& batch, Slice* slices, size_t count, size_t* completed);

  EngineContext& ctx_;
  std::string peer_name_;
  std::string host_;
  int port_;
  DescriptorCallback on_connect_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Connection>> idle_;
  std::set<int> live_fds_;  // every open connection, idle or in use (close() shuts them down)
  int open_ = 0;
  bool closed_ = false;
};

// Serves one accepted data connection until it closes or misbehaves; throws with the reason.
void serve_tcp(int fd, SocketReader& reader, const RegionTable& regions, EngineContext& ctx, const std::string& what);

}  // namespace tidekv
