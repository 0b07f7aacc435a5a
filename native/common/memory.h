// Where registered memory lives: host memory ("cpu") or a GPU ("cuda:N"). Transports say which
// pairs of locations they can serve; the engine picks one per request from that.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/errors.h"

namespace tidekv {

enum class MemoryKind : uint32_t { kCpu = 0, kCuda = 1 };

struct MemoryLocation {
  MemoryKind kind = MemoryKind::kCpu;
  int32_t device = 0;

  bool operator==(const MemoryLocation& o) const { return kind == o.kind && device == o.device; }
  std::string str() const { return kind == MemoryKind::kCpu ? "cpu" : "cuda:" + std::to_string(device); }
  // "cpu", "cuda" (device 0) or "cuda:N"; throws kConfig naming the bad text.
  static MemoryLocation parse(const std::string& text) {
    if (text == "cpu") return {};
    if (text == "cuda") return {MemoryKind::kCuda, 0};
    if (text.rfind("cuda:", 0) == 0 && text.size() > 5) {
      char* end = nullptr;
      long n = std::strtol(text.c_str() + 5, &end, 10);
      if (*end == '\0' && n >= 0 && n < 1024) return {MemoryKind::kCuda, int32_t(n)};
    }
    TIDEKV_THROW(kConfig, "location '" + text + "' is invalid; use 'cpu' or 'cuda:N'");
  }
};

}  // namespace tidekv
