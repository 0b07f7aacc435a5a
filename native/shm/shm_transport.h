// shm: same-host peers, host memory. Memory the engine allocated (a memfd) is mapped by peers
// and copied with memcpy; other registered memory is copied by cross-memory attach where the
// kernel allows it (links: shm_link.h). The transport publishes where its region table is.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace tidekv {

std::unique_ptr<Transport> make_shm_transport(TransportEnv env);

}  // namespace tidekv
