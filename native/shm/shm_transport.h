// shm: same-host peers. The initiator does the copy itself: memcpy through a mapping of the
// peer's engine-allocated memory (memfd), or process_vm_readv/writev (cross-memory attach) for
// other registered memory. Every copy holds the peer's region-table guard, so it is refused
// unless the bytes lie inside a region registered there right now.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/context.h"
#include "regions/region_table.h"
#include "transport/transport.h"

namespace tidekv {

class ShmTransport final : public Transport {
 public:
  // Null when the peer is not on this host (or its memory cannot be reached from here).
  static std::unique_ptr<ShmTransport> open(EngineContext& ctx, const std::string& peer_name, const wire::Descriptor& d);
  ~ShmTransport() override;
  const char* name() const override { return "shm"; }
  // Whether this transport can serve [remote, remote + length) of the peer right now.
  bool can_serve(uint64_t remote, uint64_t length) const;
  bool is_peer_alive() const;
  int peer_pid() const { return pid_; }
  const uint8_t* token() const { return token_; }
  void plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) override;
  void close() override { closed_.store(true); }

 private:
  struct Mapping {
    uint64_t generation;
    void* base;
    size_t length;
  };

  ShmTransport(EngineContext& ctx, std::string peer_name, int pid, int pidfd, RegionTable table, bool cma_ok);
  void run(Batch& batch, const std::vector<Slice>& slices);
  void copy(const Slice& s);
  // Copies slices[first..first+n) by cross-memory attach in one syscall and returns n (0 when
  // fewer than two slices from first on are such copies); *short_copy: not every byte arrived.
  size_t copy_vectored(const std::vector<Slice>& slices, size_t first, bool* short_copy);
  void* map_region(const RegionView& view);

  EngineContext& ctx_;
  std::string peer_name_;
  int pid_;
  int pidfd_;
  RegionTable table_;
  bool cma_ok_;
  uint8_t token_[16];
  std::atomic<bool> closed_{false};
  std::mutex map_mu_;
  std::map<uint32_t, Mapping> mappings_;  // by slot
};

}  // namespace tidekv
