// The table of registered regions of one engine. It lives in a memfd so that same-host peers can
// map it and check every copy against it exactly as the owner does: a peer never touches memory
// that is not (or no longer) registered.
//
// Concurrency: only the owning engine adds and removes slots (under its own mutex). Readers -
// the owner's tcp server and same-host peers in other processes - take a Guard: they bump the
// slot's in-flight counter and re-check its generation, so remove() can wait until every copy
// into the region has finished before the memory goes back to the caller.
//
// Liveness: the owner's keeper thread holds a robust, process-shared mutex in the header for as
// long as the engine is open. The kernel marks that mutex when the thread exits - however the
// process dies, before its pid can be reaped and reused - so a peer learns whether the owner is
// still there from one load of shared memory, with no system call on the copy path (a pidfd
// poll before and after every copy was half the cost of a 4 KiB same-host request).
#pragma once

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "common/memory.h"

namespace tidekv {

struct alignas(64) RegionSlot {
  std::atomic<uint64_t> state;     // (generation << 1) | is_live
  std::atomic<uint64_t> inflight;  // same-host peers' copies in progress
  uint64_t addr;
  uint64_t length;
  int32_t memfd;                   // engine-allocated shared memory, else -1
  std::atomic<uint32_t> local_inflight;  // this engine's own socket I/O, and copies by this process, in progress
  MemoryKind memory_kind;
  int32_t device;
  uint8_t reserved[8];
};
static_assert(sizeof(RegionSlot) == 64);

struct TableHeader {
  uint64_t magic;
  uint8_t token[16];
  std::atomic<uint32_t> high_water;  // slots [0, high_water) may be live
  uint32_t capacity;
  pthread_mutex_t owner;  // held by the owner's keeper thread while the engine is open
  uint8_t reserved[96 - sizeof(pthread_mutex_t)];
};
static_assert(sizeof(TableHeader) == 128);

// What a lookup found; valid while the Guard that produced it lives.
struct RegionView {
  uint32_t slot;
  uint64_t generation;
  uint64_t addr;
  uint64_t length;
  int32_t memfd;
  MemoryLocation location;
};

class RegionTable {
 public:
  class Guard {
   public:
    Guard() = default;
    Guard(RegionSlot* slot, RegionView view, bool is_local) : slot_(slot), view_(view), is_local_(is_local) {}
    Guard(Guard&& other) noexcept : slot_(other.slot_), view_(other.view_), is_local_(other.is_local_) {
      other.slot_ = nullptr;
    }
    Guard& operator=(Guard&& other) noexcept;
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    ~Guard() { release(); }
    void release();
    const RegionView& view() const { return view_; }

   private:
    RegionSlot* slot_ = nullptr;
    RegionView view_{};
    bool is_local_ = false;
  };

  // Creates this engine's own table (capacity slots) in a fresh memfd.
  static RegionTable create(uint32_t capacity, const uint8_t token[16]);
  // Maps a same-host peer's table through /proc/<pid>/fd/<fd>; nullopt when that is impossible
  // or the token does not match (not the same host after all, or another process with that pid).
  static std::optional<RegionTable> attach(int pid, int fd, const uint8_t token[16]);

  RegionTable(RegionTable&& other) noexcept;
  RegionTable& operator=(RegionTable&&) = delete;
  RegionTable(const RegionTable&) = delete;
  ~RegionTable();

  int fd() const { return fd_; }
  // Whether the owning engine is still open: false once it closed or its process exited (or is
  // exiting). Lock-free; a peer checks it before planning on the table and after each copy.
  bool is_owner_alive() const;
  // Owner only: tells peers this engine is gone (its keeper lets go of the owner mutex).
  // Idempotent; the destructor does it too.
  void retire();
  // Owner only. Throws kConfig on overlap with a live region or when the table is full.
  uint32_t add(uint64_t addr, uint64_t length, int32_t memfd, MemoryLocation location);
  // Owner only. Marks the region dead, then waits for copies in flight: this engine's own socket
  // I/O always ends (each has an I/O timeout), and so does a copy by any engine of this
  // process (its shm link takes local guards); a same-host peer's copy is waited for at most
  // peer_timeout_ms (a peer that died mid-copy never finishes it).
  // Returns the view of the removed region, nullopt when addr starts no live region.
  std::optional<RegionView> remove(uint64_t addr, int peer_timeout_ms);
  // Lock-free lookup of a live region containing [addr, addr + length), held until the Guard
  // dies. is_local: the caller is this engine (counts in local_inflight), else a peer.
  std::optional<Guard> acquire(uint64_t addr, uint64_t length, bool is_local) const;
  // Same, without holding it (planning only; acquire again before touching memory).
  std::optional<RegionView> find(uint64_t addr, uint64_t length) const;
  // Re-validates a view found earlier: still live with the same generation.
  std::optional<Guard> acquire_slot(const RegionView& view, bool is_local) const;

 private:
  // The owner's thread that holds TableHeader::owner: robust mutexes belong to a thread, so the
  // one that locks it must live exactly as long as the engine and unlock it itself.
  class Keeper {
   public:
    explicit Keeper(pthread_mutex_t* owner);  // returns once the mutex is held; throws kConfig
    ~Keeper();                                // unlocks it (on its thread) and joins

   private:
    std::mutex mu_;
    std::condition_variable cv_;
    bool held_ = false;
    bool stop_ = false;
    std::thread thread_;
  };

  RegionTable(int fd, void* base, size_t size, bool is_owner);
  RegionSlot* slots() const;
  TableHeader* header() const { return static_cast<TableHeader*>(base_); }

  int fd_;
  void* base_;
  size_t size_;
  bool is_owner_;
  std::unique_ptr<Keeper> keeper_;  // owner only, until retire()
  std::mutex owner_mu_;
};

}  // namespace tidekv
