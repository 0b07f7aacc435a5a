// The handshake that opens every connection: protocol version check, optional shared-secret
// challenge (HMAC-SHA-256 over both nonces), then the server's descriptor. The client half
// blocks (it runs on the connecting thread); the server half is a small state machine that the
// listener drives from non-blocking sockets, so a slow or silent client holds no thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/descriptor.h"
#include "common/socket.h"
#include "common/wire.h"

namespace tidekv {

void random_bytes(uint8_t* out, size_t n);

// Client side. `transport`: wire id of the transport that serves a kData connection (0 for
// kDescriptor). Throws kProtocolVersion / kAuth / kPeerUnavailable naming `what`.
Descriptor client_handshake(int fd, SocketReader& reader, wire::ConnType type, uint16_t transport,
                            const uint8_t instance[16], const std::string& secret, const std::string& what);

// Server side, one connection. feed() takes the bytes that arrived; it returns the bytes to
// send back (possibly none) and moves to the next step. Throws with the reason to log when the
// client must be dropped (after `reply` holds what should still be sent, e.g. a version refusal).
// Why a server turns a data connection away after its Hello (sent as Status::kRefused either
// way; the reason is for the server's log and counters).
enum class Admission { kAdmit, kLimit, kNoTransport };

// What an engine answers a kRegionProof connection (common/region_proof.h): kOk, kNotRegistered
// or kAuthFailed.
using RegionVerifier = std::function<wire::Status(const wire::RegionProof&)>;

class ServerHandshake {
 public:
  // kGreeting: magic and version only, so that a client of another version (whose Hello may
  // have another size) is answered with a version refusal instead of waiting for bytes.
  // kProof: a kRegionProof connection, authenticated, sends its RegionProof (feed_proof).
  enum class Step { kGreeting, kHello, kAuth, kProof, kDone };
  ServerHandshake(const std::string& secret, const std::string& what) : secret_(secret), what_(what) {}
  Step step() const { return step_; }
  // Bytes still expected before the next step (read no more than this: nothing may be read
  // past the handshake, those bytes belong to the transport).
  size_t wanted() const;
  // Consumes exactly wanted() bytes; appends the reply to *reply. `admission`: whether the
  // server takes this connection (asked after the Hello: it has room for it, and serves the
  // transport it names); a refusal is sent as kRefused and thrown with its reason.
  void feed(const uint8_t* data, const std::string& descriptor, Admission admission, std::string* reply);
  // Step kProof: consumes the RegionProof, appends `verify`'s verdict; the connection is done.
  void feed_proof(const uint8_t* data, const RegionVerifier& verify, std::string* reply);
  const wire::Hello& hello() const { return hello_; }

 private:
  const std::string& secret_;
  std::string what_;
  Step step_ = Step::kGreeting;
  wire::Hello hello_{};
  wire::Challenge challenge_{};
};

}  // namespace tidekv
