#include "regions/region_table.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <system_error>
#include <thread>

#include "common/errors.h"

namespace tidekv {
namespace {

constexpr uint64_t kTableMagic = 0x324c424154564b44ULL;  // "DKVTABL2" (the header with the owner mutex)

#ifdef __GLIBC__
// Peers read the owner mutex's lock word (the owner's thread id, FUTEX_OWNER_DIED once the
// kernel has seen that thread exit): it must be the word glibc's robust mutexes use.
static_assert(offsetof(pthread_mutex_t, __data.__lock) == 0);
#endif

bool contains(uint64_t base, uint64_t len, uint64_t addr, uint64_t n) {
  return addr >= base && n <= len && addr - base <= len - n;
}

}  // namespace

RegionTable::Guard& RegionTable::Guard::operator=(Guard&& other) noexcept {
  if (this != &other) {
    release();
    slot_ = other.slot_;
    view_ = other.view_;
    is_local_ = other.is_local_;
    other.slot_ = nullptr;
  }
  return *this;
}

void RegionTable::Guard::release() {
  if (slot_) {
    if (is_local_)
      slot_->local_inflight.fetch_sub(1, std::memory_order_release);
    else
      slot_->inflight.fetch_sub(1, std::memory_order_release);
  }
  slot_ = nullptr;
}

RegionTable::RegionTable(int fd, void* base, size_t size, bool is_owner)
    : fd_(fd), base_(base), size_(size), is_owner_(is_owner) {}

RegionTable::RegionTable(RegionTable&& other) noexcept
    : fd_(other.fd_), base_(other.base_), size_(other.size_), is_owner_(other.is_owner_),
      keeper_(std::move(other.keeper_)) {
  other.fd_ = -1;
  other.base_ = nullptr;
}

RegionTable::~RegionTable() {
  keeper_.reset();
  if (base_) munmap(base_, size_);
  if (fd_ >= 0) close(fd_);
}

RegionTable::Keeper::Keeper(pthread_mutex_t* owner) {
  try {
    thread_ = std::thread([this, owner] {
      int rc = pthread_mutex_lock(owner);
      if (rc == EOWNERDEAD) pthread_mutex_consistent(owner);  // (never: the mutex is fresh)
      std::unique_lock<std::mutex> lock(mu_);
      held_ = true;
      cv_.notify_all();
      cv_.wait(lock, [this] { return stop_; });
      pthread_mutex_unlock(owner);
    });
  } catch (const std::system_error& e) {
    TIDEKV_THROW(kConfig, std::string("cannot start the region table's keeper thread: ") + e.what());
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return held_; });
}

RegionTable::Keeper::~Keeper() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  thread_.join();
}

bool RegionTable::is_owner_alive() const {
  uint32_t word = __atomic_load_n(reinterpret_cast<const uint32_t*>(&header()->owner), __ATOMIC_SEQ_CST);
  return (word & FUTEX_TID_MASK) != 0 && !(word & FUTEX_OWNER_DIED);
}

void RegionTable::retire() { keeper_.reset(); }

RegionSlot* RegionTable::slots() const {
  return reinterpret_cast<RegionSlot*>(static_cast<uint8_t*>(base_) + sizeof(TableHeader));
}

RegionTable RegionTable::create(uint32_t capacity, const uint8_t token[16]) {
  size_t size = sizeof(TableHeader) + size_t(capacity) * sizeof(RegionSlot);
  int fd = memfd_create("tidekv-regions", MFD_CLOEXEC);
  if (fd < 0) TIDEKV_THROW(kConfig, std::string("memfd_create for the region table failed: ") + strerror(errno));
  if (ftruncate(fd, off_t(size)) != 0) {
    close(fd);
    TIDEKV_THROW(kConfig, std::string("sizing the region table failed: ") + strerror(errno));
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    close(fd);
    TIDEKV_THROW(kConfig, std::string("mapping the region table failed: ") + strerror(errno));
  }
  RegionTable table(fd, base, size, true);
  TableHeader* h = table.header();
  h->magic = kTableMagic;
  std::memcpy(h->token, token, 16);
  h->high_water.store(0);
  h->capacity = capacity;
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(&h->owner, &attr);
  pthread_mutexattr_destroy(&attr);
  for (uint32_t i = 0; i < capacity; ++i) {
    new (&table.slots()[i]) RegionSlot();
    table.slots()[i].state.store(0);
    table.slots()[i].inflight.store(0);
    table.slots()[i].local_inflight.store(0);
    table.slots()[i].memfd = -1;
  }
  table.keeper_ = std::make_unique<Keeper>(&h->owner);
  return table;
}

std::optional<RegionTable> RegionTable::attach(int pid, int fd, const uint8_t token[16]) {
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int local = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) return std::nullopt;
  TableHeader probe{};
  if (pread(local, &probe, sizeof(probe), 0) != ssize_t(sizeof(probe)) || probe.magic != kTableMagic ||
      std::memcmp(probe.token, token, 16) != 0) {
    close(local);
    return std::nullopt;
  }
  size_t size = sizeof(TableHeader) + size_t(probe.capacity) * sizeof(RegionSlot);
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
  if (base == MAP_FAILED) {
    close(local);
    return std::nullopt;
  }
  return RegionTable(local, base, size, false);
}

uint32_t RegionTable::add(uint64_t addr, uint64_t length, int32_t memfd, MemoryLocation location) {
  if (length == 0) TIDEKV_THROW(kConfig, "cannot register an empty region (length 0)");
  if (addr + length < addr) TIDEKV_THROW(kConfig, "region wraps around the address space");
  std::lock_guard<std::mutex> lock(owner_mu_);
  TableHeader* h = header();
  uint32_t high = h->high_water.load();
  uint32_t free_slot = h->capacity;
  for (uint32_t i = 0; i < high; ++i) {
    RegionSlot& s = slots()[i];
    if (s.state.load() & 1) {
      if (addr < s.addr + s.length && s.addr < addr + length)
        TIDEKV_THROW(kConfig, "region [" + std::to_string(addr) + ", +" + std::to_string(length) +
                                  ") overlaps registered region [" + std::to_string(s.addr) + ", +" +
                                  std::to_string(s.length) + "); unregister it first");
    } else if (free_slot == h->capacity && s.inflight.load() == 0 && s.local_inflight.load() == 0) {
      free_slot = i;
    }
  }
  if (free_slot == h->capacity) {
    if (high == h->capacity)
      TIDEKV_THROW(kConfig, "region table full (" + std::to_string(h->capacity) +
                                " regions); raise TransferConfig.max_regions");
    free_slot = high;
  }
  RegionSlot& s = slots()[free_slot];
  s.addr = addr;
  s.length = length;
  s.memfd = memfd;
  s.memory_kind = location.kind;
  s.device = location.device;
  uint64_t gen = (s.state.load() >> 1) + 1;
  s.state.store((gen << 1) | 1, std::memory_order_seq_cst);
  if (free_slot >= high) h->high_water.store(free_slot + 1);
  return free_slot;
}

std::optional<RegionView> RegionTable::remove(uint64_t addr, int peer_timeout_ms) {
  std::lock_guard<std::mutex> lock(owner_mu_);
  uint32_t high = header()->high_water.load();
  for (uint32_t i = 0; i < high; ++i) {
    RegionSlot& s = slots()[i];
    uint64_t state = s.state.load();
    if (!(state & 1) || s.addr != addr) continue;
    RegionView view{i, state >> 1, s.addr, s.length, s.memfd, {s.memory_kind, s.device}};
    s.state.store(state & ~uint64_t(1), std::memory_order_seq_cst);
    while (s.local_inflight.load(std::memory_order_acquire) != 0)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(peer_timeout_ms);
    while (s.inflight.load(std::memory_order_acquire) != 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    // A peer that died inside a copy leaves its count behind: the slot stays unusable for reuse
    // (add() skips it) but the caller gets the memory back after the timeout.
    return view;
  }
  return std::nullopt;
}

std::optional<RegionView> RegionTable::find(uint64_t addr, uint64_t length) const {
  uint32_t high = header()->high_water.load(std::memory_order_acquire);
  for (uint32_t i = 0; i < high; ++i) {
    RegionSlot& s = slots()[i];
    uint64_t state = s.state.load(std::memory_order_acquire);
    if (!(state & 1)) continue;
    RegionView view{i, state >> 1, s.addr, s.length, s.memfd, {s.memory_kind, s.device}};
    if (s.state.load(std::memory_order_acquire) != state) continue;
    if (contains(view.addr, view.length, addr, length)) return view;
  }
  return std::nullopt;
}

std::optional<RegionTable::Guard> RegionTable::acquire_slot(const RegionView& view, bool is_local) const {
  if (view.slot >= header()->capacity) return std::nullopt;
  RegionSlot& s = slots()[view.slot];
  if (is_local)
    s.local_inflight.fetch_add(1, std::memory_order_seq_cst);
  else
    s.inflight.fetch_add(1, std::memory_order_seq_cst);
  Guard guard(&s, view, is_local);  // releases the count on every path out
  if (s.state.load(std::memory_order_seq_cst) != ((view.generation << 1) | 1)) return std::nullopt;
  return guard;
}

std::optional<RegionTable::Guard> RegionTable::acquire(uint64_t addr, uint64_t length, bool is_local) const {
  auto view = find(addr, length);
  if (!view) return std::nullopt;
  return acquire_slot(*view, is_local);
}

}  // namespace tidekv
