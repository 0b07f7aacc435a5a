#include "cuda/driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <unordered_map>

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
  const char* env = std::getenv("TIDEKV_LIBCUDA");
  std::string path = env && *env ? env : "libcuda.so.1";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* err = dlerror();
    reason_ = path + " does not load (" + (err ? err : "unknown error") + "): no NVIDIA driver on this host";
    return;
  }
  std::string missing;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  sym(api_.cuInit, "cuInit");
  sym(api_.cuGetErrorString, "cuGetErrorString");
  sym(api_.cuDriverGetVersion, "cuDriverGetVersion");
  sym(api_.cuDeviceGetCount, "cuDeviceGetCount");
  sym(api_.cuDeviceGet, "cuDeviceGet");
  sym(api_.cuDeviceGetName, "cuDeviceGetName");
  sym(api_.cuDeviceGetAttribute, "cuDeviceGetAttribute");
  sym(api_.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  sym(api_.cuCtxPushCurrent, "cuCtxPushCurrent_v2");
  sym(api_.cuCtxPopCurrent, "cuCtxPopCurrent_v2");
  sym(api_.cuPointerGetAttribute, "cuPointerGetAttribute");
  sym(api_.cuMemGetAddressRange, "cuMemGetAddressRange_v2");
  sym(api_.cuIpcGetMemHandle, "cuIpcGetMemHandle");
  sym(api_.cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2");
  sym(api_.cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
  sym(api_.cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle");
  sym(api_.cuMemGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle");
  sym(api_.cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
  sym(api_.cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
  sym(api_.cuMemAddressReserve, "cuMemAddressReserve");
  sym(api_.cuMemAddressFree, "cuMemAddressFree");
  sym(api_.cuMemMap, "cuMemMap");
  sym(api_.cuMemUnmap, "cuMemUnmap");
  sym(api_.cuMemSetAccess, "cuMemSetAccess");
  sym(api_.cuMemRelease, "cuMemRelease");
  sym(api_.cuStreamCreate, "cuStreamCreate");
  sym(api_.cuStreamSynchronize, "cuStreamSynchronize");
  sym(api_.cuMemcpyAsync, "cuMemcpyAsync");
  sym(api_.cuMemHostAlloc, "cuMemHostAlloc");
  sym(api_.cuMemFreeHost, "cuMemFreeHost");
  sym(api_.cuEventCreate, "cuEventCreate");
  sym(api_.cuEventRecord, "cuEventRecord");
  sym(api_.cuEventSynchronize, "cuEventSynchronize");
  sym(api_.cuEventDestroy, "cuEventDestroy_v2");
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
