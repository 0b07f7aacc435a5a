#include "engine/handshake.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "common/errors.h"
#include "common/sha256.h"

namespace tidekv {
namespace {

void random_bytes(uint8_t* out, size_t n) {
  static thread_local std::random_device rd;
  for (size_t i = 0; i < n; i += 4) {
    uint32_t v = rd();
    std::memcpy(out + i, &v, std::min<size_t>(4, n - i));
  }
}

wire::Auth compute_mac(const std::string& secret, const uint8_t server_nonce[32], const uint8_t client_nonce[32]) {
  uint8_t msg[64];
  std::memcpy(msg, server_nonce, 32);
  std::memcpy(msg + 32, client_nonce, 32);
  Digest d = hmac_sha256(secret, msg, sizeof(msg));
  wire::Auth auth{};
  std::memcpy(auth.mac, d.data(), 32);
  return auth;
}

std::string version_text(uint32_t v) { return "v" + std::to_string(v); }

}  // namespace

wire::Descriptor client_handshake(int fd, SocketReader& reader, wire::ConnType type, const std::string& secret,
                                  const std::string& what) {
  wire::Hello hello{wire::kMagic, wire::kProtocolVersion, uint32_t(type), 0, {}};
  random_bytes(hello.nonce, sizeof(hello.nonce));
  send_all(fd, &hello, sizeof(hello), what);
  wire::Challenge challenge{};
  reader.read_exact(&challenge, sizeof(challenge));
  if (challenge.magic != wire::kMagic)
    TIDEKV_THROW(kPeerUnavailable, "peer " + what + " is not a tidekv transfer engine (bad handshake magic)");
  if (challenge.status == uint32_t(wire::Status::kVersionMismatch) || challenge.version != wire::kProtocolVersion)
    TIDEKV_THROW(kProtocolVersion, "peer " + what + " speaks tidekv transfer protocol " +
                                       version_text(challenge.version) + ", this engine speaks " +
                                       version_text(wire::kProtocolVersion) +
                                       "; run the same tidekv version on both sides");
  wire::Auth auth{};
  if (challenge.secret_required) {
    if (secret.empty())
      TIDEKV_THROW(kAuth, "peer " + what + " requires a shared secret; set TransferConfig.secret "
                                           "(or TIDEKV_SECRET) to the peer's value");
    auth = compute_mac(secret, challenge.nonce, hello.nonce);
  }
  send_all(fd, &auth, sizeof(auth), what);
  wire::Welcome welcome{};
  reader.read_exact(&welcome, sizeof(welcome));
  if (welcome.magic != wire::kMagic)
    TIDEKV_THROW(kPeerUnavailable, "peer " + what + " sent a malformed handshake reply");
  if (welcome.status == uint32_t(wire::Status::kAuthFailed))
    TIDEKV_THROW(kAuth, "peer " + what + " refused our shared secret; check TransferConfig.secret on both sides");
  if (welcome.status != uint32_t(wire::Status::kOk))
    TIDEKV_THROW(kPeerUnavailable, "peer " + what + " refused the connection (status " +
                                       std::to_string(welcome.status) + ")");
  return welcome.descriptor;
}

wire::ConnType server_handshake(int fd, SocketReader& reader, const std::string& secret,
                                const wire::Descriptor& self, const std::string& what) {
  wire::Hello hello{};
  reader.read_exact(&hello, sizeof(hello));
  wire::Challenge challenge{wire::kMagic, wire::kProtocolVersion, uint32_t(wire::Status::kOk),
                            uint32_t(!secret.empty()), {}};
  if (hello.magic != wire::kMagic) TIDEKV_THROW(kPeerUnavailable, "bad handshake magic from " + what);
  if (hello.version != wire::kProtocolVersion) {
    challenge.status = uint32_t(wire::Status::kVersionMismatch);
    send_all(fd, &challenge, sizeof(challenge), what);
    TIDEKV_THROW(kProtocolVersion, "refused " + what + ": it speaks tidekv transfer protocol " +
                                       version_text(hello.version) + ", this engine speaks " +
                                       version_text(wire::kProtocolVersion));
  }
  if (hello.conn_type != uint32_t(wire::ConnType::kDescriptor) && hello.conn_type != uint32_t(wire::ConnType::kData))
    TIDEKV_THROW(kPeerUnavailable, "unknown connection type " + std::to_string(hello.conn_type) + " from " + what);
  random_bytes(challenge.nonce, sizeof(challenge.nonce));
  send_all(fd, &challenge, sizeof(challenge), what);
  wire::Auth auth{};
  reader.read_exact(&auth, sizeof(auth));
  wire::Welcome welcome{wire::kMagic, uint32_t(wire::Status::kOk), self};
  if (!secret.empty()) {
    wire::Auth expected = compute_mac(secret, challenge.nonce, hello.nonce);
    uint8_t diff = 0;
    for (int i = 0; i < 32; ++i) diff |= uint8_t(expected.mac[i] ^ auth.mac[i]);
    if (diff != 0) {
      welcome.status = uint32_t(wire::Status::kAuthFailed);
      std::memset(&welcome.descriptor, 0, sizeof(welcome.descriptor));
      send_all(fd, &welcome, sizeof(welcome), what);
      TIDEKV_THROW(kAuth, "refused " + what + ": missing or wrong shared secret");
    }
  }
  send_all(fd, &welcome, sizeof(welcome), what);
  return wire::ConnType(hello.conn_type);
}

}  // namespace tidekv
