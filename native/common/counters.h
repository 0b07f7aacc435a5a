// Plain counters of the data path; read as one snapshot by TransferEngine.stats().
#pragma once

#include <atomic>
#include <cstdint>

namespace tidekv {

struct Counters {
  std::atomic<uint64_t> batches{0};
  std::atomic<uint64_t> bytes_read{0};        // pulled from peers (initiator side)
  std::atomic<uint64_t> bytes_written{0};     // pushed to peers (initiator side)
  std::atomic<uint64_t> shm_bytes{0};         // of which moved by the same-host path
  std::atomic<uint64_t> shm_streamed_bytes{0};  // of which copied with streaming stores (common/copy.h)
  std::atomic<uint64_t> cuda_bytes{0};        // of which moved by the cuda transport
  std::atomic<uint64_t> fabric_bytes{0};      // of which moved by the fabric transport (RMA)
  std::atomic<uint64_t> served_bytes{0};      // moved for peers by this engine's tcp server
  std::atomic<uint64_t> frames_refused{0};    // peer frames outside registered memory
  std::atomic<uint64_t> connections_accepted{0};
  std::atomic<uint64_t> connections_refused{0};  // bad handshake, version, secret, frame
  std::atomic<uint64_t> connections_opened{0};   // outgoing data connections
  std::atomic<uint64_t> connections_limited{0};  // refused for a limit: fds, connections, per peer
  std::atomic<uint64_t> connections_idle_closed{0};  // closed after idle_timeout
  std::atomic<uint64_t> connections_open{0};     // accepted connections open now (gauge)
};

}  // namespace tidekv
