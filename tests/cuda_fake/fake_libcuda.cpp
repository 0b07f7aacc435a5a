// A stand-in for libcuda.so.1 that lets the cuda transport's real code run on a host without a
// GPU (tests load it through $TIDEKV_LIBCUDA). "Device memory" is a memfd mapped twice: at the
// address handed out, PROT_NONE - so any host code that touches a device pointer directly
// crashes the test, as it would fault on a real GPU - and once more, readable, for the copies
// this library makes itself. Like the real driver it
// - needs a current context for allocations, IPC opens, streams and copies;
// - runs cuMemcpyAsync only when the stream (or an event recorded after it) is synchronised: a
//   caller that reports a copy done before synchronising sees stale bytes;
// - refuses to open an IPC handle in the process that exported it, or twice in one process;
// - exports VMM memory only when it was created with the POSIX-fd handle type.
// Devices: $TIDEKV_FAKE_CUDA_DEVICES (default 2), "Fake GPU N" on PCI bus N + 1.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

using CUresult = int;
using CUdeviceptr = unsigned long long;
constexpr CUresult OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, INVALID_DEVICE = 101, INVALID_CONTEXT = 201,
                   ALREADY_MAPPED = 208, INVALID_HANDLE = 400, NOT_PERMITTED = 800;

struct Mapping {
  uint64_t size;
  uint8_t* shadow;  // where this library reads and writes the bytes
  int memfd;        // owned by the mapping (legacy allocations and IPC imports)
  int device;
  int kind;         // 0 cuMemAlloc, 1 IPC import, 2 VMM map
  uint64_t handle;  // kind 2: the allocation handle mapped here
};

struct Allocation {  // VMM physical allocation
  int memfd;
  uint64_t size;
  int device;
  int handle_types;
  int refs;
};

struct Copy {
  uint8_t* dst;
  const uint8_t* src;
  size_t n;
};

struct Stream {
  int device;
  std::vector<Copy> pending;  // copies [done, done + pending.size()) in issue order
  uint64_t done = 0;
};

struct Event {
  Stream* stream = nullptr;
  uint64_t upto = 0;  // the copies issued before it was recorded
};

// Runs the stream's copies issued before `upto`. Caller holds mu.
void run_until(Stream* s, uint64_t upto) {
  size_t n = 0;
  while (n < s->pending.size() && s->done + n < upto) {
    const Copy& c = s->pending[n];
    std::memmove(c.dst, c.src, c.n);
    ++n;
  }
  s->pending.erase(s->pending.begin(), s->pending.begin() + long(n));
  s->done += n;
}

std::mutex mu;
std::map<uint64_t, Mapping> mappings;  // by device address
std::map<uint64_t, Allocation> allocations;
std::map<std::string, uint64_t> ipc_opened;  // handle bytes -> mapped address
std::map<uint64_t, size_t> host_allocs;       // cuMemHostAlloc'd
uint64_t next_handle = 1;
int contexts[64];
thread_local std::vector<int> ctx_stack;

int device_count() {
  const char* e = std::getenv("TIDEKV_FAKE_CUDA_DEVICES");
  return e ? std::atoi(e) : 2;
}

int current_device() { return ctx_stack.empty() ? -1 : ctx_stack.back(); }

// The mapping holding [addr, addr + n); nullptr when none does. Caller holds mu.
Mapping* find(uint64_t addr, uint64_t n, uint64_t* base) {
  auto it = mappings.upper_bound(addr);
  if (it == mappings.begin()) return nullptr;
  --it;
  if (addr >= it->first + it->second.size) return nullptr;
  if (n > it->first + it->second.size - addr) return nullptr;
  *base = it->first;
  return &it->second;
}

// A device address becomes its readable shadow; a host address is used as it is. Caller holds mu.
uint8_t* resolve(uint64_t addr, uint64_t n, bool* ok) {
  uint64_t base = 0;
  auto it = mappings.upper_bound(addr);
  if (it != mappings.begin()) {
    --it;
    if (addr < it->first + it->second.size) {
      Mapping* m = find(addr, n, &base);
      if (!m) {
        *ok = false;  // starts in device memory, runs past its allocation
        return nullptr;
      }
      return m->shadow + (addr - base);
    }
  }
  return reinterpret_cast<uint8_t*>(addr);
}

CUresult map_memfd(int memfd, uint64_t size, uint64_t fixed, uint8_t** device, uint8_t** shadow) {
  void* d = fixed ? mmap(reinterpret_cast<void*>(fixed), size, PROT_NONE, MAP_SHARED | MAP_FIXED, memfd, 0)
                  : mmap(nullptr, size, PROT_NONE, MAP_SHARED, memfd, 0);
  if (d == MAP_FAILED) return OUT_OF_MEMORY;
  void* s = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (s == MAP_FAILED) {
    munmap(d, size);
    return OUT_OF_MEMORY;
  }
  *device = static_cast<uint8_t*>(d);
  *shadow = static_cast<uint8_t*>(s);
  return OK;
}

struct IpcHandle {
  uint32_t magic;
  int32_t pid;
  int32_t memfd;
  int32_t device;
  uint64_t size;
  char pad[40];
};
static_assert(sizeof(IpcHandle) == 64);
constexpr uint32_t kIpcMagic = 0xfa4ec0da;

}  // namespace

extern "C" {

__attribute__((visibility("default"))) CUresult cuInit(unsigned) { return device_count() > 0 ? OK : 100; }
__attribute__((visibility("default"))) CUresult cuDriverGetVersion(int* v) {
  *v = 12080;
  return OK;
}
__attribute__((visibility("default"))) CUresult cuGetErrorString(CUresult rc, const char** s) {
  switch (rc) {
    case OK: *s = "no error"; break;
    case INVALID_VALUE: *s = "invalid argument"; break;
    case OUT_OF_MEMORY: *s = "out of memory"; break;
    case INVALID_DEVICE: *s = "invalid device ordinal"; break;
    case INVALID_CONTEXT: *s = "invalid device context"; break;
    case ALREADY_MAPPED: *s = "resource already mapped"; break;
    case INVALID_HANDLE: *s = "invalid resource handle"; break;
    case NOT_PERMITTED: *s = "operation not permitted"; break;
    default: *s = "unknown error"; return INVALID_VALUE;
  }
  return OK;
}
__attribute__((visibility("default"))) CUresult cuDeviceGetCount(int* n) {
  *n = device_count();
  return OK;
}
__attribute__((visibility("default"))) CUresult cuDeviceGet(int* dev, int ordinal) {
  if (ordinal < 0 || ordinal >= device_count()) return INVALID_DEVICE;
  *dev = ordinal;
  return OK;
}
__attribute__((visibility("default"))) CUresult cuDeviceGetName(char* name, int len, int dev) {
  snprintf(name, size_t(len), "Fake GPU %d", dev);
  return OK;
}
__attribute__((visibility("default"))) CUresult cuDeviceGetAttribute(int* v, int attr, int dev) {
  if (dev < 0 || dev >= device_count()) return INVALID_DEVICE;
  *v = attr == 33 ? dev + 1 : 1;  // PCI bus id; everything else "supported"
  return OK;
}
__attribute__((visibility("default"))) CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) {
  if (dev < 0 || dev >= device_count()) return INVALID_DEVICE;
  contexts[dev] = dev;
  *ctx = &contexts[dev];
  return OK;
}
__attribute__((visibility("default"))) CUresult cuCtxPushCurrent_v2(void* ctx) {
  if (!ctx) return INVALID_CONTEXT;
  ctx_stack.push_back(*static_cast<int*>(ctx));
  return OK;
}
__attribute__((visibility("default"))) CUresult cuCtxPopCurrent_v2(void** ctx) {
  if (ctx_stack.empty()) return INVALID_CONTEXT;
  if (ctx) *ctx = &contexts[ctx_stack.back()];
  ctx_stack.pop_back();
  return OK;
}
// For tests: makes a device's context current on this thread for good (as torch.cuda would).
__attribute__((visibility("default"))) CUresult cuCtxSetCurrent(void* ctx) {
  ctx_stack.clear();
  if (ctx) ctx_stack.push_back(*static_cast<int*>(ctx));
  return OK;
}

__attribute__((visibility("default"))) CUresult cuMemAlloc_v2(CUdeviceptr* out, size_t size) {
  int dev = current_device();
  if (dev < 0) return INVALID_CONTEXT;
  if (size == 0) return INVALID_VALUE;
  int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, off_t(size)) != 0) return OUT_OF_MEMORY;
  uint8_t *d, *s;
  if (map_memfd(fd, size, 0, &d, &s) != OK) return OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(mu);
  mappings[reinterpret_cast<uint64_t>(d)] = Mapping{size, s, fd, dev, 0, 0};
  *out = reinterpret_cast<uint64_t>(d);
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemFree_v2(CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = mappings.find(p);
  if (it == mappings.end() || it->second.kind != 0) return INVALID_VALUE;
  munmap(reinterpret_cast<void*>(p), it->second.size);
  munmap(it->second.shadow, it->second.size);
  ::close(it->second.memfd);
  mappings.erase(it);
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
  std::lock_guard<std::mutex> lock(mu);
  bool ok = true;
  uint8_t* d = resolve(dst, n, &ok);
  if (!ok || d == reinterpret_cast<uint8_t*>(dst)) return INVALID_VALUE;
  std::memcpy(d, src, n);
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
  std::lock_guard<std::mutex> lock(mu);
  bool ok = true;
  uint8_t* s = resolve(src, n, &ok);
  if (!ok || s == reinterpret_cast<uint8_t*>(src)) return INVALID_VALUE;
  std::memcpy(dst, s, n);
  return OK;
}

__attribute__((visibility("default"))) CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  if (current_device() < 0) return INVALID_CONTEXT;
  std::lock_guard<std::mutex> lock(mu);
  bool ok = true;
  uint8_t* d = resolve(dst, n, &ok);
  const uint8_t* s = resolve(src, n, &ok);
  if (!ok) return INVALID_VALUE;
  std::memmove(d, s, n);
  return OK;
}

__attribute__((visibility("default"))) CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr ptr) {
  std::lock_guard<std::mutex> lock(mu);
  uint64_t base = 0;
  Mapping* m = find(ptr, 1, &base);
  if (!m) return INVALID_VALUE;  // host memory the driver never saw
  switch (attr) {
    case 2: *static_cast<unsigned*>(data) = 2; return OK;  // CU_MEMORYTYPE_DEVICE
    case 9: *static_cast<int*>(data) = m->device; return OK;
    case 18:
      if (m->kind != 2) return INVALID_VALUE;
      *static_cast<size_t*>(data) = m->size;
      return OK;
    case 19:
      if (m->kind != 2) return INVALID_VALUE;
      *static_cast<uint64_t*>(data) = base;
      return OK;
    default: return INVALID_VALUE;
  }
}
__attribute__((visibility("default"))) CUresult cuMemGetAddressRange_v2(CUdeviceptr* pbase, size_t* psize, CUdeviceptr ptr) {
  std::lock_guard<std::mutex> lock(mu);
  uint64_t base = 0;
  Mapping* m = find(ptr, 1, &base);
  if (!m) return INVALID_VALUE;
  if (pbase) *pbase = base;
  if (psize) *psize = m->size;
  return OK;
}

__attribute__((visibility("default"))) CUresult cuIpcGetMemHandle(void* out, CUdeviceptr ptr) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = mappings.find(ptr);
  if (it == mappings.end() || it->second.kind != 0) return INVALID_VALUE;  // not an allocation's base
  IpcHandle h{kIpcMagic, int32_t(getpid()), it->second.memfd, it->second.device, it->second.size, {}};
  std::memcpy(out, &h, sizeof(h));
  return OK;
}
__attribute__((visibility("default"))) CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* out, IpcHandle h, unsigned) {
  if (current_device() < 0) return INVALID_CONTEXT;
  if (h.magic != kIpcMagic) return INVALID_VALUE;
  if (h.pid == getpid()) return INVALID_CONTEXT;  // the real driver refuses one's own handles too
  std::string key(reinterpret_cast<const char*>(&h), sizeof(h));
  std::lock_guard<std::mutex> lock(mu);
  if (ipc_opened.count(key)) return ALREADY_MAPPED;
  std::string path = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.memfd);
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return INVALID_HANDLE;
  uint8_t *d, *s;
  if (map_memfd(fd, h.size, 0, &d, &s) != OK) {
    ::close(fd);
    return OUT_OF_MEMORY;
  }
  mappings[reinterpret_cast<uint64_t>(d)] = Mapping{h.size, s, fd, h.device, 1, 0};
  ipc_opened[key] = reinterpret_cast<uint64_t>(d);
  *out = reinterpret_cast<uint64_t>(d);
  return OK;
}
__attribute__((visibility("default"))) CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = mappings.find(p);
  if (it == mappings.end() || it->second.kind != 1) return INVALID_VALUE;
  munmap(reinterpret_cast<void*>(p), it->second.size);
  munmap(it->second.shadow, it->second.size);
  ::close(it->second.memfd);
  mappings.erase(it);
  for (auto k = ipc_opened.begin(); k != ipc_opened.end(); ++k)
    if (k->second == p) {
      ipc_opened.erase(k);
      break;
    }
  return OK;
}

// For tests: how many IPC handles of other processes this process has open now.
__attribute__((visibility("default"))) int fake_ipc_open_count() {
  std::lock_guard<std::mutex> lock(mu);
  return int(ipc_opened.size());
}

// Virtual memory management.
struct Prop {
  int type;
  int requestedHandleTypes;
  int location_type;
  int location_id;
  void* win32;
  unsigned char flags[8];
};
__attribute__((visibility("default"))) CUresult cuMemCreate(uint64_t* handle, size_t size, const Prop* prop, unsigned long long) {
  int fd = memfd_create("fake-cuda-vmm", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, off_t(size)) != 0) return OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(mu);
  uint64_t h = next_handle++;
  allocations[h] = Allocation{fd, size, prop->location_id, prop->requestedHandleTypes, 1};
  *handle = h;
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemRelease(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations.find(handle);
  if (it == allocations.end()) return INVALID_VALUE;
  if (--it->second.refs == 0) {
    ::close(it->second.memfd);
    allocations.erase(it);
  }
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemAddressReserve(CUdeviceptr* out, size_t size, size_t, CUdeviceptr, unsigned long long) {
  void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return OUT_OF_MEMORY;
  *out = reinterpret_cast<uint64_t>(p);
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
  return munmap(reinterpret_cast<void*>(p), size) == 0 ? OK : INVALID_VALUE;
}
__attribute__((visibility("default"))) CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, uint64_t handle, unsigned long long) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations.find(handle);
  if (it == allocations.end() || offset != 0 || size != it->second.size) return INVALID_VALUE;
  uint8_t *d, *s;
  if (map_memfd(it->second.memfd, size, p, &d, &s) != OK) return OUT_OF_MEMORY;
  ++it->second.refs;  // a mapping keeps its allocation alive, as on the GPU
  mappings[p] = Mapping{size, s, -1, it->second.device, 2, handle};
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
  uint64_t handle = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = mappings.find(p);
    if (it == mappings.end() || it->second.kind != 2 || it->second.size != size) return INVALID_VALUE;
    mmap(reinterpret_cast<void*>(p), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    munmap(it->second.shadow, size);
    handle = it->second.handle;
    mappings.erase(it);
  }
  return cuMemRelease(handle);
}
__attribute__((visibility("default"))) CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const void*, size_t count) {
  std::lock_guard<std::mutex> lock(mu);
  uint64_t base = 0;
  return find(p, size, &base) && count > 0 ? OK : INVALID_VALUE;
}
__attribute__((visibility("default"))) CUresult cuMemRetainAllocationHandle(uint64_t* handle, void* ptr) {
  std::lock_guard<std::mutex> lock(mu);
  uint64_t base = 0;
  Mapping* m = find(reinterpret_cast<uint64_t>(ptr), 1, &base);
  if (!m || m->kind != 2) return INVALID_VALUE;  // not VMM memory
  ++allocations[m->handle].refs;
  *handle = m->handle;
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemGetAllocationPropertiesFromHandle(Prop* prop, uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations.find(handle);
  if (it == allocations.end()) return INVALID_VALUE;
  std::memset(prop, 0, sizeof(*prop));
  prop->type = 1;
  prop->requestedHandleTypes = it->second.handle_types;
  prop->location_type = 1;
  prop->location_id = it->second.device;
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemExportToShareableHandle(void* out, uint64_t handle, int type, unsigned long long) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations.find(handle);
  if (it == allocations.end()) return INVALID_VALUE;
  if (type != 1 || !(it->second.handle_types & 1)) return NOT_PERMITTED;
  *static_cast<int*>(out) = fcntl(it->second.memfd, F_DUPFD_CLOEXEC, 0);
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemImportFromShareableHandle(uint64_t* handle, void* os_handle, int type) {
  if (type != 1) return NOT_PERMITTED;
  int fd = fcntl(int(reinterpret_cast<intptr_t>(os_handle)), F_DUPFD_CLOEXEC, 0);
  struct stat st{};
  if (fd < 0 || fstat(fd, &st) != 0) return INVALID_HANDLE;
  std::lock_guard<std::mutex> lock(mu);
  uint64_t h = next_handle++;
  allocations[h] = Allocation{fd, uint64_t(st.st_size), 0, 1, 1};
  *handle = h;
  return OK;
}

// Streams: copies wait for cuStreamSynchronize.
__attribute__((visibility("default"))) CUresult cuStreamCreate(Stream** out, unsigned) {
  int dev = current_device();
  if (dev < 0) return INVALID_CONTEXT;
  *out = new Stream{dev, {}};
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, Stream* stream) {
  if (current_device() < 0) return INVALID_CONTEXT;
  if (!stream) return INVALID_HANDLE;
  std::lock_guard<std::mutex> lock(mu);
  bool ok = true;
  uint8_t* d = resolve(dst, n, &ok);
  const uint8_t* s = resolve(src, n, &ok);
  if (!ok) return INVALID_VALUE;
  stream->pending.push_back(Copy{d, s, n});
  return OK;
}
__attribute__((visibility("default"))) CUresult cuStreamSynchronize(Stream* stream) {
  if (!stream) return INVALID_HANDLE;
  std::lock_guard<std::mutex> lock(mu);
  run_until(stream, UINT64_MAX);
  return OK;
}
__attribute__((visibility("default"))) CUresult cuEventCreate(Event** out, unsigned) {
  if (current_device() < 0) return INVALID_CONTEXT;
  *out = new Event{};
  return OK;
}
__attribute__((visibility("default"))) CUresult cuEventRecord(Event* ev, Stream* stream) {
  if (!ev || !stream) return INVALID_HANDLE;
  std::lock_guard<std::mutex> lock(mu);
  ev->stream = stream;
  ev->upto = stream->done + stream->pending.size();
  return OK;
}
__attribute__((visibility("default"))) CUresult cuEventSynchronize(Event* ev) {
  if (!ev) return INVALID_HANDLE;
  std::lock_guard<std::mutex> lock(mu);
  if (ev->stream) run_until(ev->stream, ev->upto);
  return OK;
}
__attribute__((visibility("default"))) CUresult cuEventDestroy_v2(Event* ev) {
  delete ev;
  return OK;
}

// Pinned host memory: plain host memory here.
__attribute__((visibility("default"))) CUresult cuMemHostAlloc(void** out, size_t size, unsigned) {
  if (current_device() < 0) return INVALID_CONTEXT;
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(mu);
  host_allocs[reinterpret_cast<uint64_t>(p)] = size;
  *out = p;
  return OK;
}
__attribute__((visibility("default"))) CUresult cuMemFreeHost(void* p) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = host_allocs.find(reinterpret_cast<uint64_t>(p));
  if (it == host_allocs.end()) return INVALID_VALUE;
  munmap(p, it->second);
  host_allocs.erase(it);
  return OK;
}

}  // extern "C"
