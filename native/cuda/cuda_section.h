// The cuda transport's section of a descriptor: the same-host identity (pid, boot id, instance
// id) and the fds of the engine's region table and cuda export table, reached through /proc.
#pragma once

#include <cstdint>

namespace tidekv::cuda {

struct CudaSection {
  int32_t pid;
  int32_t table_fd;
  int32_t export_fd;
  uint32_t capacity;  // entries in the export table
  uint8_t token[16];  // the instance id (checked against the region table's)
  char boot_id[40];
};
static_assert(sizeof(CudaSection) == 72);

}  // namespace tidekv::cuda
