#include "cuda/cuda_export.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "common/errors.h"
#include "common/text.h"
#include "cuda/driver.h"

namespace tidekv::cuda {
namespace {

constexpr uint64_t kRecordMagic = 0x7469646b76637564ULL;  // "tidkvcud"
constexpr int CU_POINTER_ATTRIBUTE_MAPPING_SIZE = 18;
constexpr int CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR = 19;
constexpr uint32_t kMaxChunks = 1u << 20;


void set_why(ChunkRecord& c, const std::string& why) {
  std::memset(c.why, 0, sizeof(c.why));
  std::strncpy(c.why, why.c_str(), sizeof(c.why) - 1);
}

// One allocation: exported by a POSIX fd when it is VMM memory that allows it, else by an IPC
// handle; fds it creates are appended to *fds (the owner keeps them until unregister).
ChunkRecord export_chunk(Driver& d, uint64_t ptr, std::vector<int>* fds) {
  const Api& api = d.api();
  ChunkRecord c{};
  c.fd = -1;
  CUmemGenericAllocationHandle handle = 0;
  if (api.cuMemRetainAllocationHandle(&handle, reinterpret_cast<void*>(ptr)) == CUDA_SUCCESS) {
    // Virtual-memory-managed: the mapping, not the reserved range, is one allocation.
    uint64_t base = 0;
    size_t size = 0;
    if (api.cuPointerGetAttribute(&base, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, ptr) != CUDA_SUCCESS ||
        api.cuPointerGetAttribute(&size, CU_POINTER_ATTRIBUTE_MAPPING_SIZE, ptr) != CUDA_SUCCESS) {
      CUdeviceptr b = 0;
      d.check(api.cuMemGetAddressRange(&b, &size, ptr), "cuMemGetAddressRange(" + hex(ptr) + ")", ErrorKind::kConfig);
      base = b;
    }
    c.base = base;
    c.size = size;
    CUmemAllocationProp prop{};
    int fd = -1;
    if (api.cuMemGetAllocationPropertiesFromHandle(&prop, handle) != CUDA_SUCCESS ||
        !(prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
      set_why(c, "VMM memory without a POSIX-fd handle");
    } else if (api.cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS) {
      set_why(c, "cuMemExportToShareableHandle failed");
    } else {
      c.kind = ChunkKind::kVmm;
      c.fd = fd;
      fds->push_back(fd);
    }
    api.cuMemRelease(handle);
    return c;
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  d.check(api.cuMemGetAddressRange(&base, &size, ptr), "cuMemGetAddressRange(" + hex(ptr) + ")", ErrorKind::kConfig);
  c.base = base;
  c.size = size;
  if (api.cuIpcGetMemHandle(&c.ipc, base) == CUDA_SUCCESS)
    c.kind = ChunkKind::kIpc;
  else
    set_why(c, "cuIpcGetMemHandle refused it");
  return c;
}

}  // namespace

RegionRecord build_record(uint64_t addr, uint64_t length, int device, std::vector<int>* fds) {
  Driver& d = Driver::get();
  TIDEKV_CHECK(d.available(), kConfig, "cannot register cuda:" + std::to_string(device) + " memory: " + d.reason());
  RegionRecord rec;
  rec.device = device;
  if (size_t(device) < d.devices().size()) rec.pci_bus = d.devices()[device].pci_bus;
  Driver::Scope scope(d, device);
  for (uint64_t ptr = addr; ptr < addr + length;) {
    int where = d.device_of(ptr);
    if (where < 0)
      TIDEKV_THROW(kConfig, "[" + hex(ptr) + ", ...) is not GPU memory the CUDA driver knows; register host memory with "
                            "location='cpu'");
    if (where != device)
      TIDEKV_THROW(kConfig, "[" + hex(ptr) + ", ...) is on cuda:" + std::to_string(where) + ", not on cuda:" +
                                std::to_string(device) + " as registered");
    ChunkRecord c = export_chunk(d, ptr, fds);
    if (c.size == 0 || c.base > ptr || c.base + c.size <= ptr)
      TIDEKV_THROW(kConfig, "the CUDA driver reports no allocation around " + hex(ptr));
    rec.chunks.push_back(c);
    TIDEKV_CHECK(rec.chunks.size() <= kMaxChunks, kConfig, "the range spans more than " + std::to_string(kMaxChunks) + " allocations");
    ptr = c.base + c.size;
  }
  return rec;
}

ExportTable::ExportTable(uint32_t capacity) : capacity_(capacity), owned_(capacity) {
  fd_ = memfd_create("tidekv-cuda-exports", MFD_CLOEXEC);
  size_t bytes = sizeof(ExportEntry) * capacity;
  if (fd_ < 0 || ftruncate(fd_, off_t(bytes)) != 0)
    TIDEKV_THROW(kConfig, std::string("cannot create the cuda export table: ") + strerror(errno));
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (base == MAP_FAILED) TIDEKV_THROW(kConfig, std::string("cannot map the cuda export table: ") + strerror(errno));
  entries_ = static_cast<ExportEntry*>(base);
}

ExportTable::~ExportTable() {
  for (auto& o : owned_) {
    if (o.record_fd >= 0) ::close(o.record_fd);
    for (int fd : o.handle_fds) ::close(fd);
  }
  if (entries_) munmap(entries_, sizeof(ExportEntry) * capacity_);
  if (fd_ >= 0) ::close(fd_);
}

void ExportTable::add(const RegionView& view) {
  TIDEKV_CHECK(view.slot < capacity_, kConfig, "region slot out of range");
  Owned owned;
  RegionRecord rec = build_record(view.addr, view.length, view.location.device, &owned.handle_fds);
  RecordHeader h{};
  h.magic = kRecordMagic;
  h.count = uint32_t(rec.chunks.size());
  h.device = rec.device;
  std::strncpy(h.pci_bus, rec.pci_bus.c_str(), sizeof(h.pci_bus) - 1);
  std::string bytes(reinterpret_cast<const char*>(&h), sizeof(h));
  bytes.append(reinterpret_cast<const char*>(rec.chunks.data()), rec.chunks.size() * sizeof(ChunkRecord));
  owned.record_fd = memfd_create("tidekv-cuda-region", MFD_CLOEXEC);
  if (owned.record_fd < 0 || pwrite(owned.record_fd, bytes.data(), bytes.size(), 0) != ssize_t(bytes.size())) {
    int err = errno;
    if (owned.record_fd >= 0) ::close(owned.record_fd);
    for (int fd : owned.handle_fds) ::close(fd);
    TIDEKV_THROW(kConfig, std::string("cannot publish the cuda region's record: ") + strerror(err));
  }
  std::lock_guard<std::mutex> lock(mu_);
  Owned& slot = owned_[view.slot];
  std::swap(slot, owned);
  ExportEntry& e = entries_[view.slot];
  e.generation.store(0, std::memory_order_release);
  e.record_fd = slot.record_fd;
  e.record_bytes = uint32_t(bytes.size());
  e.generation.store(view.generation, std::memory_order_release);
  if (owned.record_fd >= 0) ::close(owned.record_fd);  // a stale one left by a failed remove
  for (int fd : owned.handle_fds) ::close(fd);
}

void ExportTable::remove(const RegionView& view) {
  if (view.slot >= capacity_) return;
  std::lock_guard<std::mutex> lock(mu_);
  entries_[view.slot].generation.store(0, std::memory_order_release);
  Owned& o = owned_[view.slot];
  if (o.record_fd >= 0) ::close(o.record_fd);
  for (int fd : o.handle_fds) ::close(fd);
  o = Owned{};
}

std::optional<RegionRecord> read_record(int pid, const ExportEntry* table, uint32_t capacity, const RegionView& view) {
  if (view.slot >= capacity) return std::nullopt;
  const ExportEntry& e = table[view.slot];
  if (e.generation.load(std::memory_order_acquire) != view.generation) return std::nullopt;
  int record_fd = e.record_fd;
  uint32_t bytes = e.record_bytes;
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(record_fd);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string buf(bytes, '\0');
  ssize_t n = pread(fd, buf.data(), bytes, 0);
  ::close(fd);
  if (e.generation.load(std::memory_order_acquire) != view.generation) return std::nullopt;  // replaced meanwhile
  RecordHeader h{};
  if (n != ssize_t(bytes) || bytes < sizeof(h)) return std::nullopt;
  std::memcpy(&h, buf.data(), sizeof(h));
  if (h.magic != kRecordMagic || bytes != sizeof(h) + uint64_t(h.count) * sizeof(ChunkRecord)) return std::nullopt;
  RegionRecord rec;
  rec.device = h.device;
  rec.pci_bus.assign(h.pci_bus, strnlen(h.pci_bus, sizeof(h.pci_bus)));
  rec.chunks.resize(h.count);
  std::memcpy(rec.chunks.data(), buf.data() + sizeof(h), h.count * sizeof(ChunkRecord));
  return rec;
}

}  // namespace tidekv::cuda
