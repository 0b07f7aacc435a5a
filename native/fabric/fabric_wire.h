// What the fabric transport puts on the wire besides RMA: its descriptor section (how to reach
// this engine's endpoints, one per NIC), and the frames of its control connection, a tcp
// connection through the engine's listener (greeting transport id kFabric) on which an initiator
// looks up the regions it reads and writes (base, length, a key per NIC) and the target revokes
// them when they are unregistered. Little-endian, fixed size; a change bumps wire::kProtocolVersion.
#pragma once

#include <cstdint>

namespace tidekv::fabric {

constexpr uint32_t kSectionMagic = 0x32464b54;  // "TKF2"
constexpr uint32_t kMsgMagic = 0x4d464b54;      // "TKFM"
constexpr size_t kMaxNameBytes = 256;  // an endpoint name (fi_getname) tidekv carries
// NICs (libfabric domains) one engine stripes over: Mooncake's largest published boxes have 8.
constexpr uint32_t kMaxRails = 8;

// The section: this header, then `rails` Rail entries, one per NIC in the engine's rail order
// (an initiator's rail k talks to the target's rail k).
struct Section {
  uint32_t magic;
  uint32_t rails;
  uint64_t mr_mode;        // the domains' memory-registration mode (addressing of RMA targets)
  char provider[64];       // e.g. "verbs;ofi_rxm": peers on another provider cannot reach it
};

struct Rail {
  uint32_t name_bytes;     // of `name`, the endpoint's fi_getname()
  int32_t numa_node;       // the NIC's NUMA node, -1 unknown
  uint8_t name[kMaxNameBytes];
};

enum class MsgKind : uint32_t {
  kLookup = 1,     // initiator -> target: the region covering [addr, +length)?
  kRegion = 2,     // target -> initiator, answers a kLookup (same tag): status, base, length, keys
  kRevoke = 3,     // target -> initiator: region at `addr` with keys[0] is going; ack once unused
  kRevokeAck = 4,  // initiator -> target (same tag): nothing of ours is in flight to it any more
};

struct Msg {
  uint32_t magic;
  uint32_t kind;
  uint64_t tag;
  uint64_t addr;
  uint64_t length;
  uint32_t status;  // wire::Status
  uint32_t rails;   // how many of `keys` hold a key: the region's, rail by rail
  uint64_t keys[kMaxRails];
};

static_assert(sizeof(Section) == 80);
static_assert(sizeof(Rail) == 264);
static_assert(sizeof(Msg) == 104);

}  // namespace tidekv::fabric
