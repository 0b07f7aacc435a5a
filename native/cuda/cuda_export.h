// What a same-host peer needs to open this engine's GPU regions, published the way the region
// table is: in memfds that the peer opens through /proc/<pid>/fd.
//
// - The export table (one memfd per engine) has one entry per region-table slot: the
//   generation of the region it describes and the fd of that region's record.
// - A region's record (one memfd per cuda region) lists the allocations the region spans, as
//   the driver reports them (cuMemGetAddressRange): for an ordinary (cudaMalloc'd) allocation a
//   CUDA IPC handle; for virtual-memory-managed memory (PyTorch's expandable segments) the fd
//   of a POSIX shareable handle, which the peer takes with pidfd_getfd and maps itself.
// An allocation that can be exported neither way is listed with kind kNone and why, and
// requests into it are refused by the cuda link (they go to a staged transport instead).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cuda/cuda_api.h"
#include "regions/region_table.h"

namespace tidekv::cuda {

enum class ChunkKind : uint32_t { kNone = 0, kIpc = 1, kVmm = 2 };

struct ChunkRecord {
  uint64_t base;  // in the owner's address space
  uint64_t size;
  ChunkKind kind;
  int32_t fd;     // kVmm: the shareable handle's fd in the owner
  CUipcMemHandle ipc;
  char why[40];   // kNone: why it cannot be exported
};
static_assert(sizeof(ChunkRecord) == 128);

struct RecordHeader {
  uint64_t magic;
  uint32_t count;
  int32_t device;
  char pci_bus[16];
  uint8_t reserved[32];
};
static_assert(sizeof(RecordHeader) == 64);

struct ExportEntry {
  std::atomic<uint64_t> generation;  // of the region-table slot it describes; 0: none
  int32_t record_fd;
  uint32_t record_bytes;
};
static_assert(sizeof(ExportEntry) == 16);

// A region's allocations as read back from a record (either side).
struct RegionRecord {
  int device = 0;
  std::string pci_bus;
  std::vector<ChunkRecord> chunks;
};

class ExportTable {
 public:
  explicit ExportTable(uint32_t capacity);
  ~ExportTable();
  int fd() const { return fd_; }
  // Builds and publishes the record of a cuda region (throws kConfig when the range is not GPU
  // memory the driver knows, or not all on view.location's device).
  void add(const RegionView& view);
  void remove(const RegionView& view);

 private:
  struct Owned {
    int record_fd = -1;
    std::vector<int> handle_fds;
  };
  int fd_ = -1;
  uint32_t capacity_;
  ExportEntry* entries_ = nullptr;
  std::mutex mu_;
  std::vector<Owned> owned_;  // by slot
};

// Reads a peer's record for `view` (its region-table view); nullopt when the peer has not
// published one for that generation.
std::optional<RegionRecord> read_record(int pid, const ExportEntry* table, uint32_t capacity, const RegionView& view);

// The allocations covering [addr, addr + length) of this process, each exported for peers (the
// fds it creates go to *fds); throws kConfig when the range is not GPU memory of `device`.
RegionRecord build_record(uint64_t addr, uint64_t length, int device, std::vector<int>* fds);

}  // namespace tidekv::cuda
