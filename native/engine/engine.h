// The native transfer engine owned by tidekv.transfer.TransferEngine: registered regions, the
// listener, known peers with their transports, and the worker threads that run batch tasks.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/wire.h"
#include "engine/batch.h"
#include "engine/context.h"
#include "engine/server.h"
#include "regions/region_table.h"
#include "shm/shm_transport.h"
#include "tcp/tcp_transport.h"

namespace tidekv {

class Engine {
 public:
  explicit Engine(EngineOptions options);
  ~Engine();

  std::string name() const;
  const wire::Descriptor& descriptor() const { return self_; }
  EngineContext& context() { return ctx_; }

  void register_region(uint64_t addr, uint64_t length, const std::string& location);
  // Engine-owned registered memory; returns its address. By default a memfd that same-host
  // peers map; huge: private anonymous memory on transparent huge pages that same-host peers
  // reach by cross-memory attach.
  uint64_t allocate(uint64_t length, bool huge = false);
  // Unregisters (and frees, when allocate() made it) the region starting at addr.
  void unregister_region(uint64_t addr);

  // Asks host:port for its descriptor (the direct handshake).
  wire::Descriptor fetch_descriptor(const std::string& host, int port);
  // Adds or refreshes a peer; returns its id for requests.
  uint32_t add_peer(const std::string& name, const wire::Descriptor& d);
  // Id of a known peer, throws kUnknownPeer otherwise.
  uint32_t peer_id(const std::string& name);
  // Which transport requests to this peer take now ("tcp" or "shm").
  std::string peer_transport(const std::string& name);

  std::shared_ptr<Batch> submit(std::vector<Request> requests);
  void close();

 private:
  struct Peer {
    std::string name;
    std::string host;
    int port;
    std::mutex mu;
    wire::Descriptor descriptor;
    std::unique_ptr<TcpTransport> tcp;
    std::unique_ptr<ShmTransport> shm;
  };
  void worker_loop();
  void enqueue(const std::shared_ptr<Batch>& batch);
  void plan_peer(const std::shared_ptr<Batch>& batch, Peer& peer, const std::vector<uint32_t>& requests);
  void refresh_same_host(Peer& peer, const wire::Descriptor& d);

  EngineContext ctx_;
  uint8_t token_[16];
  wire::Descriptor self_{};
  RegionTable regions_;
  std::unique_ptr<Server> server_;
  std::mutex alloc_mu_;
  struct Allocation {
    void* base = nullptr;  // the mapping (huge: a little larger than asked, for alignment)
    uint64_t mapped = 0;
    int memfd = -1;
    void release();
  };
  std::map<uint64_t, Allocation> allocations_;  // by the registered address

  std::mutex peers_mu_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::unordered_map<std::string, uint32_t> peer_ids_;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  std::vector<std::thread> workers_;
  std::atomic<bool> closed_{false};
};

// Splits "host:port" / "[v6]:port"; throws kConfig naming the bad input.
void split_host_port(const std::string& name, std::string* host, int* port);

}  // namespace tidekv
