#include "cuda/driver.h"

#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "common/system_library.h"

namespace tidekv::cuda {
namespace {

thread_local std::unordered_map<int, CUstream> thread_streams;

}  // namespace

Driver& Driver::get() {
  static Driver* driver = new Driver();  // never destroyed: worker threads may use it at exit
  return *driver;
}

Driver::Driver() { load(); }

void Driver::load() {
  SystemLibrary lib("TIDEKV_LIBCUDA", "libcuda.so.1");
  const std::string& path = lib.path();
  if (!lib.is_open()) {
    reason_ = lib.error() + ": no NVIDIA driver on this host";
    return;
  }
  lib.resolve(api_.cuInit, "cuInit");
  lib.resolve(api_.cuGetErrorString, "cuGetErrorString");
  lib.resolve(api_.cuDriverGetVersion, "cuDriverGetVersion");
  lib.resolve(api_.cuDeviceGetCount, "cuDeviceGetCount");
  lib.resolve(api_.cuDeviceGet, "cuDeviceGet");
  lib.resolve(api_.cuDeviceGetName, "cuDeviceGetName");
  lib.resolve(api_.cuDeviceGetAttribute, "cuDeviceGetAttribute");
  lib.resolve(api_.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  lib.resolve(api_.cuCtxPushCurrent, "cuCtxPushCurrent_v2");
  lib.resolve(api_.cuCtxPopCurrent, "cuCtxPopCurrent_v2");
  lib.resolve(api_.cuPointerGetAttribute, "cuPointerGetAttribute");
  lib.resolve(api_.cuMemGetAddressRange, "cuMemGetAddressRange_v2");
  lib.resolve(api_.cuIpcGetMemHandle, "cuIpcGetMemHandle");
  lib.resolve(api_.cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2");
  lib.resolve(api_.cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
  lib.resolve(api_.cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle");
  lib.resolve(api_.cuMemGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle");
  lib.resolve(api_.cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
  lib.resolve(api_.cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
  lib.resolve(api_.cuMemAddressReserve, "cuMemAddressReserve");
  lib.resolve(api_.cuMemAddressFree, "cuMemAddressFree");
  lib.resolve(api_.cuMemMap, "cuMemMap");
  lib.resolve(api_.cuMemUnmap, "cuMemUnmap");
  lib.resolve(api_.cuMemSetAccess, "cuMemSetAccess");
  lib.resolve(api_.cuMemRelease, "cuMemRelease");
  lib.resolve(api_.cuStreamCreate, "cuStreamCreate");
  lib.resolve(api_.cuStreamSynchronize, "cuStreamSynchronize");
  lib.resolve(api_.cuMemcpyAsync, "cuMemcpyAsync");
  lib.resolve(api_.cuMemHostAlloc, "cuMemHostAlloc");
  lib.resolve(api_.cuMemFreeHost, "cuMemFreeHost");
  lib.resolve(api_.cuEventCreate, "cuEventCreate");
  lib.resolve(api_.cuEventRecord, "cuEventRecord");
  lib.resolve(api_.cuEventSynchronize, "cuEventSynchronize");
  lib.resolve(api_.cuEventDestroy, "cuEventDestroy_v2");
  const std::string& missing = lib.missing();
  if (!missing.empty()) {
    reason_ = path + " loads but lacks " + missing + " (a driver older than CUDA 11.0?)";
    return;
  }
  CUresult rc = api_.cuInit(0);
  if (rc != CUDA_SUCCESS) {
    reason_ = path + " loads but cuInit failed: " + error_text(rc) + " (no usable GPU, or CUDA_VISIBLE_DEVICES hides them)";
    return;
  }
  int count = 0, version = 0;
  api_.cuDriverGetVersion(&version);
  rc = api_.cuDeviceGetCount(&count);
  if (rc != CUDA_SUCCESS || count <= 0) {
    reason_ = path + " initialises but sees no GPU" + (rc != CUDA_SUCCESS ? " (" + error_text(rc) + ")" : "");
    return;
  }
  std::string names;
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    char name[256] = {0};
    DeviceInfo info{i, "?", ""};
    if (api_.cuDeviceGet(&dev, i) == CUDA_SUCCESS && api_.cuDeviceGetName(name, sizeof(name), dev) == CUDA_SUCCESS)
      info.name = name;
    int bus = -1;
    if (api_.cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, dev) == CUDA_SUCCESS) info.pci_bus = std::to_string(bus);
    devices_.push_back(info);
    names += std::string(names.empty() ? "" : ", ") + "cuda:" + std::to_string(i) + " " + info.name;
  }
  contexts_.assign(size_t(count), nullptr);
  available_ = true;
  reason_ = "CUDA driver " + std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10) + " (" + path +
            "), " + std::to_string(count) + " GPU(s): " + names;
}

std::string Driver::error_text(CUresult rc) const {
  const char* text = nullptr;
  if (api_.cuGetErrorString) api_.cuGetErrorString(rc, &text);
  return (text ? std::string(text) : "unknown error") + " (CUresult " + std::to_string(rc) + ")";
}

void Driver::check(CUresult rc, const std::string& what, ErrorKind kind) const {
  if (rc != CUDA_SUCCESS) throw Error(kind, what + " failed: " + error_text(rc), __FILE__, __LINE__);
}

CUcontext Driver::context(int device) {
  TIDEKV_CHECK(available_, kConfig, "the CUDA driver is not available: " + reason_);
  TIDEKV_CHECK(device >= 0 && size_t(device) < contexts_.size(), kConfig,
               "cuda:" + std::to_string(device) + " does not exist here (" + std::to_string(contexts_.size()) + " GPU(s))");
  std::lock_guard<std::mutex> lock(mu_);
  if (!contexts_[device]) {
    CUdevice dev = 0;
    check(api_.cuDeviceGet(&dev, device), "cuDeviceGet(" + std::to_string(device) + ")", ErrorKind::kConfig);
    check(api_.cuDevicePrimaryCtxRetain(&contexts_[device], dev), "cuDevicePrimaryCtxRetain(cuda:" + std::to_string(device) + ")",
          ErrorKind::kConfig);
  }
  return contexts_[device];
}

Driver::Scope::Scope(Driver& driver, int device) : driver_(driver) {
  driver.check(driver.api_.cuCtxPushCurrent(driver.context(device)), "cuCtxPushCurrent(cuda:" + std::to_string(device) + ")");
}

Driver::Scope::~Scope() {
  CUcontext previous = nullptr;
  driver_.api_.cuCtxPopCurrent(&previous);
}

CUstream Driver::stream(int device) {
  auto it = thread_streams.find(device);
  if (it != thread_streams.end()) return it->second;
  CUstream s = nullptr;
  check(api_.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate(cuda:" + std::to_string(device) + ")");
  thread_streams[device] = s;
  return s;
}

int Driver::device_of(uint64_t addr) {
  if (!available_) return -1;
  unsigned type = 0;
  if (api_.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr) != CUDA_SUCCESS) return -1;
  if (type != CU_MEMORYTYPE_DEVICE) return -1;
  int ordinal = -1;
  if (api_.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr) != CUDA_SUCCESS) return -1;
  return ordinal;
}

CUdeviceptr Driver::open_ipc(const CUipcMemHandle& handle, const std::string& what) {
  std::string key(handle.reserved, sizeof(handle.reserved));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ipc_.find(key);
  if (it != ipc_.end()) {
    ++it->second.second;
    return it->second.first;
  }
  CUdeviceptr mapped = 0;
  check(api_.cuIpcOpenMemHandle(&mapped, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle (" + what + ")",
        ErrorKind::kPeerUnavailable);
  ipc_[key] = {mapped, 1};
  return mapped;
}

void Driver::close_ipc(CUdeviceptr mapped) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = ipc_.begin(); it != ipc_.end(); ++it) {
    if (it->second.first != mapped) continue;
    if (--it->second.second == 0) {
      api_.cuIpcCloseMemHandle(mapped);
      ipc_.erase(it);
    }
    return;
  }
}

}  // namespace tidekv::cuda
