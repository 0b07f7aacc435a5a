// The CUDA driver, loaded once per process at run time (dlopen of libcuda.so.1, or the library
// $TIDEKV_LIBCUDA names): one wheel builds and imports on hosts without CUDA, where the cuda
// transport reports the reason instead. Every call that can fail throws a typed Error naming
// the call and the driver's own message.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "cuda/cuda_api.h"

namespace tidekv::cuda {

struct DeviceInfo {
  int ordinal;
  std::string name;
  std::string pci_bus;  // "0000:3b:00.0"-like, as far as the driver says
};

class Driver {
 public:
  // The process's driver; loads and initialises it on first use (never throws).
  static Driver& get();
  bool available() const { return available_; }
  // Why not available, or (when available) the driver version and the GPUs it sees.
  const std::string& reason() const { return reason_; }
  const std::vector<DeviceInfo>& devices() const { return devices_; }
  const Api& api() const { return api_; }

  // Throws `kind` naming `what` and the driver's message when rc is not CUDA_SUCCESS.
  void check(CUresult rc, const std::string& what, ErrorKind kind = ErrorKind::kTransfer) const;
  std::string error_text(CUresult rc) const;
  // Makes `device`'s primary context current on the calling thread for the scope's life and
  // restores the caller's own afterwards (a submitting thread may be one of torch's).
  class Scope {
   public:
    Scope(Driver& driver, int device);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Driver& driver_;
  };
  // A stream of the calling thread's own on `device` (created on first use, kept for the
  // thread); call inside a Scope of that device.
  CUstream stream(int device);
  // The device ordinal whose memory `addr` is in; -1 when it is not GPU memory.
  int device_of(uint64_t addr);

  // IPC handles are process-wide: the driver maps one allocation of another process at most
  // once per process, so every link of every engine here shares the mapping (counted).
  CUdeviceptr open_ipc(const CUipcMemHandle& handle, const std::string& what);
  void close_ipc(CUdeviceptr mapped);

 private:
  Driver();
  void load();
  CUcontext context(int device);
  bool available_ = false;
  std::string reason_;
  std::vector<DeviceInfo> devices_;
  Api api_{};
  std::mutex mu_;
  std::vector<CUcontext> contexts_;                           // by ordinal; null until retained
  std::map<std::string, std::pair<CUdeviceptr, int>> ipc_;    // handle bytes -> (mapping, users)
};

}  // namespace tidekv::cuda
