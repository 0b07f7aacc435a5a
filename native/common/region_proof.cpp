#include "common/region_proof.h"

#include <unistd.h>

#include <cstring>

#include "common/errors.h"
#include "common/handshake.h"
#include "common/socket.h"

namespace tidekv {

Digest region_proof_mac(const std::string& key, const uint8_t context[32], uint64_t base, uint64_t length) {
  static constexpr char kPrefix[] = "tidekv-region";
  uint8_t msg[sizeof(kPrefix) - 1 + 32 + 16];
  std::memcpy(msg, kPrefix, sizeof(kPrefix) - 1);
  std::memcpy(msg + sizeof(kPrefix) - 1, context, 32);
  std::memcpy(msg + sizeof(kPrefix) - 1 + 32, &base, 8);
  std::memcpy(msg + sizeof(kPrefix) - 1 + 40, &length, 8);
  return hmac_sha256(key, msg, sizeof(msg));
}

void check_region_proof(const std::string& host, int port, const std::string& secret, const wire::RegionProof& proof,
                        int timeout_ms) {
  std::string what = host + ":" + std::to_string(port);
  int fd = connect_tcp(host, port, SocketOptions{64 << 10, timeout_ms});
  wire::RegionVerdict verdict{};
  try {
    SocketReader reader(fd, what);
    uint8_t instance[16];
    random_bytes(instance, sizeof(instance));  // not an engine: nothing to bound connections by
    client_handshake(fd, reader, wire::ConnType::kRegionProof, 0, instance, secret, what);
    send_all(fd, &proof, sizeof(proof), what);
    reader.read_exact(&verdict, sizeof(verdict));
    ::close(fd);
  } catch (...) {
    ::close(fd);
    throw;
  }
  std::string range = "[" + std::to_string(proof.base) + ", +" + std::to_string(proof.length) + ")";
  if (verdict.magic != wire::kMagic)
    TIDEKV_THROW(kPeerUnavailable, "engine " + what + " sent a malformed region verdict");
  if (verdict.status == uint32_t(wire::Status::kNotRegistered))
    TIDEKV_THROW(kNotRegistered, "engine " + what + " has no live region covering " + range);
  if (verdict.status == uint32_t(wire::Status::kAuthFailed))
    TIDEKV_THROW(kAuth, "engine " + what + " does not vouch for " + range +
                            ": the proof was not made by that engine's process");
  if (verdict.status != uint32_t(wire::Status::kOk))
    TIDEKV_THROW(kPeerUnavailable, "engine " + what + " answered the region proof with status " +
                                       std::to_string(verdict.status));
}

}  // namespace tidekv
