#include "regions/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/errors.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it and the fallback touches each page
#endif

namespace tidekv {

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
    constexpr uint64_t kHuge = 2ull << 20;
    a.mapped = (length + kHuge - 1) / kHuge * kHuge + kHuge;
    a.base = mmap(nullptr, a.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a.base == MAP_FAILED)
      TIDEKV_THROW(kConfig, "cannot map " + std::to_string(length) + " bytes of memory: " + strerror(errno));
    uint64_t b = reinterpret_cast<uint64_t>(a.base);
    a.start = reinterpret_cast<uint8_t*>((b + kHuge - 1) / kHuge * kHuge);
    madvise(a.start, length, MADV_HUGEPAGE);  // advisory: without THP the memory is still usable
    // Fault it in now (huge pages where the kernel has them) rather than inside the first transfers.
    if (madvise(a.start, length, MADV_POPULATE_WRITE) != 0) {
      if (errno != EINVAL) {  // EINVAL: a kernel before 5.14; anything else: the memory is not there
        int err = errno;
        a.release();
        TIDEKV_THROW(kConfig, "cannot allocate " + std::to_string(length) + " bytes of memory: " + strerror(err));
      }
      for (uint64_t off = 0; off < length; off += 4096) a.start[off] = 0;
    }
    return a;
  }
  a.memfd = memfd_create("tidekv-buffer", MFD_CLOEXEC);
  if (a.memfd < 0) TIDEKV_THROW(kConfig, std::string("memfd_create failed: ") + strerror(errno));
  if (ftruncate(a.memfd, off_t(length)) != 0) {
    ::close(a.memfd);
    TIDEKV_THROW(kConfig, "cannot allocate " + std::to_string(length) + " bytes of shared memory: " + strerror(errno));
  }
  // MAP_POPULATE: pay the page faults now rather than inside the first transfers into it.
  a.mapped = length;
  a.base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, a.memfd, 0);
  if (a.base == MAP_FAILED) {
    ::close(a.memfd);
    TIDEKV_THROW(kConfig, "cannot map " + std::to_string(length) + " bytes of shared memory: " + strerror(errno));
  }
  a.start = static_cast<uint8_t*>(a.base);
  return a;
}

}  // namespace tidekv
