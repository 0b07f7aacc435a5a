// One libfabric endpoint and everything around it, for one NIC of an engine (a "rail"; an engine
// stripes over up to kMaxRails of them): the provider chosen, the domain (NIC), an RDM endpoint with its address vector and completion queue, the memory
// registrations, and the progress thread. Both halves of the transport use it: as a target its
// registered regions are read and written by peers' NICs with no work of ours beyond progress
// (which providers with manual data progress, tcp among them, need from the target too); as an
// initiator its links post one-sided reads and writes on it and are told when each completes.
//
// Written to the strictest registration contract (FI_MR_LOCAL, VIRT_ADDR, ALLOCATED, PROV_KEY,
// ENDPOINT) and then following what the provider returned, so lenient providers run the same
// code: local descriptors are always passed, keys are the provider's (or unique ones of ours),
// and a remote address is virtual or an offset into its region exactly as mr_mode says.
//
// Thread safety: the domain is opened FI_THREAD_DOMAIN and every libfabric call on it is made
// under mu_; completions are handed to their operations outside it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/context.h"
#include "fabric/fabric_api.h"
#include "fabric/rdma/fi_domain.h"
#include "fabric/rdma/fi_endpoint.h"
#include "fabric/rdma/fi_eq.h"

namespace tidekv::fabric {

// One posted read or write. `context` is what the provider gets (its FI_CONTEXT2 scratch space
// first) and hands back with the completion.
struct Op {
  struct Context {
    fi_context2 provider;
    Op* op;
  } context{{}, this};
  std::chrono::steady_clock::time_point posted;
  fi_addr_t peer = FI_ADDR_UNSPEC;
  Op() = default;
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;
  virtual ~Op() = default;
  // Called once: err 0 on success, else a positive FI_E* code and the provider's words.
  virtual void finish(int err, const std::string& message) = 0;
};

struct Registration {
  uint64_t base;
  uint64_t length;
  uint64_t key;
  void* desc;   // local descriptor (fi_mr_desc), passed with every operation on this memory
  fid_mr* mr;
  int numa_node = -1;  // of the memory's first page when registered (-1: unknown, not placed yet)
};

class Domain {
 public:
  // Opens the provider `provider` (empty: the best RDMA one found, verbs then efa) on the NIC
  // (libfabric domain) named `nic`, or where `nic` is empty the one the interface of `host` is on
  // where the provider can say. nullptr with *why set when none can be opened.
  static std::unique_ptr<Domain> open(EngineContext& ctx, const std::string& provider, const std::string& nic,
                                      const std::string& host, std::string* why);
  // The NICs (domain names, sorted) `provider` offers here, loopback left out; for verbs and efa
  // only those with an active port. Empty when libfabric or the provider is missing.
  static std::vector<std::string> nics(const std::string& provider);
  // Whether `provider` moves data over RDMA NICs (verbs, efa), as opposed to a software provider.
  static bool is_rdma(const std::string& provider);
  ~Domain();
  void close();

  const std::string& provider() const { return provider_; }
  const std::string& domain_name() const { return domain_name_; }
  // The NIC's NUMA node from sysfs; -1 where it has none (virtual NICs, one-node machines).
  int numa_node() const { return numa_node_; }
  uint64_t mr_mode() const { return mr_mode_; }
  const std::string& endpoint_name() const { return name_; }
  // How a completed write is known to have landed: "delivery-complete" or "read-after-write".
  bool has_delivery_complete() const { return delivery_complete_; }
  uint64_t max_message() const { return max_message_; }
  // "mr_mode LOCAL|PROV_KEY; writes delivery-complete": how registrations and writes work here.
  std::string modes() const;

  // Registers [base, +length) for local and remote access; throws kConfig with the provider's words.
  // `numa_node` is the memory's node, kept with the registration to pick the nearest NIC.
  Registration register_memory(uint64_t base, uint64_t length, int numa_node = -1);
  void deregister(const Registration& r);
  // The registration of this engine covering [addr, +length), for local descriptors and lookups.
  bool find(uint64_t addr, uint64_t length, Registration* out) const;
  // The RMA address of `addr` in a remote region that starts at `base`, per mr_mode.
  uint64_t remote_address(uint64_t addr, uint64_t base) const {
    return (mr_mode_ & FI_MR_VIRT_ADDR) ? addr : addr - base;
  }

  // Address vector entries for peers' endpoints.
  fi_addr_t insert_peer(const std::string& name);
  void remove_peer(fi_addr_t addr);

  // Posts a read (into local) or write (from local); the op finishes through the progress thread.
  // Throws kTransfer when the provider refuses it outright; waits for room while the queue is full
  // (or the provider is connecting to the peer), up to io_timeout_ms. While it waits it calls
  // `check_peer` (when given), which throws to give up: libfabric 1.17's rxm answers every post to
  // a peer whose process is gone with -FI_EAGAIN (each post dials it again, the refusal stays
  // inside the provider), so only the caller can tell that waiting is pointless.
  void post(bool is_read, Op* op, uint64_t local, uint64_t length, void* desc, fi_addr_t peer, uint64_t remote,
            uint64_t key, const std::function<void()>& check_peer = {});
  // Operations that have not finished in io_timeout_ms are failed with FI_ETIMEDOUT (their
  // provider contexts stay allocated until a completion or close()).
  int io_timeout_ms() const { return io_timeout_ms_; }

 private:
  Domain(EngineContext& ctx) : ctx_(ctx), io_timeout_ms_(ctx.options.io_timeout_ms) {}
  bool setup(fi_info* info, std::string* why);
  // Reads completions and finishes their ops; returns how many. Any thread may call it.
  size_t progress();
  void progress_loop();
  void expire(std::chrono::steady_clock::time_point now);
  void wake();

  EngineContext& ctx_;
  const int io_timeout_ms_;
  std::string provider_;
  std::string domain_name_;
  int numa_node_ = -1;
  std::string name_;
  uint64_t mr_mode_ = 0;
  bool delivery_complete_ = false;
  uint64_t max_message_ = 0;
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_av* av_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_ep* ep_ = nullptr;
  int wait_fd_ = -1;  // the CQ's wait object, when the provider has one
  int wake_fd_ = -1;  // eventfd: a post wakes the progress thread when it sleeps

  mutable std::mutex mu_;  // every libfabric call on the domain
  std::unordered_set<Op*> outstanding_;  // posted, not finished
  std::unordered_set<Op*> expired_;      // failed by timeout; their completion may still come
  std::map<uint64_t, Registration> regions_;  // by base
  std::atomic<uint64_t> next_key_{1};
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> stop_{false};
  std::condition_variable room_;  // a post waiting for the queue to drain
  std::thread progress_thread_;
};

}  // namespace tidekv::fabric
