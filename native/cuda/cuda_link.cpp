#include "cuda/cuda_link.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/errors.h"
#include "common/host_identity.h"
#include "common/text.h"
#include "cuda/driver.h"

namespace tidekv::cuda {
namespace {

int pidfd_open(int pid) { return int(syscall(SYS_pidfd_open, pid, 0)); }
int pidfd_getfd(int pidfd, int fd) { return int(syscall(SYS_pidfd_getfd, pidfd, fd, 0)); }


std::string describe(const Slice& s) {
  return std::string(" during ") + (s.op == wire::Op::kRead ? "READ" : "WRITE") + " [" + hex(s.remote) + ", +" +
         std::to_string(s.length) + ")";
}

}  // namespace

std::shared_ptr<CudaLink> CudaLink::open(EngineContext& ctx, const std::string& peer_name, const CudaSection& s) {
  std::string boot(s.boot_id, strnlen(s.boot_id, sizeof(s.boot_id)));
  if (boot.empty() || boot != local_boot_id()) return nullptr;
  auto table = RegionTable::attach(s.pid, s.table_fd, s.token);
  if (!table) return nullptr;
  int pidfd = pidfd_open(s.pid);
  if (pidfd < 0) return nullptr;
  std::string path = "/proc/" + std::to_string(s.pid) + "/fd/" + std::to_string(s.export_fd);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  size_t len = sizeof(ExportEntry) * s.capacity;
  void* base = fd < 0 ? MAP_FAILED : mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
  if (fd >= 0) ::close(fd);
  if (base == MAP_FAILED) {
    ctx.log.emit_once("cuda-attach:" + peer_name, LogLevel::kInfo,
                      "peer " + peer_name + " is on this host but its cuda export table cannot be opened (" +
                          strerror(errno) + "); its GPU memory is not reachable by the cuda transport");
    ::close(pidfd);
    return nullptr;
  }
  return std::shared_ptr<CudaLink>(
      new CudaLink(ctx, peer_name, s, pidfd, std::move(*table), static_cast<const ExportEntry*>(base), len));
}

CudaLink::CudaLink(EngineContext& ctx, std::string peer_name, const CudaSection& s, int pidfd, RegionTable table,
                   const ExportEntry* exports, size_t exports_len)
    : ctx_(ctx), peer_name_(std::move(peer_name)), pid_(s.pid), same_process_(s.pid == getpid()), pidfd_(pidfd),
      table_(std::move(table)), exports_(exports), exports_len_(exports_len), capacity_(s.capacity) {}

CudaLink::~CudaLink() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    opened_.clear();  // tasks still holding an Opened keep it until they finish
  }
  munmap(const_cast<ExportEntry*>(exports_), exports_len_);
  if (pidfd_ >= 0) ::close(pidfd_);
}

bool CudaLink::is_peer_alive() const { return table_.is_owner_alive(); }

bool CudaLink::is_current() const { return is_peer_alive(); }

CudaLink::Opened::~Opened() {
  if (host_map) munmap(host_map, host_len);
  Driver& d = Driver::get();
  bool any = false;
  for (const Piece& p : pieces) any = any || (p.local && p.kind != ChunkKind::kNone);
  if (!any || !d.available()) return;
  try {
    Driver::Scope scope(d, device);
    for (const Piece& p : pieces) {
      if (!p.local) continue;
      if (p.kind == ChunkKind::kIpc) {
        d.close_ipc(p.local);
      } else if (p.kind == ChunkKind::kVmm) {
        d.api().cuMemUnmap(p.local, p.size);
        d.api().cuMemAddressFree(p.local, p.size);
        d.api().cuMemRelease(p.vmm);
      }
    }
  } catch (const Error&) {
    // The context is gone (process exit): the driver has released everything already.
  }
}

uint64_t CudaLink::Opened::translate(uint64_t remote, uint64_t length, uint64_t* span, std::string* why) const {
  if (!this->why.empty()) {
    *why = this->why;
    return 0;
  }
  auto it = std::upper_bound(pieces.begin(), pieces.end(), remote, [](uint64_t a, const Piece& p) { return a < p.remote; });
  if (it == pieces.begin()) {
    *why = "no allocation of the peer holds " + hex(remote);
    return 0;
  }
  const Piece& p = *--it;
  if (remote >= p.remote + p.size) {
    *why = "no allocation of the peer holds " + hex(remote);
    return 0;
  }
  if (!p.local) {
    *why = "the peer's allocation at " + hex(p.remote) + " cannot be opened here: " + p.why;
    return 0;
  }
  *span = std::min(length, p.remote + p.size - remote);
  return p.local + (remote - p.remote);
}

std::shared_ptr<CudaLink::Opened> CudaLink::opened(const RegionView& view) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = opened_.find(view.slot);
  if (it != opened_.end() && it->second->generation == view.generation) return it->second;
  auto o = open_region(view);  // replaces a stale one (the slot was reused); its users keep theirs
  opened_[view.slot] = o;
  return o;
}

std::shared_ptr<CudaLink::Opened> CudaLink::open_region(const RegionView& view) const {
  auto o = std::make_shared<Opened>();
  o->view = view;
  o->generation = view.generation;
  o->location = view.location;
  if (view.location.kind == MemoryKind::kCpu) {
    Piece p;
    p.remote = view.addr;
    p.size = view.length;
    if (same_process_) {
      p.local = view.addr;
    } else if (view.memfd < 0) {
      o->why = "the peer's range is host memory it did not allocate(), which the cuda transport cannot reach in "
               "another process";
    } else {
      std::string path = "/proc/" + std::to_string(pid_) + "/fd/" + std::to_string(view.memfd);
      int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
      void* base = fd < 0 ? MAP_FAILED : mmap(nullptr, view.length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (fd >= 0) ::close(fd);
      if (base == MAP_FAILED) {
        o->why = std::string("cannot map the peer's shared memory: ") + strerror(errno);
      } else {
        o->host_map = base;
        o->host_len = view.length;
        p.local = reinterpret_cast<uint64_t>(base);
      }
    }
    o->pieces.push_back(p);
    return o;
  }
  Driver& d = Driver::get();
  if (!d.available()) {
    o->why = "no CUDA driver in this process: " + d.reason();
    return o;
  }
  auto rec = read_record(pid_, exports_, capacity_, view);
  if (!rec) {
    o->why = "the peer has not published this GPU region (it is still registering it, or it was unregistered)";
    return o;
  }
  o->device = 0;
  if (same_process_) {
    o->device = rec->device;
  } else {
    for (const auto& dev : d.devices())
      if (!rec->pci_bus.empty() && dev.pci_bus == rec->pci_bus) o->device = dev.ordinal;
  }
  Driver::Scope scope(d, o->device);
  for (const ChunkRecord& c : rec->chunks) {
    Piece p;
    p.remote = c.base;
    p.size = c.size;
    if (same_process_) {
      p.local = c.base;  // one address space: nothing to open
    } else if (c.kind == ChunkKind::kIpc) {
      try {
        p.local = d.open_ipc(c.ipc, "peer " + peer_name_ + "'s allocation at " + hex(c.base));
        p.kind = ChunkKind::kIpc;
      } catch (const Error& e) {
        p.why = e.what();
      }
    } else if (c.kind == ChunkKind::kVmm) {
      int fd = pidfd_getfd(pidfd_, c.fd);
      if (fd < 0) {
        p.why = std::string("pidfd_getfd of its handle failed: ") + strerror(errno);
      } else {
        const Api& api = d.api();
        CUmemGenericAllocationHandle h = 0;
        CUdeviceptr va = 0;
        CUmemAccessDesc access{{CU_MEM_LOCATION_TYPE_DEVICE, o->device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        CUresult rc = api.cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(intptr_t(fd)),
                                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        const char* step = "cuMemImportFromShareableHandle";
        if (rc == CUDA_SUCCESS) {
          step = "cuMemAddressReserve";
          rc = api.cuMemAddressReserve(&va, c.size, 0, 0, 0);
          if (rc == CUDA_SUCCESS) {
            step = "cuMemMap";
            rc = api.cuMemMap(va, c.size, 0, h, 0);
            if (rc == CUDA_SUCCESS) {
              step = "cuMemSetAccess";
              rc = api.cuMemSetAccess(va, c.size, &access, 1);
              if (rc != CUDA_SUCCESS) api.cuMemUnmap(va, c.size);
            }
            if (rc != CUDA_SUCCESS) api.cuMemAddressFree(va, c.size);
          }
          if (rc != CUDA_SUCCESS) api.cuMemRelease(h);
        }
        ::close(fd);
        if (rc == CUDA_SUCCESS) {
          p.local = va;
          p.kind = ChunkKind::kVmm;
          p.vmm = h;
        } else {
          p.why = std::string(step) + " failed: " + d.error_text(rc);
        }
      }
    } else {
      p.why = c.why;
    }
    o->pieces.push_back(p);
  }
  return o;
}

int CudaLink::preference(const Request& r, MemoryLocation local) const {
  // GPU memory here and nothing registered there: take it, so that the copy reports it as not
  // registered (as tcp would for host memory), not as "no transport".
  if (local.kind == MemoryKind::kCuda && !table_.find(r.remote_addr, r.length)) return kPreference;
  std::string why;
  return refusal_reason(r, local, &why) ? kPreference : 0;
}

std::string CudaLink::refusal(const Request& r, MemoryLocation local) const {
  std::string why;
  refusal_reason(r, local, &why);
  return why;
}

bool CudaLink::refusal_reason(const Request& r, MemoryLocation local, std::string* why) const {
  auto view = table_.find(r.remote_addr, r.length);
  if (!view) {
    *why = "peer " + peer_name_ + " has no registered region holding [" + hex(r.remote_addr) + ", +" +
           std::to_string(r.length) + ")";
    return false;
  }
  if (local.kind != MemoryKind::kCuda && view->location.kind != MemoryKind::kCuda) {
    *why = "cuda moves requests with GPU memory on one side at least, and both ranges are host memory";
    return false;
  }
  auto o = opened(*view);
  for (uint64_t done = 0; done < r.length;) {
    uint64_t span = 0;
    if (!o->translate(r.remote_addr + done, r.length - done, &span, why)) {
      *why = "peer " + peer_name_ + "'s " + view->location.str() + " range: " + *why;
      return false;
    }
    done += span;
  }
  return true;
}

void CudaLink::sweep() const {
  auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (now < next_sweep_) return;
  next_sweep_ = now + std::chrono::seconds(1);
  for (auto it = opened_.begin(); it != opened_.end();) {
    if (table_.acquire_slot(it->second->view, /*is_local=*/false))
      ++it;
    else
      it = opened_.erase(it);  // closed here, or by the last task still holding it
  }
}

void CudaLink::plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) {
  sweep();
  std::vector<Slice> slices;
  slices.reserve(requests.size());
  for (uint32_t r : requests) {
    const Request& q = batch->requests()[r];
    slices.push_back(Slice{r, q.op, q.local_addr, q.remote_addr, q.length});
    batch->expect_slices(r, 1);
  }
  Batch* raw = batch.get();
  batch->add_task(std::make_shared<Task>(
      [self = shared_from_this(), raw, keep = batch, slices = std::move(slices)](const Deadline&) { self->run(*raw, slices); }));
}

void CudaLink::run(Batch& batch, const std::vector<Slice>& slices) {
  Driver& d = Driver::get();
  std::vector<uint8_t> issued(slices.size(), 0);
  std::vector<RegionTable::Guard> guards;
  std::vector<std::shared_ptr<Opened>> keep;
  std::vector<std::pair<int, CUstream>> streams;  // every stream this task copied on
  std::unique_ptr<Driver::Scope> scope;
  int scope_device = -1;
  uint32_t last_request = UINT32_MAX;
  int local_device = -1;
  std::string sync_error;
  try {
    for (size_t i = 0; i < slices.size(); ++i) {
      const Slice& s = slices[i];
      try {
        if (closed_.load(std::memory_order_relaxed)) TIDEKV_THROW(kClosed, "engine closed");
        const Request& q = batch.requests()[s.request];
        // The whole request must lie in one region of the peer, and stay registered until the
        // stream is done with it.
        auto guard = table_.acquire(q.remote_addr, q.length, /*is_local=*/false);
        if (!guard) TIDEKV_THROW(kNotRegistered, "peer " + peer_name_ + " has no registered region holding the range");
        auto o = opened(guard->view());
        if (s.request != last_request) {
          last_request = s.request;
          MemoryLocation where = batch.local_location(s.request);
          local_device = where.kind == MemoryKind::kCuda ? where.device : -1;
        }
        int device = local_device >= 0 ? local_device : o->device;
        if (device != scope_device) {
          scope.reset();
          scope = std::make_unique<Driver::Scope>(d, device);
          scope_device = device;
        }
        CUstream stream = d.stream(device);
        if (streams.empty() || streams.back().second != stream) {
          bool seen = false;
          for (auto& [dev, st] : streams) seen = seen || st == stream;
          if (!seen) streams.emplace_back(device, stream);
        }
        for (uint64_t done = 0; done < s.length;) {
          uint64_t span = 0;
          std::string why;
          uint64_t remote = o->translate(s.remote + done, s.length - done, &span, &why);
          if (!remote) TIDEKV_THROW(kTransfer, "peer " + peer_name_ + ": " + why);
          uint64_t local = s.local + done;
          CUdeviceptr dst = s.op == wire::Op::kRead ? local : remote;
          CUdeviceptr src = s.op == wire::Op::kRead ? remote : local;
          d.check(d.api().cuMemcpyAsync(dst, src, span, stream), "cuMemcpyAsync");
          done += span;
        }
        guards.push_back(std::move(*guard));
        keep.push_back(std::move(o));
        issued[i] = 1;
      } catch (const Error& e) {
        batch.fail_slice(s.request, e.kind(), std::string(e.what()) + describe(s));
      }
    }
    for (auto& [device, stream] : streams) {
      if (device != scope_device) {
        scope.reset();
        scope = std::make_unique<Driver::Scope>(d, device);
        scope_device = device;
      }
      CUresult rc = d.api().cuStreamSynchronize(stream);
      if (rc != CUDA_SUCCESS && sync_error.empty()) sync_error = "cuStreamSynchronize failed: " + d.error_text(rc);
    }
  } catch (const Error& e) {
    sync_error = e.what();  // no context for a device: nothing issued can be trusted
  }
  scope.reset();
  bool alive = is_peer_alive();
  if (sync_error.empty() && alive) {
    // Counted before any slice completes: completing the last one wakes the waiter, who may
    // read stats() at once and must see these bytes.
    uint64_t moved[2] = {0, 0};  // by op
    for (size_t i = 0; i < slices.size(); ++i)
      if (issued[i]) moved[slices[i].op == wire::Op::kWrite] += slices[i].length;
    ctx_.counters.cuda_bytes.fetch_add(moved[0] + moved[1], std::memory_order_relaxed);
    ctx_.counters.bytes_read.fetch_add(moved[0], std::memory_order_relaxed);
    ctx_.counters.bytes_written.fetch_add(moved[1], std::memory_order_relaxed);
  }
  for (size_t i = 0; i < slices.size(); ++i) {
    if (!issued[i]) continue;
    const Slice& s = slices[i];
    if (!sync_error.empty()) {
      batch.fail_slice(s.request, ErrorKind::kTransfer, sync_error + describe(s));
    } else if (!alive) {
      batch.fail_slice(s.request, ErrorKind::kPeerUnavailable,
                       "peer " + peer_name_ + " (pid " + std::to_string(pid_) + ") exited or closed its engine" +
                           describe(s));
    } else {
      batch.complete_slice(s.request, s.length);
    }
  }
}

}  // namespace tidekv::cuda
