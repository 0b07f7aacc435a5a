// The peer descriptor as the engine handles it: an instance id and one opaque section per
// transport (layout in wire.h). Decoding checks magic, version and every length, so a malformed
// descriptor is refused by name instead of read past its end.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tidekv {

struct Descriptor {
  uint8_t instance[16] = {};
  std::vector<std::pair<uint16_t, std::string>> sections;  // (transport wire id, bytes)

  // The section of one transport; nullptr when the peer sent none.
  const std::string* section(uint16_t transport) const;
  bool same_instance(const Descriptor& other) const;
  std::string encode() const;
  // Throws kConfig (malformed) or kProtocolVersion (another version), naming `peer`.
  static Descriptor decode(const std::string& bytes, const std::string& peer);
};

}  // namespace tidekv
