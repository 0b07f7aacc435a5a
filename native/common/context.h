// What every part of one engine shares: its settings, identity, counters and log queue.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/counters.h"
#include "common/log_sink.h"

namespace tidekv {

// Each transport's own settings: a section of EngineOptions (options.tcp, .shm, .fabric), so a
// transport's options live together and a new transport adds a section, not engine-wide fields.
struct TcpOptions {
  int connections_per_peer = 4;
  int reply_spin_us = 100;  // poll for a reply this long before sleeping (busy_poll_us)
  int server_threads = 4;   // threads that serve peers' tcp data connections
};

struct ShmOptions {
  int parallelism = 2;                   // threads that share one large same-host batch
  uint64_t stream_copy_bytes = 8 << 20;  // same-host batches this large copy with streaming stores (0: never)
  bool enable_cross_memory_attach = true;
};

struct FabricOptions {
  std::string provider;  // libfabric provider (empty: verbs, then efa)
  // NICs (libfabric domain names, comma-separated) striped over, in rail order; "all": every one
  // of the provider; "": every one with an active port for verbs/efa, else the host address's.
  std::string nics;
};

// Mirrors tidekv.config.TransferConfig (validated there).
struct EngineOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string transport = "auto";  // a transport's name forces it for every request
  int worker_threads = 4;
  uint64_t slice_bytes = 256 << 10;
  int io_timeout_ms = 30000;
  int socket_buffer_bytes = 4 << 20;
  std::string secret;
  uint32_t max_regions = 4096;
  int unregister_timeout_ms = 5000;
  uint64_t inline_bytes = 1 << 20;
  uint64_t defer_bytes = 16 << 20;
  int defer_grace_us = 200;
  int handshake_timeout_ms = 5000;       // a connection that has not finished its handshake by then is dropped
  int idle_timeout_ms = 300000;          // a data connection idle this long is closed (both sides)
  int max_connections = 1024;            // open connections the listener and servers hold at once
  int max_connections_per_peer = 64;     // of which from one peer engine
  TcpOptions tcp;
  ShmOptions shm;
  FabricOptions fabric;
};

class Task;

struct EngineContext {
  EngineOptions options;
  uint8_t instance[16];  // random per engine; peers see a new one when it restarts
  Counters counters;
  LogSink log;
  // Queues work for the engine's workers (set by the engine; used for continuations).
  std::function<void(std::shared_ptr<Task>)> enqueue_task;
};

}  // namespace tidekv
