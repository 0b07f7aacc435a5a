// The cuda transport: requests with GPU memory on either side, between engines on one host
// (one process or several). See cuda_link.h for the copies, cuda_export.h for what peers open.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace tidekv {

std::unique_ptr<Transport> make_cuda_transport(TransportEnv env);

}  // namespace tidekv
