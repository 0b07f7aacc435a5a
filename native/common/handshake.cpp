#include "common/handshake.h"

#include <cstring>
#include <random>

#include "common/errors.h"
#include "common/sha256.h"

namespace tidekv {
namespace {

wire::Auth compute_mac(const std::string& secret, const uint8_t server_nonce[32], const uint8_t client_nonce[32]) {
  uint8_t msg[64];
  std::memcpy(msg, server_nonce, 32);
  std::memcpy(msg + 32, client_nonce, 32);
  Digest d = hmac_sha256(secret, msg, sizeof(msg));
  wire::Auth auth{};
  std::memcpy(auth.mac, d.data(), 32);
  return auth;
}

// The server's proof: the same key over a message a client's proof can never be (its prefix).
wire::Auth server_mac(const std::string& secret, const uint8_t client_nonce[32], const uint8_t server_nonce[32]) {
  static constexpr char kPrefix[] = "tidekv-server";
  uint8_t msg[sizeof(kPrefix) - 1 + 64];
  std::memcpy(msg, kPrefix, sizeof(kPrefix) - 1);
  std::memcpy(msg + sizeof(kPrefix) - 1, client_nonce, 32);
  std::memcpy(msg + sizeof(kPrefix) - 1 + 32, server_nonce, 32);
  Digest d = hmac_sha256(secret, msg, sizeof(msg));
  wire::Auth auth{};
  std::memcpy(auth.mac, d.data(), 32);
  return auth;
}

bool same_mac(const wire::Auth& a, const uint8_t* b) {
  uint8_t diff = 0;
  for (int i = 0; i < 32; ++i) diff |= uint8_t(a.mac[i] ^ b[i]);
  return diff == 0;
}

std::string version_text(uint32_t v) { return "v" + std::to_string(v); }

constexpr size_t kGreetingBytes = 8;  // Hello.magic and Hello.version: the same in every version

template <typename T>
void append(std::string* out, const T& value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(value));
}

}  // namespace

void random_bytes(uint8_t* out, size_t n) {
  static thread_local std::random_device rd;
  for (size_t i = 0; i < n; i += 4) {
    uint32_t v = rd();
    std::memcpy(out + i, &v, std::min<size_t>(4, n - i));
  }
}

Descriptor client_handshake(int fd, SocketReader& reader, wire::ConnType type, uint16_t transport,
                            const uint8_t instance[16], const std::string& secret, const std::string& what) {
  wire::Hello hello{wire::kMagic, wire::kProtocolVersion, uint32_t(type), transport, 0, {}, {}};
  random_bytes(hello.nonce, sizeof(hello.nonce));
  std::memcpy(hello.instance, instance, sizeof(hello.instance));
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
  } else if (!secret.empty()) {
    // We hold a secret and the peer asks for none: it could be anyone listening on that
    // address, and our READs would take its bytes, our WRITEs give it ours.
    TIDEKV_THROW(kAuth, "peer " + what + " does not require the shared secret this engine has (it runs without "
                                         "TransferConfig.secret / TIDEKV_SECRET); refusing to exchange data "
                                         "with a peer that cannot prove it holds the secret");
  }
  send_all(fd, &auth, sizeof(auth), what);
  wire::Welcome welcome{};
  reader.read_exact(&welcome, sizeof(welcome));
  if (welcome.magic != wire::kMagic)
    TIDEKV_THROW(kPeerUnavailable, "peer " + what + " sent a malformed handshake reply");
  if (welcome.status == uint32_t(wire::Status::kAuthFailed))
    TIDEKV_THROW(kAuth, "peer " + what + " refused our shared secret; check TransferConfig.secret on both sides");
  if (welcome.status == uint32_t(wire::Status::kRefused))
    TIDEKV_THROW(kRefused, "peer " + what + " refused the connection (no room: its connection limits, "
                                            "or it does not serve this transport)");
  if (welcome.status != uint32_t(wire::Status::kOk))
    TIDEKV_THROW(kPeerUnavailable, "peer " + what + " refused the connection (status " +
                                       std::to_string(welcome.status) + ")");
  if (!secret.empty() && !same_mac(server_mac(secret, hello.nonce, challenge.nonce), welcome.mac))
    TIDEKV_THROW(kAuth, "peer " + what + " accepted us but did not prove it holds the shared secret (wrong "
                                         "secret there, or not the engine it claims to be)");
  if (welcome.descriptor_bytes > wire::kMaxDescriptorBytes)
    TIDEKV_THROW(kPeerUnavailable, "peer " + what + " sent an oversized descriptor");
  std::string bytes(welcome.descriptor_bytes, '\0');
  reader.read_exact(bytes.data(), bytes.size());
  return Descriptor::decode(bytes, what);
}

size_t ServerHandshake::wanted() const {
  switch (step_) {
    case Step::kGreeting: return kGreetingBytes;
    case Step::kHello: return sizeof(wire::Hello) - kGreetingBytes;
    case Step::kAuth: return sizeof(wire::Auth);
    case Step::kProof: return sizeof(wire::RegionProof);
    case Step::kDone: return 0;
  }
  return 0;
}

void ServerHandshake::feed(const uint8_t* data, const std::string& descriptor, Admission admission,
                           std::string* reply) {
  if (step_ == Step::kGreeting) {
    std::memcpy(&hello_, data, kGreetingBytes);
    challenge_ = wire::Challenge{wire::kMagic, wire::kProtocolVersion, uint32_t(wire::Status::kOk),
                                 uint32_t(!secret_.empty()), {}};
    if (hello_.magic != wire::kMagic) TIDEKV_THROW(kPeerUnavailable, "bad handshake magic from " + what_);
    if (hello_.version != wire::kProtocolVersion) {
      challenge_.status = uint32_t(wire::Status::kVersionMismatch);
      append(reply, challenge_);
      TIDEKV_THROW(kProtocolVersion, "refused " + what_ + ": it speaks tidekv transfer protocol " +
                                         version_text(hello_.version) + ", this engine speaks " +
                                         version_text(wire::kProtocolVersion));
    }
    step_ = Step::kHello;
    return;
  }
  if (step_ == Step::kHello) {
    std::memcpy(reinterpret_cast<uint8_t*>(&hello_) + kGreetingBytes, data, sizeof(hello_) - kGreetingBytes);
    if (hello_.conn_type != uint32_t(wire::ConnType::kDescriptor) &&
        hello_.conn_type != uint32_t(wire::ConnType::kData) && hello_.conn_type != uint32_t(wire::ConnType::kRegionProof))
      TIDEKV_THROW(kPeerUnavailable, "unknown connection type " + std::to_string(hello_.conn_type) + " from " + what_);
    random_bytes(challenge_.nonce, sizeof(challenge_.nonce));
    append(reply, challenge_);
    step_ = Step::kAuth;
    return;
  }
  wire::Auth auth{};
  std::memcpy(&auth, data, sizeof(auth));
  step_ = Step::kDone;
  if (!secret_.empty() && !same_mac(compute_mac(secret_, challenge_.nonce, hello_.nonce), auth.mac)) {
    append(reply, wire::Welcome{wire::kMagic, uint32_t(wire::Status::kAuthFailed), 0, 0, {}});
    TIDEKV_THROW(kAuth, "refused " + what_ + ": missing or wrong shared secret");
  }
  if (admission != Admission::kAdmit) {
    append(reply, wire::Welcome{wire::kMagic, uint32_t(wire::Status::kRefused), 0, 0, {}});
    if (admission == Admission::kLimit)
      TIDEKV_THROW(kPeerUnavailable, "refused " + what_ + ": connection limit reached");
    TIDEKV_THROW(kPeerUnavailable, "refused " + what_ + ": it asked for transport wire id " +
                                       std::to_string(hello_.transport) + ", which this engine does not serve");
  }
  wire::Welcome welcome{wire::kMagic, uint32_t(wire::Status::kOk), uint32_t(descriptor.size()), 0, {}};
  if (!secret_.empty()) std::memcpy(welcome.mac, server_mac(secret_, hello_.nonce, challenge_.nonce).mac, 32);
  append(reply, welcome);
  reply->append(descriptor);
  if (hello_.conn_type == uint32_t(wire::ConnType::kRegionProof)) step_ = Step::kProof;
}

void ServerHandshake::feed_proof(const uint8_t* data, const RegionVerifier& verify, std::string* reply) {
  wire::RegionProof proof{};
  std::memcpy(&proof, data, sizeof(proof));
  step_ = Step::kDone;
  if (proof.magic != wire::kMagic) TIDEKV_THROW(kPeerUnavailable, "bad region proof magic from " + what_);
  append(reply, wire::RegionVerdict{wire::kMagic, uint32_t(verify(proof))});
}

}  // namespace tidekv
