#include "cuda/staging.h"

#include "common/errors.h"
#include "cuda/driver.h"

namespace tidekv::cuda {

Stager::~Stager() {
  Driver& d = Driver::get();
  if (!d.available()) return;
  try {
    drain();
  } catch (const Error&) {
  }
  try {
    Driver::Scope scope(d, memory_device_);
    for (auto& [device, ev] : spare_) d.api().cuEventDestroy(ev);
    if (memory_) d.api().cuMemFreeHost(memory_);
  } catch (const Error&) {
    // No context any more (process exit): the driver frees everything itself.
  }
}

uint8_t* Stager::take(uint64_t n, int device) {
  Driver& d = Driver::get();
  if (!memory_) {
    Driver::Scope scope(d, device);
    void* p = nullptr;
    d.check(d.api().cuMemHostAlloc(&p, capacity_, CU_MEMHOSTALLOC_PORTABLE),
            "cuMemHostAlloc of " + std::to_string(capacity_) + " bytes of staging memory");
    memory_ = static_cast<uint8_t*>(p);
    memory_device_ = device;
  }
  if (n > capacity_ - used_) return nullptr;
  uint8_t* out = memory_ + used_;
  used_ += (n + 63) & ~uint64_t(63);  // keep copies cache-line aligned
  if (used_ > capacity_) used_ = capacity_;
  return out;
}

CUstream Stager::stream_for(int device) {
  CUstream s = Driver::get().stream(device);
  for (auto& [dev, st] : streams_)
    if (st == s) return s;
  streams_.emplace_back(device, s);
  return s;
}

size_t Stager::to_host(uint8_t* bounce, uint64_t src, uint64_t n, int device) {
  Driver& d = Driver::get();
  Driver::Scope scope(d, device);
  CUstream s = stream_for(device);
  d.check(d.api().cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(bounce), src, n, s), "cuMemcpyAsync (GPU to staging)");
  CUevent ev = nullptr;
  for (size_t i = 0; i < spare_.size(); ++i)
    if (spare_[i].first == device) {
      ev = spare_[i].second;
      spare_.erase(spare_.begin() + long(i));
      break;
    }
  if (!ev) d.check(d.api().cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  events_.emplace_back(device, ev);
  d.check(d.api().cuEventRecord(ev, s), "cuEventRecord");
  return events_.size() - 1;
}

void Stager::wait(size_t mark) {
  Driver& d = Driver::get();
  auto [device, ev] = events_.at(mark);
  Driver::Scope scope(d, device);
  d.check(d.api().cuEventSynchronize(ev), "cuEventSynchronize (GPU to staging)");
}

void Stager::to_device(uint64_t dst, const uint8_t* bounce, uint64_t n, int device) {
  Driver& d = Driver::get();
  Driver::Scope scope(d, device);
  d.check(d.api().cuMemcpyAsync(dst, reinterpret_cast<CUdeviceptr>(bounce), n, stream_for(device)),
          "cuMemcpyAsync (staging to GPU)");
}

void Stager::drain() {
  Driver& d = Driver::get();
  std::string error;
  for (auto& [device, s] : streams_) {
    Driver::Scope scope(d, device);
    CUresult rc = d.api().cuStreamSynchronize(s);
    if (rc != CUDA_SUCCESS && error.empty()) error = "cuStreamSynchronize (staging) failed: " + d.error_text(rc);
  }
  streams_.clear();
  spare_.insert(spare_.end(), events_.begin(), events_.end());
  events_.clear();
  used_ = 0;
  if (!error.empty()) TIDEKV_THROW(kTransfer, error);
}

}  // namespace tidekv::cuda
