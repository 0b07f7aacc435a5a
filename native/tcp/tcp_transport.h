// tcp: always available, any two hosts. The Transport ties the halves together: links to peers
// (tcp_link.h) and the server for peers' data connections (tcp_server.h).
#pragma once

#include <memory>

#include "transport/transport.h"

namespace tidekv {

std::unique_ptr<Transport> make_tcp_transport(TransportEnv env);

}  // namespace tidekv
