// How native messages name addresses and ranges, one way everywhere: "0x7f3e387ad000" and
// "READ [0x7f3e387ad000, +4096)", so a range in an error reads the same from every transport.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace tidekv {

inline std::string hex(uint64_t v) {
  char b[24];
  snprintf(b, sizeof(b), "0x%llx", (unsigned long long)v);
  return b;
}

// "[0x…, +length)"
inline std::string hex_range(uint64_t addr, uint64_t length) {
  return "[" + hex(addr) + ", +" + std::to_string(length) + ")";
}

// "READ [0x…, +length)"
inline std::string range_text(const char* op, uint64_t addr, uint64_t length) {
  return std::string(op) + " " + hex_range(addr, length);
}

}  // namespace tidekv
