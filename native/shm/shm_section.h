// The shm transport's section of a descriptor: enough for a same-host peer to find the engine's
// region table (pid and fd, reached through /proc) and to prove it is the same host and process
// (boot id; the instance id read back from token_addr by cross-memory attach).
#pragma once

#include <cstdint>

namespace tidekv {

struct ShmSection {
  int32_t pid;
  int32_t table_fd;
  uint64_t token_addr;  // where the engine's instance id lives in its own memory
  uint8_t token[16];    // the instance id
  char boot_id[40];
};
static_assert(sizeof(ShmSection) == 72);

}  // namespace tidekv
