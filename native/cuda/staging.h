// Pinned host memory that GPU bytes pass through on a transport that cannot reach GPU memory
// itself (tcp across hosts; RDMA without GPUDirect, later). A round of copies takes room with
// take(), starts device copies that run while the caller does network I/O, and drain() waits for
// all of them before the room is reused. One Stager per connection side; one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "cuda/cuda_api.h"

namespace tidekv::cuda {

class Stager {
 public:
  explicit Stager(uint64_t capacity) : capacity_(capacity) {}
  ~Stager();
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;
  uint64_t capacity() const { return capacity_; }
  // n bytes of bounce memory for this round; nullptr when the round is full (drain() first).
  // The pinned memory is allocated on first use, in `device`'s context (portable to all).
  uint8_t* take(uint64_t n, int device);
  // Starts GPU -> bounce; returns a mark that wait() blocks on (the bytes are in the bounce then).
  size_t to_host(uint8_t* bounce, uint64_t src, uint64_t n, int device);
  void wait(size_t mark);
  // Starts bounce -> GPU; it has landed once drain() returns.
  void to_device(uint64_t dst, const uint8_t* bounce, uint64_t n, int device);
  // Waits for every copy of the round; the bounce memory is free again. Throws kTransfer.
  void drain();
  bool idle() const { return used_ == 0 && streams_.empty(); }

 private:
  CUstream stream_for(int device);
  uint64_t capacity_;
  uint8_t* memory_ = nullptr;
  int memory_device_ = 0;
  uint64_t used_ = 0;
  std::vector<std::pair<int, CUstream>> streams_;  // used this round
  std::vector<std::pair<int, CUevent>> events_;    // marks of this round (device, event)
  std::vector<std::pair<int, CUevent>> spare_;     // events to reuse
};

}  // namespace tidekv::cuda
