// The link to one same-host peer. The initiator does the copy itself: memcpy through a mapping
// of the peer's engine-allocated memory (memfd), or process_vm_readv/writev (cross-memory
// attach) for other registered memory. A peer in this very process (an engine reaching itself,
// as a store client writing into its own segment does, or another engine of the process) is
// copied with plain memcpy at its own addresses: its memory is this process's, and the kernel's
// cross-memory copy of it moves ~1/1.5 of what memmove does per thread (256 x 1 MiB,
// benchmarks/mooncake_store_api.py --probe).
// Every copy holds the peer's region-table guard, so it is refused unless the bytes lie inside a
// region registered there right now, and the peer's table says whether its engine is still open
// (RegionTable::is_owner_alive) without a system call.
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
  bool is_current() const override { return table_.is_owner_alive(); }
  bool is_local_copy() const override { return true; }
  void close() override { closed_.store(true); }

 private:
  struct Mapping {
    uint64_t generation;
    void* base;
    size_t length;
  };

  ShmLink(EngineContext& ctx, std::string peer_name, int pid, RegionTable table, bool cma_ok, bool is_same_process);
  // `stream`: the batch is large enough to copy with streaming stores (common/copy.h).
  void run(Batch& batch, const std::vector<Slice>& slices, bool stream);
  // Copies one slice whose guard is held, to or from `remote` as this process sees it.
  void copy(const Slice& s, uint8_t* remote, bool stream);
  void copy_cma(const Slice& s);
  void* map_region(const RegionView& view);

  EngineContext& ctx_;
  std::string peer_name_;
  int pid_;
  RegionTable table_;
  bool cma_ok_;
  // The peer is this process: copies are memcpy at the peer's own addresses, and their guards
  // count as local in-flight copies (an unregister waits for them without a timeout; a copy by
  // a thread of this process always ends).
  bool is_same_process_;
  std::atomic<bool> closed_{false};
  std::mutex map_mu_;
  std::map<uint32_t, Mapping> mappings_;  // by slot
};

}  // namespace tidekv
