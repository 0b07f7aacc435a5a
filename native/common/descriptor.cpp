#include "common/descriptor.h"

#include <cstring>

#include "common/errors.h"
#include "common/wire.h"

namespace tidekv {

const std::string* Descriptor::section(uint16_t transport) const {
  for (const auto& [id, bytes] : sections)
    if (id == transport) return &bytes;
  return nullptr;
}

bool Descriptor::same_instance(const Descriptor& other) const {
  return std::memcmp(instance, other.instance, sizeof(instance)) == 0;
}

std::string Descriptor::encode() const {
  wire::DescriptorHeader h{wire::kMagic, wire::kProtocolVersion, uint32_t(sections.size()), 0, {}};
  std::memcpy(h.instance, instance, sizeof(instance));
  std::string out(reinterpret_cast<const char*>(&h), sizeof(h));
  for (const auto& [id, bytes] : sections) {
    wire::SectionHeader s{id, 0, uint32_t(bytes.size())};
    out.append(reinterpret_cast<const char*>(&s), sizeof(s));
    out.append(bytes);
  }
  return out;
}

Descriptor Descriptor::decode(const std::string& bytes, const std::string& peer) {
  wire::DescriptorHeader h{};
  if (bytes.size() < sizeof(h) || bytes.size() > wire::kMaxDescriptorBytes)
    TIDEKV_THROW(kConfig, "descriptor of peer " + peer + " is malformed (" + std::to_string(bytes.size()) + " bytes)");
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (h.magic != wire::kMagic) TIDEKV_THROW(kConfig, "descriptor of peer " + peer + " is malformed (bad magic)");
  if (h.version != wire::kProtocolVersion)
    TIDEKV_THROW(kProtocolVersion, "peer " + peer + " speaks tidekv transfer protocol v" + std::to_string(h.version) +
                                       ", this engine speaks v" + std::to_string(wire::kProtocolVersion) +
                                       "; run the same tidekv version on both sides");
  Descriptor d;
  std::memcpy(d.instance, h.instance, sizeof(d.instance));
  size_t at = sizeof(h);
  for (uint32_t i = 0; i < h.sections; ++i) {
    wire::SectionHeader s{};
    if (bytes.size() - at < sizeof(s))
      TIDEKV_THROW(kConfig, "descriptor of peer " + peer + " is malformed (section " + std::to_string(i) + " cut off)");
    std::memcpy(&s, bytes.data() + at, sizeof(s));
    at += sizeof(s);
    if (bytes.size() - at < s.length)
      TIDEKV_THROW(kConfig, "descriptor of peer " + peer + " is malformed (section " + std::to_string(i) +
                                " claims " + std::to_string(s.length) + " bytes)");
    d.sections.emplace_back(s.transport, bytes.substr(at, s.length));
    at += s.length;
  }
  if (at != bytes.size())
    TIDEKV_THROW(kConfig, "descriptor of peer " + peer + " is malformed (trailing bytes)");
  return d;
}

}  // namespace tidekv
