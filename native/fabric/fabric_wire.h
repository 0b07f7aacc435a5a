// What the fabric transport puts on the wire besides RMA: its descriptor section (how to reach
// this engine's endpoint), and the frames of its control connection, a tcp connection through
// the engine's listener (greeting transport id kFabric) on which an initiator looks up the
// regions it reads and writes (base, length, key) and the target revokes them when they are
// unregistered. Little-endian, fixed size; a change bumps wire::kProtocolVersion.
#pragma once

#include <cstdint>

namespace tidekv::fabric {

constexpr uint32_t kSectionMagic = 0x42464b54;  // "TKFB"
constexpr uint32_t kMsgMagic = 0x4d464b54;      // "TKFM"
constexpr size_t kMaxNameBytes = 256;  // an endpoint name (fi_getname) tidekv carries

struct Section {
  uint32_t magic;
  uint32_t name_bytes;     // of `name`, the endpoint's fi_getname()
  uint64_t mr_mode;        // the domain's memory-registration mode (addressing of RMA targets)
  char provider[64];       // e.g. "verbs;ofi_rxm": peers on another provider cannot reach it
  uint8_t name[kMaxNameBytes];
};

enum class MsgKind : uint32_t {
  kLookup = 1,     // initiator -> target: the region covering [addr, +length)?
  kRegion = 2,     // target -> initiator, answers a kLookup (same tag): status, base, length, key
  kRevoke = 3,     // target -> initiator: region at `addr` with `key` is going; ack once unused
  kRevokeAck = 4,  // initiator -> target (same tag): nothing of ours is in flight to it any more
};

struct Msg {
  uint32_t magic;
  uint32_t kind;
  uint64_t tag;
  uint64_t addr;
  uint64_t length;
  uint64_t key;
  uint32_t status;  // wire::Status
  uint32_t reserved;
};

static_assert(sizeof(Section) == 336);
static_assert(sizeof(Msg) == 48);

}  // namespace tidekv::fabric
