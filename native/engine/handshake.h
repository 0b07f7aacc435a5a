// The handshake that opens every connection: protocol version check, optional shared-secret
// challenge (HMAC-SHA-256 over both nonces), then the server's descriptor.
#pragma once

#include <string>

#include "common/socket.h"
#include "common/wire.h"

namespace tidekv {

// Client side. Throws kProtocolVersion / kAuth / kPeerUnavailable naming `what`.
wire::Descriptor client_handshake(int fd, SocketReader& reader, wire::ConnType type, const std::string& secret,
                                  const std::string& what);

// Server side. Returns the connection type, or throws with the reason to log and drop it.
wire::ConnType server_handshake(int fd, SocketReader& reader, const std::string& secret,
                                const wire::Descriptor& self, const std::string& what);


}  // namespace tidekv
