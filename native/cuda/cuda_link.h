// The link to one same-host peer for requests with GPU memory on either side. The initiator
// copies with the driver (cuMemcpyAsync on a stream of its own thread, one synchronisation per
// task): the peer's GPU allocations are opened through CUDA IPC handles or imported POSIX-fd
// handles (VMM memory), its host memory through the mapping of its allocate()d memfds. Every
// copy holds the peer's region-table guard until the stream has finished with it, so the peer's
// unregister() waits for it and nothing is touched after unregister() returns.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/context.h"
#include "cuda/cuda_export.h"
#include "cuda/cuda_section.h"
#include "regions/region_table.h"
#include "transport/transport.h"

namespace tidekv::cuda {

class CudaLink final : public PeerLink, public std::enable_shared_from_this<CudaLink> {
 public:
  // Null when the peer is not on this host (or its tables cannot be opened from here).
  static std::shared_ptr<CudaLink> open(EngineContext& ctx, const std::string& peer_name, const CudaSection& s);
  ~CudaLink() override;
  int preference(const Request& r, MemoryLocation local) const override;
  int host_preference() const override { return 0; }  // never host to host
  std::string refusal(const Request& r, MemoryLocation local) const override;
  void plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) override;
  bool is_current() const override;
  bool is_local_copy() const override { return true; }
  void close() override { closed_.store(true); }

  static constexpr int kPreference = 20;

 private:
  // A peer region as this process reaches it: per allocation, where it is mapped here.
  struct Piece {
    uint64_t remote = 0;  // base in the peer's address space
    uint64_t size = 0;
    uint64_t local = 0;  // 0: not reachable (why)
    ChunkKind kind = ChunkKind::kNone;
    CUmemGenericAllocationHandle vmm = 0;  // kVmm: the imported handle
    std::string why;
  };
  struct Opened {
    RegionView view{};          // the peer's region it was opened for
    uint64_t generation = 0;
    MemoryLocation location;
    int device = 0;  // the local device it was opened on (GPU regions)
    std::vector<Piece> pieces;  // by remote base
    void* host_map = nullptr;   // host regions: the mapping of the peer's memfd
    size_t host_len = 0;
    std::string why;            // the whole region is unreachable (no record, no memfd)
    ~Opened();
    // Where [remote, +length) is here, or 0 with *why set; *span: how much of it one mapping holds.
    uint64_t translate(uint64_t remote, uint64_t length, uint64_t* span, std::string* why) const;
  };

  CudaLink(EngineContext& ctx, std::string peer_name, const CudaSection& s, int pidfd, RegionTable table,
           const ExportEntry* exports, size_t exports_len);
  std::shared_ptr<Opened> opened(const RegionView& view) const;
  // Closes what was opened for regions the peer has unregistered since (at most once a second):
  // an IPC mapping would otherwise keep the peer's freed GPU memory allocated.
  void sweep() const;
  std::shared_ptr<Opened> open_region(const RegionView& view) const;
  bool is_peer_alive() const;
  // Whether this link can serve r; *why says why not.
  bool refusal_reason(const Request& r, MemoryLocation local, std::string* why) const;
  void run(Batch& batch, const std::vector<Slice>& slices);

  EngineContext& ctx_;
  std::string peer_name_;
  int pid_;
  bool same_process_;
  int pidfd_;
  RegionTable table_;
  const ExportEntry* exports_;
  size_t exports_len_;
  uint32_t capacity_;
  std::atomic<bool> closed_{false};
  mutable std::mutex mu_;
  mutable std::map<uint32_t, std::shared_ptr<Opened>> opened_;  // by slot
  mutable std::chrono::steady_clock::time_point next_sweep_{};
};

}  // namespace tidekv::cuda
