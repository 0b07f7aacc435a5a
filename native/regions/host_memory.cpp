#include "regions/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "common/errors.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it and the fallback touches each page
#endif

namespace tidekv {

namespace {

constexpr uint64_t kHuge = 2ull << 20;
constexpr uint64_t kPopulateChunk = 256ull << 20;  // below this per thread, one thread does it all
constexpr unsigned kPopulateThreads = 8;

// Faults [start, start + length) in, writable, now rather than inside the first transfers. The
// kernel zeroes every page it faults in, which is most of a large segment's start-up (seconds
// per 10 GiB for one thread): several threads fault disjoint pieces. Returns 0 or an errno.
int populate(uint8_t* start, uint64_t length) {
  unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  uint64_t threads = std::min<uint64_t>({cores, kPopulateThreads, (length + kPopulateChunk - 1) / kPopulateChunk});
  uint64_t piece = (length / std::max<uint64_t>(threads, 1) + kHuge - 1) / kHuge * kHuge;  // huge-page aligned
  std::vector<int> errors(threads, 0);
  auto fault = [&](uint64_t index) {
    uint64_t from = index * piece;
    if (from >= length) return;
    uint64_t size = std::min(piece, length - from);
    if (madvise(start + from, size, MADV_POPULATE_WRITE) == 0) return;
    if (errno != EINVAL) {  // EINVAL: a kernel before 5.14; anything else: the memory is not there
      errors[index] = errno;
      return;
    }
    for (uint64_t off = 0; off < size; off += 4096) start[from + off] = 0;
  };
  std::vector<std::thread> helpers;
  for (uint64_t i = 1; i < threads; ++i) {
    try {
      helpers.emplace_back(fault, i);
    } catch (const std::system_error&) {  // no thread to be had: this one does that piece too
      fault(i);
    }
  }
  fault(0);
  for (auto& t : helpers) t.join();
  for (int e : errors)
    if (e != 0) return e;
  return 0;
}

// A child the process forks (a DataLoader worker, the master's fold) gets none of this memory:
// private pages would turn copy-on-write, so every write into the segment while the child lives
// copies its page (1 GiB of writes 18x slower here, the memory twice over), and pages pinned
// for a NIC could be split from the process's own. Advisory: a failure leaves the old behaviour.
void dont_fork(const HostMemory& a) { madvise(a.base, a.mapped, MADV_DONTFORK); }

}  // namespace

void HostMemory::release() {
  munmap(base, mapped);
  if (memfd >= 0) ::close(memfd);
}

HostMemory HostMemory::allocate(uint64_t length, bool huge) {
  HostMemory a;
  if (huge) {
    // Private anonymous memory on 2 MiB boundaries with transparent huge pages: same-host peers
    // reach it by cross-memory attach instead of mapping it, and reads of it stay fast after it
    // sat idle (on some VMs idle 4 KiB pages read 3-4x slower the first time; huge pages do not).
    a.mapped = (length + kHuge - 1) / kHuge * kHuge + kHuge;
    a.base = mmap(nullptr, a.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a.base == MAP_FAILED)
      TIDEKV_THROW(kConfig, "cannot map " + std::to_string(length) + " bytes of memory: " + strerror(errno));
    uint64_t b = reinterpret_cast<uint64_t>(a.base);
    a.start = reinterpret_cast<uint8_t*>((b + kHuge - 1) / kHuge * kHuge);
    madvise(a.start, length, MADV_HUGEPAGE);  // advisory: without THP the memory is still usable
    dont_fork(a);
    if (int err = populate(a.start, length); err != 0) {
      a.release();
      TIDEKV_THROW(kConfig, "cannot allocate " + std::to_string(length) + " bytes of memory: " + strerror(err));
    }
    return a;
  }
  a.memfd = memfd_create("tidekv-buffer", MFD_CLOEXEC);
  if (a.memfd < 0) TIDEKV_THROW(kConfig, std::string("memfd_create failed: ") + strerror(errno));
  if (ftruncate(a.memfd, off_t(length)) != 0) {
    ::close(a.memfd);
    TIDEKV_THROW(kConfig, "cannot allocate " + std::to_string(length) + " bytes of shared memory: " + strerror(errno));
  }
  a.mapped = length;
  a.base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, a.memfd, 0);
  if (a.base == MAP_FAILED) {
    ::close(a.memfd);
    TIDEKV_THROW(kConfig, "cannot map " + std::to_string(length) + " bytes of shared memory: " + strerror(errno));
  }
  a.start = static_cast<uint8_t*>(a.base);
  dont_fork(a);
  if (int err = populate(a.start, length); err != 0) {
    a.release();
    TIDEKV_THROW(kConfig, "cannot allocate " + std::to_string(length) + " bytes of shared memory: " + strerror(err));
  }
  return a;
}

}  // namespace tidekv
