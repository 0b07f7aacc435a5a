#include "transport/registry.h"

#include <unistd.h>

#include "cuda/cuda_transport.h"
#include "fabric/fabric_transport.h"
#include "shm/shm_transport.h"
#include "tcp/tcp_transport.h"

namespace tidekv {

void Transport::adopt(Connection conn) { ::close(conn.fd); }

const std::vector<TransportEntry>& transport_registry() {
  static const std::vector<TransportEntry> entries = {
      {"tcp", make_tcp_transport},
      {"shm", make_shm_transport},
      {"cuda", make_cuda_transport},
      {"fabric", make_fabric_transport},
  };
  return entries;
}

}  // namespace tidekv
