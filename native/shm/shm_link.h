// The link to one same-host peer. The initiator does the copy itself: memcpy through a mapping
// of the peer's engine-allocated memory (memfd), or process_vm_readv/writev (cross-memory
// attach) for other registered memory. Every copy holds the peer's region-table guard, so it is
// refused unless the bytes lie inside a region registered there right now.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/context.h"
#include "regions/region_table.h"
#include "shm/shm_section.h"
#include "transport/transport.h"

namespace tidekv {

class ShmLink final : public PeerLink, public std::enable_shared_from_this<ShmLink> {
 public:
  // Null when the peer is not on this host (or its region table cannot be opened from here).
  static std::shared_ptr<ShmLink> open(EngineContext& ctx, const std::string& peer_name, const ShmSection& s);
  ~ShmLink() override;
  int preference(const Request& r, MemoryLocation local) const override;
  int host_preference() const override { return 10; }
  std::string refusal(const Request& r, MemoryLocation local) const override;
  void plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) override;
  bool is_current() const override { return is_peer_alive(); }
  bool is_local_copy() const override { return true; }
  void close() override { closed_.store(true); }

 private:
  struct Mapping {
    uint64_t generation;
    void* base;
    size_t length;
  };

  ShmLink(EngineContext& ctx, std::string peer_name, int pid, int pidfd, RegionTable table, bool cma_ok);
  bool is_peer_alive() const;
  void run(Batch& batch, const std::vector<Slice>& slices);
  // Copies one slice whose guard is held; throws a typed Error.
  void copy(const Slice& s, const RegionView& view);
  void copy_cma(const Slice& s);
  void* map_region(const RegionView& view);

  EngineContext& ctx_;
  std::string peer_name_;
  int pid_;
  int pidfd_;
  RegionTable table_;
  bool cma_ok_;
  std::atomic<bool> closed_{false};
  std::mutex map_mu_;
  std::map<uint32_t, Mapping> mappings_;  // by slot
};

}  // namespace tidekv
