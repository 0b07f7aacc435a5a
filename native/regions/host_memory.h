// Host memory the engine allocates itself (TransferEngine.allocate): by default a memfd that
// same-host peers map and copy with memcpy; `huge`: private anonymous memory on transparent huge
// pages, which same-host peers reach by cross-memory attach.
#pragma once

#include <cstdint>

namespace tidekv {

struct HostMemory {
  void* base = nullptr;     // the mapping (huge: a little larger than asked, for alignment)
  uint64_t mapped = 0;
  int memfd = -1;
  uint8_t* start = nullptr;  // where the `length` usable bytes begin

  // Maps and faults in `length` bytes; throws kConfig when the memory cannot be had.
  static HostMemory allocate(uint64_t length, bool huge);
  void release();
};

}  // namespace tidekv
