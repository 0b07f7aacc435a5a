// The one interface every transport implements (tcp, shm; rdma later). One instance serves one
// peer. plan() turns requests into slices and tasks on the batch; the engine runs the tasks on
// its workers or on the waiting thread. Tasks report each slice to the batch exactly once.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/batch.h"

namespace tidekv {

// A piece of one request, as a transport moves it: [local, local + length) <-> [remote, ...).
struct Slice {
  uint32_t request;  // index into the batch's requests
  wire::Op op;
  uint64_t local;
  uint64_t remote;
  uint64_t length;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // Called while planning (one thread, before any task of the batch runs). `requests` index
  // batch->requests(); all of them go to this transport's peer.
  virtual void plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) = 0;
  // Fails queued and future work; idempotent. Tasks already running finish or fail on their own.
  virtual void close() = 0;
};

}  // namespace tidekv
