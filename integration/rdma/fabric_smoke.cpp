// The fabric transport between two processes, on whatever libfabric provider
// $TIDEKV_FABRIC_PROVIDER names: built from native/ as it is (no Python), so that it runs where
// Python does not, such as the soft-RoCE guest of integration/rdma/softroce.sh, over a real
// verbs device.
//
//   fabric_smoke target HOST               allocates 4 MiB filled with pattern(1) and a second
//                                          region of 64 KiB, prints "READY <name> <addr> <size>
//                                          <pid> <second addr>", serves until killed, and
//                                          unregisters the second region on SIGUSR1 (then creates
//                                          /tmp/fabric_smoke.unregistered)
//   fabric_smoke initiator HOST NAME ADDR SIZE TARGET_PID SECOND_ADDR
//                                          READs and WRITEs of several sizes and offsets, every
//                                          byte checked; a READ past the region's end refused;
//                                          the second region read, unregistered by the target,
//                                          then refused;
//                                          prints the provider and its registration mode, and
//                                          "PASS" or "FAIL ..." lines; exit status 0: all passed
//
// Neighbours: run_smoke.sh (the guest's payload), tests/transfer/test_contract.py (the same
// checks, and many more, over fabric on the tcp provider, in CI).
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "engine/engine.h"

using tidekv::Engine;
using tidekv::EngineOptions;
using tidekv::Request;
using tidekv::RequestState;

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  std::fflush(stdout);
  if (!ok) ++failures;
}

uint8_t pattern(uint32_t seed, uint64_t x) {
  uint64_t z = x + uint64_t(seed) * 0x9E3779B97F4A7C15ull;
  z ^= z >> 29;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 32;
  return uint8_t(z);
}

EngineOptions options(const std::string& host) {
  EngineOptions o;
  o.host = host;
  o.port = 0;
  o.transport = "fabric";
  const char* provider = std::getenv("TIDEKV_FABRIC_PROVIDER");
  o.fabric.provider = provider ? provider : "verbs";
  o.io_timeout_ms = 20000;
  return o;
}

std::string fabric_reason(const Engine& e, bool* available) {
  for (const auto& t : e.transports())
    if (t.name == "fabric") {
      *available = t.available;
      return t.reason;
    }
  *available = false;
  return "no fabric transport in this build";
}

volatile sig_atomic_t unregister_asked = 0;

int run_target(const std::string& host) {
  Engine e(options(host));
  bool available;
  std::string reason = fabric_reason(e, &available);
  std::printf("target fabric: %s: %s\n", available ? "available" : "UNAVAILABLE", reason.c_str());
  const uint64_t size = 4 << 20;
  uint64_t addr = e.allocate(size);
  auto* p = reinterpret_cast<uint8_t*>(addr);
  for (uint64_t i = 0; i < size; ++i) p[i] = pattern(1, i);
  uint64_t second = e.allocate(65536);
  std::memset(reinterpret_cast<void*>(second), 0x42, 65536);
  signal(SIGUSR1, [](int) { unregister_asked = 1; });
  std::printf("READY %s %llu %llu %d %llu\n", e.name().c_str(), (unsigned long long)addr, (unsigned long long)size,
              int(getpid()), (unsigned long long)second);
  std::fflush(stdout);
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (unregister_asked == 1) {
      unregister_asked = 2;
      e.unregister_region(second);  // revokes it at the initiator before its key goes
      std::fclose(std::fopen("/tmp/fabric_smoke.unregistered", "w"));
    }
  }
}

// One batch of one request; returns the request's result.
tidekv::RequestResult one(Engine& e, uint32_t peer, tidekv::wire::Op op, uint64_t local, uint64_t length,
                          uint64_t remote) {
  auto batch = e.submit({Request{op, local, length, peer, remote}});
  batch->wait(30.0);
  if (!batch->is_done()) return {RequestState::kPending, tidekv::ErrorKind::kTimeout, "not done in 30 s"};
  return batch->results()[0];
}

int run_initiator(const std::string& host, const std::string& name, uint64_t raddr, uint64_t rsize, int target_pid,
                  uint64_t second) {
  Engine e(options(host));
  bool available;
  std::string reason = fabric_reason(e, &available);
  std::printf("initiator fabric: %s\n", reason.c_str());
  check(available, "fabric available on the initiator");
  if (!available) return 1;
  // The strict registration path is the one taken: a real NIC asks for local descriptors,
  // provider keys and virtual addresses, and the transport says which mode it follows.
  if (reason.rfind("provider verbs", 0) == 0)
    check(reason.find("LOCAL") != std::string::npos && reason.find("PROV_KEY") != std::string::npos,
          "verbs asks for the strict registration mode (FI_MR_LOCAL, FI_MR_PROV_KEY) and fabric follows it");
  std::string host_part = name.substr(0, name.rfind(':'));
  int port = std::atoi(name.substr(name.rfind(':') + 1).c_str());
  uint32_t peer = e.add_peer(name, e.fetch_descriptor(host_part, port));
  std::vector<std::string> transports = e.peer_transports(name);
  check(!transports.empty() && transports[0] == "fabric", "the peer is reached by fabric first");

  const uint64_t size = 4 << 20;
  std::vector<uint8_t> local(size), back(size);
  e.register_region(reinterpret_cast<uint64_t>(local.data()), size, "cpu");
  e.register_region(reinterpret_cast<uint64_t>(back.data()), size, "cpu");
  struct Case {
    uint64_t length, offset;
  };
  const Case cases[] = {{1, 0}, {4096, 4096}, {65536, 12345}, {1 << 20, 1 << 20}, {rsize - 7, 7}};
  for (const Case& c : cases) {
    auto r = one(e, peer, tidekv::wire::Op::kRead, reinterpret_cast<uint64_t>(local.data()), c.length, raddr + c.offset);
    bool same = r.state == RequestState::kDone;
    for (uint64_t i = 0; same && i < c.length; ++i) same = local[i] == pattern(1, c.offset + i);
    check(same, "READ " + std::to_string(c.length) + " bytes at +" + std::to_string(c.offset) +
                    " byte for byte" + (r.state == RequestState::kDone ? "" : ": " + r.message));
  }
  for (const Case& c : cases) {
    for (uint64_t i = 0; i < c.length; ++i) local[i] = pattern(2 + uint32_t(c.length), i);
    auto w = one(e, peer, tidekv::wire::Op::kWrite, reinterpret_cast<uint64_t>(local.data()), c.length, raddr + c.offset);
    auto r = one(e, peer, tidekv::wire::Op::kRead, reinterpret_cast<uint64_t>(back.data()), c.length, raddr + c.offset);
    bool same = w.state == RequestState::kDone && r.state == RequestState::kDone &&
                std::memcmp(local.data(), back.data(), c.length) == 0;
    check(same, "WRITE " + std::to_string(c.length) + " bytes at +" + std::to_string(c.offset) +
                    ", read back byte for byte" + (w.state == RequestState::kDone ? "" : ": " + w.message));
  }
  std::memset(back.data(), 0x77, 64);
  auto oob = one(e, peer, tidekv::wire::Op::kRead, reinterpret_cast<uint64_t>(back.data()), 20, raddr + rsize - 10);
  check(oob.state == RequestState::kFailed && oob.kind == tidekv::ErrorKind::kNotRegistered,
        "a READ past the region's end is refused (" + oob.message + ")");
  check(back[0] == 0x77, "nothing of the refused READ landed");
  auto after = one(e, peer, tidekv::wire::Op::kRead, reinterpret_cast<uint64_t>(back.data()), 4096, raddr);
  check(after.state == RequestState::kDone && back[0] == pattern(3, 0),  // the 1-byte WRITE's seed: 2 + length
        "the next READ works (the endpoint is intact)");
  // A region the initiator has used, unregistered by the target: refused per request afterwards.
  auto before = one(e, peer, tidekv::wire::Op::kRead, reinterpret_cast<uint64_t>(back.data()), 4096, second);
  check(before.state == RequestState::kDone && back[0] == 0x42, "READ of the second region before it goes");
  std::remove("/tmp/fabric_smoke.unregistered");
  kill(target_pid, SIGUSR1);
  for (int i = 0; i < 600 && access("/tmp/fabric_smoke.unregistered", F_OK) != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::memset(back.data(), 0x77, 4096);
  auto gone = one(e, peer, tidekv::wire::Op::kRead, reinterpret_cast<uint64_t>(back.data()), 4096, second);
  check(gone.state == RequestState::kFailed && gone.kind == tidekv::ErrorKind::kNotRegistered && back[0] == 0x77,
        "a READ of the region the target unregistered is refused and nothing lands (" + gone.message + ")");
  auto still = one(e, peer, tidekv::wire::Op::kRead, reinterpret_cast<uint64_t>(back.data()), 4096, raddr);
  check(still.state == RequestState::kDone && back[0] == pattern(3, 0), "the first region is still read");
  std::printf("%s: %d failed\n", failures ? "FAIL" : "PASS", failures);
  e.close();
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 3 && std::strcmp(argv[1], "target") == 0) return run_target(argv[2]);
    if (argc == 8 && std::strcmp(argv[1], "initiator") == 0)
      return run_initiator(argv[2], argv[3], std::strtoull(argv[4], nullptr, 10), std::strtoull(argv[5], nullptr, 10),
                           std::atoi(argv[6]), std::strtoull(argv[7], nullptr, 10));
  } catch (const tidekv::Error& e) {
    std::printf("FAIL %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: %s target HOST | initiator HOST NAME ADDR SIZE TARGET_PID SECOND_ADDR\n", argv[0]);
  return 2;
}
