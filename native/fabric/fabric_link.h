// The initiating half of fabric: one peer's endpoints in this engine's address vectors (rail k's
// domain holds the peer's rail k), and a control connection to the peer through its listener on
// which regions are looked up (base, length, a key per rail: cached until the peer revokes them)
// and revokes are acknowledged. Each request is checked against the region the peer registered
// before anything is posted, so a range outside it fails alone (a provider would take such an
// RMA and drop the connection); it is then cut into slices posted as one-sided reads and writes,
// all in flight at once, spread over the rails nearest the local memory (its NUMA node's NICs,
// else all), finished by the domains' progress threads. A write is reported done only once it has landed at the
// target (delivery-complete, or a read ordered after the batch's writes). Regions are cached only
// while the control connection lives (a revoke could not reach us otherwise); a lost one is
// reopened on the next lookup, whose handshake also tells the engine if the peer restarted.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/context.h"
#include "common/socket.h"
#include "fabric/fabric_domain.h"
#include "fabric/fabric_wire.h"
#include "transport/transport.h"

namespace tidekv::fabric {

class FabricLink final : public PeerLink, public std::enable_shared_from_this<FabricLink> {
 public:
  // One rail to the peer: this engine's domain (NIC) k, a few registered bytes on it that the
  // read confirming writes lands in, and the peer's endpoint on its rail k.
  struct Rail {
    Domain* domain;
    Registration scratch;
    std::string endpoint;
  };
  FabricLink(EngineContext& ctx, std::vector<Rail> rails, PeerAddress peer);
  ~FabricLink() override;
  int preference(const Request& r, MemoryLocation local) const override;
  int host_preference() const override { return 5; }
  std::string refusal(const Request& r, MemoryLocation local) const override;
  void plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) override;
  void close() override;

  // A region of the peer, as its lookup answered; `inflight` operations use it now.
  struct Remote {
    uint64_t base;
    uint64_t length;
    std::vector<uint64_t> keys;  // by rail
    uint32_t inflight = 0;  // guarded by the link's mu_
    bool revoked = false;
  };
  struct Group;
  // Bookkeeping of one posted slice's end (called by the slice's Op).
  void slice_finished(const std::shared_ptr<Group>& g, uint32_t request, const std::shared_ptr<Remote>& remote,
                      uint32_t rail, int err, const std::string& message);

 private:
  void run(const std::shared_ptr<Group>& g);
  void open_control();
  void read_control();
  // The peer's region covering [addr, +length): from the cache, else asked for. Null with
  // *status (wire::Status) when the peer has none; throws when the peer cannot be asked.
  std::shared_ptr<Remote> resolve(uint64_t addr, uint64_t length, uint32_t* status);
  // Throws once the peer is known to be gone: its control connection ended and a new one cannot
  // be opened (a dead process: refused). Cheap while the control connection lives. Given to every
  // post, whose wait for the provider would otherwise last io_timeout_ms (Domain::post).
  void check_peer();
  void send(const Msg& m);
  void request_done(const std::shared_ptr<Group>& g, uint32_t request);
  void post_flush(const std::shared_ptr<Group>& g);
  // The rails a request from local memory on `numa_node` takes: those whose NIC is on that node,
  // else every one (the node unknown, or no NIC there); only rails the region has a key on.
  uint32_t rails_for(int numa_node, const Remote& remote, uint32_t out[kMaxRails]) const;

  struct Path : Rail {
    explicit Path(Rail r) : Rail(std::move(r)) {}
    fi_addr_t addr = FI_ADDR_UNSPEC;  // guarded by the link's mu_
    std::atomic<bool> needs_new_address{false};
  };

  EngineContext& ctx_;
  std::vector<std::unique_ptr<Path>> rails_;
  const bool delivery_complete_;
  const uint64_t max_message_;
  PeerAddress peer_;
  std::atomic<uint32_t> next_rail_{0};  // where the next request's first slice goes

  std::mutex control_mu_;  // opening the control connection; sending on it
  int control_fd_ = -1;
  std::thread reader_;
  std::atomic<bool> control_lost_{false};  // the reader ended: reopen before the next lookup

  std::mutex mu_;  // the cache, lookups in flight, revokes
  std::condition_variable cv_;
  std::map<uint64_t, std::shared_ptr<Remote>> cache_;  // by base
  struct Answer {
    bool answered = false;
    uint32_t status = 0;
    std::shared_ptr<Remote> remote;
  };
  std::unordered_map<uint64_t, Answer> answers_;  // lookups in flight, by tag
  uint64_t next_tag_ = 1;
  bool closed_ = false;
};

}  // namespace tidekv::fabric
