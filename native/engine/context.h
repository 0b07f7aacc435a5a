// What every part of one engine shares: its settings, counters and log queue.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/counters.h"
#include "engine/log_sink.h"

namespace tidekv {

enum class TransportChoice : int { kAuto = 0, kTcp = 1, kShm = 2 };

// Mirrors tidekv.config.TransferConfig (validated there).
struct EngineOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  TransportChoice transport = TransportChoice::kAuto;
  int connections_per_peer = 4;
  int worker_threads = 4;
  uint64_t slice_bytes = 1 << 20;
  int io_timeout_ms = 30000;
  int socket_buffer_bytes = 4 << 20;
  std::string secret;
  uint32_t max_regions = 4096;
  int unregister_timeout_ms = 5000;
  uint64_t inline_bytes = 64 << 10;
  uint64_t defer_bytes = 16 << 20;
  int defer_grace_us = 200;
  int reply_spin_us = 100;
  int shm_parallelism = 2;
  bool enable_cross_memory_attach = true;
};

class Task;

struct EngineContext {
  EngineOptions options;
  Counters counters;
  LogSink log;
  // Queues work for the engine's workers (set by the engine; used for continuations).
  std::function<void(std::shared_ptr<Task>)> enqueue_task;
};

}  // namespace tidekv
