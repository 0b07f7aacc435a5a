#pragma once

#include <memory>

#include "transport/transport.h"

namespace tidekv {

// One-sided RDMA through libfabric (verbs on InfiniBand/RoCE, efa; software providers when
// named): fabric/fabric_domain.h, fabric/fabric_link.h.
std::unique_ptr<Transport> make_fabric_transport(TransportEnv env);

}  // namespace tidekv
