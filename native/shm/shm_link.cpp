#include "shm/shm_link.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "common/copy.h"
#include "common/errors.h"
#include "common/host_identity.h"

namespace tidekv {
namespace {

constexpr uint64_t kShmSliceBytes = 16ULL << 20;
constexpr size_t kMaxIov = 1024;  // IOV_MAX
constexpr uint64_t kMaxVectoredBytes = 64ULL << 20;

std::string describe(const Slice& s) {
  char range[80];
  snprintf(range, sizeof(range), " during %s [0x%llx, +%llu)", s.op == wire::Op::kRead ? "READ" : "WRITE",
           (unsigned long long)s.remote, (unsigned long long)s.length);
  return range;
}

}  // namespace

std::shared_ptr<ShmLink> ShmLink::open(EngineContext& ctx, const std::string& peer_name, const ShmSection& d) {
  std::string boot(d.boot_id, strnlen(d.boot_id, sizeof(d.boot_id)));
  if (boot.empty() || boot != local_boot_id()) return nullptr;
  auto table = RegionTable::attach(d.pid, d.table_fd, d.token);
  if (!table) {
    ctx.log.emit_once("shm-attach:" + peer_name, LogLevel::kInfo,
                      "peer " + peer_name + " shares this host's boot id but its region table (pid " +
                          std::to_string(d.pid) + ") cannot be opened; using tcp for it");
    return nullptr;
  }
  if (!table->is_owner_alive()) return nullptr;  // a descriptor of an engine that is gone
  // The table came through /proc/<our pid>/fd and carries the peer's token: the peer is an
  // engine of this process, whose memory needs no cross-memory attach.
  bool is_same_process = d.pid == getpid();
  bool cma_ok = false;
  if (ctx.options.shm.enable_cross_memory_attach && !is_same_process) {
    uint8_t probe[16] = {0};
    iovec local{probe, sizeof(probe)};
    iovec remote{reinterpret_cast<void*>(d.token_addr), sizeof(probe)};
    ssize_t n = process_vm_readv(d.pid, &local, 1, &remote, 1, 0);
    cma_ok = n == ssize_t(sizeof(probe)) && std::memcmp(probe, d.token, sizeof(probe)) == 0;
    if (!cma_ok)
      ctx.log.emit_once("cma-refused", LogLevel::kWarning,
                        "cross-memory attach to peer " + peer_name + " (pid " + std::to_string(d.pid) +
                            ") refused by the kernel (" + (n < 0 ? std::string(strerror(errno)) : "token mismatch") +
                            "; see /proc/sys/kernel/yama/ptrace_scope): same-host transfers into memory not "
                            "obtained from allocate() fall back to tcp");
  }
  return std::shared_ptr<ShmLink>(
      new ShmLink(ctx, peer_name, d.pid, std::move(*table), cma_ok, is_same_process));
}

ShmLink::ShmLink(EngineContext& ctx, std::string peer_name, int pid, RegionTable table, bool cma_ok,
                 bool is_same_process)
    : ctx_(ctx), peer_name_(std::move(peer_name)), pid_(pid), table_(std::move(table)), cma_ok_(cma_ok),
      is_same_process_(is_same_process) {}

ShmLink::~ShmLink() {
  for (auto& [slot, m] : mappings_) munmap(m.base, m.length);
}

int ShmLink::preference(const Request& r, MemoryLocation local) const {
  constexpr int kSameHost = 10;  // beats any network transport
  if (local.kind != MemoryKind::kCpu) return 0;
  bool reaches_any = cma_ok_ || is_same_process_;
  auto view = table_.find(r.remote_addr, r.length);
  if (!view) return reaches_any ? kSameHost : 0;  // unregistered: the copy reports it the way tcp would
  if (view->location.kind != MemoryKind::kCpu) return 0;
  return view->memfd >= 0 || reaches_any ? kSameHost : 0;
}

std::string ShmLink::refusal(const Request& r, MemoryLocation local) const {
  if (local.kind != MemoryKind::kCpu)
    return "shm copies host memory only, and the local range is in " + local.str() + " memory";
  auto view = table_.find(r.remote_addr, r.length);
  if (view && view->location.kind != MemoryKind::kCpu)
    return "shm copies host memory only, and the peer's range is in " + view->location.str() + " memory";
  return "cross-memory attach to peer " + peer_name_ +
         " is not permitted (disabled, or refused by the kernel) and the range is not in memory it allocated";
}

void ShmLink::plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) {
  std::vector<Slice> slices;
  slices.reserve(requests.size());
  uint64_t total = 0;
  for (uint32_t r : requests) {
    const Request& q = batch->requests()[r];
    uint32_t n = 0;
    for (uint64_t off = 0; off < q.length; off += kShmSliceBytes, ++n)
      slices.push_back(Slice{r, q.op, q.local_addr + off, q.remote_addr + off, std::min(kShmSliceBytes, q.length - off)});
    batch->expect_slices(r, n);
    total += q.length;
  }
  // Split by bytes into at most shm_parallelism tasks: memory bandwidth, not latency, is the limit.
  size_t tasks = std::min<size_t>(slices.size(), size_t(std::max(1, ctx_.options.shm.parallelism)));
  if (total < (1ULL << 20)) tasks = 1;  // below this, waking a second thread costs more than it saves
  // A batch too large to stay in the caches is copied around them (common/copy.h).
  const bool stream = ctx_.options.shm.stream_copy_bytes > 0 && total >= ctx_.options.shm.stream_copy_bytes;
  Batch* raw = batch.get();
  auto emit = [&](std::vector<Slice> part) {
    batch->add_task(std::make_shared<Task>([self = shared_from_this(), raw, keep = batch, part = std::move(part),
                                            stream](const Deadline&) { self->run(*raw, part, stream); }));
  };
  if (tasks == 1) return emit(std::move(slices));
  uint64_t per_task = (total + tasks - 1) / tasks;
  std::vector<Slice> part;
  uint64_t part_bytes = 0;
  for (const auto& s : slices) {
    part.push_back(s);
    part_bytes += s.length;
    if (part_bytes >= per_task) {
      emit(std::move(part));
      part.clear();
      part_bytes = 0;
    }
  }
  if (!part.empty()) emit(std::move(part));
}

void ShmLink::run(Batch& batch, const std::vector<Slice>& slices, bool stream) {
  std::vector<uint8_t> copied(slices.size(), 0);
  auto fail = [&](size_t i, const Error& e) {
    batch.fail_slice(slices[i].request, e.kind(), std::string(e.what()) + describe(slices[i]));
  };
  // Cross-memory-attach slices in a row (a KV hand-off: a few KiB per layer and block) go in one
  // process_vm_readv/writev; memfd-backed ones and a same-process peer's are copied on the spot.
  std::vector<size_t> cma;
  std::vector<iovec> local, remote;
  std::vector<RegionTable::Guard> guards;
  uint64_t cma_bytes = 0;
  uint64_t streamed = 0;
  auto flush = [&] {
    if (cma.empty()) return;
    ssize_t n = -1;
    if (cma.size() > 1)
      n = slices[cma[0]].op == wire::Op::kRead
              ? process_vm_readv(pid_, local.data(), local.size(), remote.data(), remote.size(), 0)
              : process_vm_writev(pid_, local.data(), local.size(), remote.data(), remote.size(), 0);
    if (n == ssize_t(cma_bytes)) {
      for (size_t i : cma) copied[i] = 1;
    } else {
      // One slice, a signal, or a vanished peer: copy one by one, which finishes the rest and
      // reports each failure against its own request.
      for (size_t i : cma) {
        try {
          copy_cma(slices[i]);
          copied[i] = 1;
        } catch (const Error& e) {
          fail(i, e);
        }
      }
    }
    cma.clear();
    local.clear();
    remote.clear();
    guards.clear();
    cma_bytes = 0;
  };
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& s = slices[i];
    try {
      if (closed_.load(std::memory_order_relaxed)) TIDEKV_THROW(kClosed, "engine closed");
      // The whole request must lie in one region, not just this slice: no part of a request
      // that reaches past its region may land.
      const Request& q = batch.requests()[s.request];
      auto guard = table_.acquire(q.remote_addr, q.length, /*is_local=*/is_same_process_);
      if (!guard) TIDEKV_THROW(kNotRegistered, "peer " + peer_name_ + " has no registered region holding the range");
      if (is_same_process_ || guard->view().memfd >= 0) {
        // A peer in this process is copied at its own addresses; engine-allocated memory through our mapping.
        const RegionView& view = guard->view();
        auto* remote = is_same_process_ ? reinterpret_cast<uint8_t*>(s.remote)
                                        : static_cast<uint8_t*>(map_region(view)) + (s.remote - view.addr);
        copy(s, remote, stream);
        copied[i] = 1;
        if (stream) streamed += s.length;
        continue;
      }
      if (!cma_ok_) TIDEKV_THROW(kTransfer, "cross-memory attach to peer " + peer_name_ + " is not permitted");
      if (!cma.empty() && (slices[cma[0]].op != s.op || cma.size() >= kMaxIov || cma_bytes >= kMaxVectoredBytes)) flush();
      cma.push_back(i);
      local.push_back(iovec{reinterpret_cast<void*>(s.local), s.length});
      remote.push_back(iovec{reinterpret_cast<void*>(s.remote), s.length});
      guards.push_back(std::move(*guard));
      cma_bytes += s.length;
    } catch (const Error& e) {
      fail(i, e);
    }
  }
  flush();
  // One liveness check per task: a copy into the memory of a process that has exited may have
  // "succeeded" into pages nobody will read, so none of this task's copies can be trusted then.
  // (Still alive after the copies also means the pid that cross-memory attach named was the
  // peer's all along: a pid is reused only after its process is gone and reaped.)
  bool alive = table_.is_owner_alive();
  if (alive) {
    // Counted before any slice completes: completing the last one wakes the waiter, who may
    // read stats() at once and must see these bytes.
    uint64_t moved[2] = {0, 0};  // by op
    for (size_t i = 0; i < slices.size(); ++i)
      if (copied[i]) moved[slices[i].op == wire::Op::kWrite] += slices[i].length;
    ctx_.counters.shm_bytes.fetch_add(moved[0] + moved[1], std::memory_order_relaxed);
    if (streamed) ctx_.counters.shm_streamed_bytes.fetch_add(streamed, std::memory_order_relaxed);
    ctx_.counters.bytes_read.fetch_add(moved[0], std::memory_order_relaxed);
    ctx_.counters.bytes_written.fetch_add(moved[1], std::memory_order_relaxed);
  }
  for (size_t i = 0; i < slices.size(); ++i) {
    if (!copied[i]) continue;
    const Slice& s = slices[i];
    if (!alive) {
      batch.fail_slice(s.request, ErrorKind::kPeerUnavailable,
                       "peer " + peer_name_ + " (pid " + std::to_string(pid_) + ") exited or closed its engine" +
                           describe(s));
      continue;
    }
    batch.complete_slice(s.request, s.length);
  }
}

void* ShmLink::map_region(const RegionView& view) {
  std::lock_guard<std::mutex> lock(map_mu_);
  auto it = mappings_.find(view.slot);
  if (it != mappings_.end()) {
    if (it->second.generation == view.generation) return it->second.base;
    munmap(it->second.base, it->second.length);
    mappings_.erase(it);
  }
  std::string path = "/proc/" + std::to_string(pid_) + "/fd/" + std::to_string(view.memfd);
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) TIDEKV_THROW(kPeerUnavailable, "cannot open shared memory of peer " + peer_name_ + ": " + strerror(errno));
  void* base = mmap(nullptr, view.length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) TIDEKV_THROW(kTransfer, "cannot map shared memory of peer " + peer_name_ + ": " + strerror(errno));
  mappings_[view.slot] = Mapping{view.generation, base, view.length};
  return base;
}

void ShmLink::copy(const Slice& s, uint8_t* remote, bool stream) {
  auto* local = reinterpret_cast<uint8_t*>(s.local);
  if (s.op == wire::Op::kRead)
    copy_bytes(local, remote, s.length, stream);
  else
    copy_bytes(remote, local, s.length, stream);
}

void ShmLink::copy_cma(const Slice& s) {
  uint64_t done = 0;
  while (done < s.length) {
    iovec local{reinterpret_cast<void*>(s.local + done), s.length - done};
    iovec remote{reinterpret_cast<void*>(s.remote + done), s.length - done};
    ssize_t n = s.op == wire::Op::kRead ? process_vm_readv(pid_, &local, 1, &remote, 1, 0)
                                        : process_vm_writev(pid_, &local, 1, &remote, 1, 0);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == ESRCH)
        TIDEKV_THROW(kPeerUnavailable, "peer " + peer_name_ + " (pid " + std::to_string(pid_) + ") exited");
      TIDEKV_THROW(kTransfer, "cross-memory copy with peer " + peer_name_ + " failed: " +
                                  (n < 0 ? std::string(strerror(errno)) : "no progress"));
    }
    done += uint64_t(n);
  }
}

}  // namespace tidekv
