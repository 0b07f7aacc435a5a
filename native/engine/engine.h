// The native transfer engine owned by tidekv.transfer.TransferEngine: registered regions, the
// listener, the transports, known peers with one link per transport that reaches them, and the
// worker threads that run batch tasks. It picks a transport per request: the link of that
// request's peer that rates it highest (or the forced transport, which fails a request it
// cannot serve instead of falling back).
#pragma once

#include <atomic>
#include <chrono>
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

#include "batch/batch.h"
#include "common/context.h"
#include "common/descriptor.h"
#include "engine/listener.h"
#include "regions/host_memory.h"
#include "regions/region_table.h"
#include "transport/transport.h"

namespace tidekv {

struct TransportStatus {
  std::string name;
  bool available;
  std::string reason;
};

class Engine {
 public:
  explicit Engine(EngineOptions options);
  ~Engine();

  std::string name() const;
  // This engine's encoded descriptor (what peers need to reach it).
  const std::string& descriptor() const { return descriptor_bytes_; }
  EngineContext& context() { return ctx_; }
  std::vector<TransportStatus> transports() const;

  void register_region(uint64_t addr, uint64_t length, const std::string& location);
  // Engine-owned registered memory; returns its address. By default a memfd that same-host
  // peers map; huge: private anonymous memory on transparent huge pages that same-host peers
  // reach by cross-memory attach.
  uint64_t allocate(uint64_t length, bool huge = false);
  // Unregisters (and frees, when allocate() made it) the region starting at addr.
  void unregister_region(uint64_t addr);

  // This process's proof that [addr, +length) is its own memory, bound to `context` (32 bytes;
  // common/region_proof.h). Throws kNotRegistered unless a live region of this engine covers it.
  std::string region_proof(const std::string& context, uint64_t addr, uint64_t length) const;
  // What the listener answers a peer that presents a region proof.
  wire::Status verify_region(const wire::RegionProof& proof) const;

  // Asks host:port for its encoded descriptor (the direct handshake).
  std::string fetch_descriptor(const std::string& host, int port);
  // Adds or refreshes a peer from its encoded descriptor; returns its id for requests.
  uint32_t add_peer(const std::string& name, const std::string& descriptor);
  // Id of a known peer; throws kConfig when the name was never added.
  uint32_t peer_id(const std::string& name);
  // The transports that reach this peer now, best first for host memory.
  std::vector<std::string> peer_transports(const std::string& name);

  std::shared_ptr<Batch> submit(std::vector<Request> requests);
  void close();

 private:
  struct Peer {
    std::string name;
    std::string host;
    int port;
    std::mutex mu;
    Descriptor descriptor;
    std::vector<std::shared_ptr<PeerLink>> links;  // by transport index; null: not reachable by it
    uint64_t generation = 0;                       // relinks begun (relink installs only its own, the latest)
  };
  void worker_loop();
  void enqueue(const std::shared_ptr<Batch>& batch);
  // Queues a small task for its batch's waiter to run, with a worker as the fallback after
  // defer_grace_us: a kernel timer (defer_timer_fd_) wakes the watcher thread at the first
  // unclaimed deadline, and a waiter that claims the task stops it, so a task that is waited
  // for (nearly all) wakes no thread at all.
  void defer(const std::shared_ptr<Task>& task);
  // A deferred task was claimed: forgets the claimed ones at the front, stops the timer when
  // none is left. Called with queue_mu_ not held.
  void deferred_claimed();
  // The watcher thread: hands deferred tasks that reached their deadline unclaimed to a worker.
  void watch_deferred();
  // Called with queue_mu_ held: the timer fires at `when` (a zero time point: never).
  void arm_defer_timer(std::chrono::steady_clock::time_point when);
  // Chooses a link for each request and plans them; `locations` are the requests' local ones.
  void plan_peer(const std::shared_ptr<Batch>& batch, Peer& peer, const std::vector<uint32_t>& requests,
                 const std::vector<MemoryLocation>& locations, bool* all_same_host);
  // Installs descriptor `d` for `peer`, rebuilding the links whose section changed. Takes
  // peer.mu itself and must be called without it: the transports' connect() runs outside the
  // lock (it may block - tcp dials, an RDMA connect exchanges endpoints - while every submit to
  // the peer takes that lock). Of two relinks that overlap, the one begun last is installed.
  void relink(Peer& peer, const Descriptor& d);
  void refresh_if_stale(Peer& peer);
  // Called with peer.mu held: whether a link no longer trusts what it knows of the peer.
  static bool has_stale_link(const Peer& peer);
  // Why no link of `peer` takes request r (the per-request error).
  std::string no_route(const Peer& peer, const Request& r, MemoryLocation local) const;
  PeerAddress address_of(Peer& peer);
  // Registers [addr, +length) in the region table and tells every transport.
  void add_region(uint64_t addr, uint64_t length, int memfd, MemoryLocation where);

  EngineContext ctx_;
  RegionTable regions_;
  std::vector<std::unique_ptr<Transport>> transports_;
  std::vector<Availability> availability_;
  int forced_ = -1;  // index into transports_, or -1 for auto
  std::unique_ptr<Listener> listener_;
  std::string descriptor_bytes_;
  std::string proof_key_;  // random; never leaves this process (region proofs)
  std::mutex alloc_mu_;
  std::map<uint64_t, HostMemory> allocations_;  // by the registered address

  std::mutex peers_mu_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::unordered_map<std::string, uint32_t> peer_ids_;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  std::deque<std::shared_ptr<Task>> deferred_;  // in deadline order (one grace period for all)
  int defer_timer_fd_ = -1;                     // timerfd: fires at the first unclaimed deadline
  bool is_timer_armed_ = false;                 // guarded by queue_mu_
  std::thread watcher_;                         // sleeps in read(defer_timer_fd_)
  std::vector<std::thread> workers_;
  std::atomic<bool> closed_{false};
};

// Splits "host:port" / "[v6]:port"; throws kConfig naming the bad input.
void split_host_port(const std::string& name, std::string* host, int* port);

}  // namespace tidekv
