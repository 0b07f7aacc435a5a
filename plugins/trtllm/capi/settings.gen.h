// Generated from tidekv.config.TransferConfig by `tidekv doctor --settings-reference capi`; a test
// checks it is current. Do not edit: change the declaration in core/config.py.
#pragma once

#include "common/context.h"

namespace tidekv::capi {

// Reads every declared setting's TIDEKV_* variable into `o` through `r` (options.cpp's reader,
// which refuses a value outside the declared range, naming the variable).
template <typename Reader>
void read_declared_settings(const Reader& r, EngineOptions& o) {
  r.integer("TIDEKV_CONNECTIONS_PER_PEER", 1LL, 64LL, o.tcp.connections_per_peer);
  r.integer("TIDEKV_WORKER_THREADS", 1LL, 256LL, o.worker_threads);
  r.integer("TIDEKV_SLICE_SIZE_BYTES", 4096LL, 268435456LL, o.slice_bytes);
  r.seconds("TIDEKV_IO_TIMEOUT_S", 0.1, 3600, o.io_timeout_ms);
  r.integer("TIDEKV_SOCKET_BUFFER_BYTES", 0LL, 1073741824LL, o.socket_buffer_bytes);
  r.integer("TIDEKV_MAX_REGIONS", 1LL, 1048576LL, o.max_regions);
  r.seconds("TIDEKV_UNREGISTER_TIMEOUT_S", 0, 600, o.unregister_timeout_ms);
  r.integer("TIDEKV_INLINE_BYTES", 0LL, 1073741824LL, o.inline_bytes);
  r.integer("TIDEKV_SHM_PARALLELISM", 1LL, 64LL, o.shm.parallelism);
  r.integer("TIDEKV_STREAM_COPY_BYTES", 0LL, 1125899906842624LL, o.shm.stream_copy_bytes);
  r.flag("TIDEKV_ENABLE_CROSS_MEMORY_ATTACH", o.shm.enable_cross_memory_attach);
  r.integer("TIDEKV_BUSY_POLL_US", 0LL, 100000LL, o.tcp.reply_spin_us);
  r.integer("TIDEKV_SERVER_THREADS", 1LL, 256LL, o.tcp.server_threads);
  r.seconds("TIDEKV_HANDSHAKE_TIMEOUT_S", 0.05, 600, o.handshake_timeout_ms);
  r.seconds("TIDEKV_IDLE_TIMEOUT_S", 0.5, 86400, o.idle_timeout_ms);
  r.integer("TIDEKV_MAX_CONNECTIONS", 1LL, 1048576LL, o.max_connections);
  r.integer("TIDEKV_MAX_CONNECTIONS_PER_PEER", 1LL, 4096LL, o.max_connections_per_peer);
  r.text("TIDEKV_FABRIC_PROVIDER", o.fabric.provider);
  r.text("TIDEKV_FABRIC_NICS", o.fabric.nics);
}

}  // namespace tidekv::capi
