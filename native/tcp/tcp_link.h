// The initiating half of tcp: a pool of connections to one peer; each request is cut into
// slices and the slices are striped over the connections, pipelined (all WRITEs of a round are
// sent before its READs, so a round never waits on itself). The serving half is tcp_server.h.
// Local GPU memory is staged through the connection's pinned bounce memory (cuda/staging.h):
// a round's WRITE payloads are copied off the GPU while earlier ones are already being sent,
// READ payloads go on to the GPU while later ones are still arriving, and a round's GPU
// requests are reported done only once their copies have finished.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/context.h"
#include "common/socket.h"
#include "cuda/staging.h"
#include "regions/region_table.h"
#include "transport/transport.h"

namespace tidekv {

class TcpLink final : public PeerLink, public std::enable_shared_from_this<TcpLink> {
 public:
  TcpLink(EngineContext& ctx, PeerAddress peer);
  ~TcpLink() override;
  int preference(const Request& r, MemoryLocation local) const override;
  int host_preference() const override { return 1; }
  std::string refusal(const Request& r, MemoryLocation local) const override;
  void plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) override;
  void close() override;

 private:
  struct Connection {
    TcpLink* owner = nullptr;
    int fd = -1;
    std::unique_ptr<SocketReader> reader;
    std::chrono::steady_clock::time_point idle_since;
    std::unique_ptr<cuda::Stager> stager;  // made on the first round with GPU memory
    ~Connection();
  };
  // One stripe of a batch and how far it has got, so that a thread that must leave at its
  // deadline can hand the rest to a worker mid-way (the batch keeps running).
  struct Group {
    Batch* batch;
    std::shared_ptr<Batch> keep;
    std::vector<Slice> slices;  // WRITEs first
    std::vector<int16_t> device;  // per slice: its local GPU, -1 for host memory
    size_t done = 0;            // slices whose replies have been handled
    std::unique_ptr<Connection> conn;
    size_t window_begin = 0;    // the round in flight: slices [window_begin, window_end)
    size_t window_end = 0;
    std::vector<wire::RequestHeader> headers;
    std::vector<iovec> iov;
    std::vector<size_t> iov_mark;        // per iovec: the staging copy to wait for before sending it
    std::vector<size_t> staged_reads;    // READ slices of the round whose bytes are on their way to the GPU
    int iov_next = 0;
  };

  // Deadline-aware checkout: nullptr when the deadline passes before a connection is free.
  std::unique_ptr<Connection> checkout(const Deadline& deadline);
  std::unique_ptr<Connection> open_connection();
  void checkin(std::unique_ptr<Connection> conn);
  bool is_usable(const Connection& conn) const;
  void run(const std::shared_ptr<Group>& group, const Deadline& deadline);
  // Advances the group; false when it stopped at the deadline with work left.
  bool step(Group& g, const Deadline& deadline);
  void begin_window(Group& g);
  // Sends the round's frames, waiting for each staged payload just before it goes out.
  bool send_window(Group& g, const Deadline& deadline);
  // The round's staged copies have finished: its GPU READs are done.
  void finish_staged(Group& g);
  void handle_reply(Group& g);

  EngineContext& ctx_;
  PeerAddress peer_;
  const std::string& peer_name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Connection>> idle_;
  std::set<int> live_fds_;  // every open connection, idle or in use (close() shuts them down)
  int open_ = 0;
  int max_open_;  // connections_per_peer, lowered when the peer refuses more
  bool closed_ = false;
};

}  // namespace tidekv
