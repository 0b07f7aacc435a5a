#include "shm/shm_transport.h"

#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "common/host_identity.h"
#include "shm/shm_link.h"
#include "shm/shm_section.h"

namespace tidekv {
namespace {

// Whether this process may use process_vm_readv at all (a seccomp profile may forbid it); the
// per-peer answer (Yama, another user) comes from the probe in ShmLink::open.
std::string probe_cross_memory_attach() {
  uint8_t src[8] = {1}, dst[8] = {0};
  iovec local{dst, sizeof(dst)}, remote{src, sizeof(src)};
  if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) != ssize_t(sizeof(dst)))
    return std::string("refused here (") + strerror(errno) + "; a seccomp profile?)";
  std::ifstream yama("/proc/sys/kernel/yama/ptrace_scope");
  int scope = -1;
  if (yama >> scope && scope >= 2) return "refused between processes (Yama ptrace_scope=" + std::to_string(scope) + ")";
  return "allowed";
}

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(TransportEnv env) : ctx_(env.ctx), regions_(env.regions) {
    if (ctx_.options.shm.enable_cross_memory_attach) {
      // Lets same-host peers use process_vm_readv/writev on us under Yama ptrace_scope=1.
      prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    }
  }
  TransportId id() const override { return TransportId::kShm; }
  const char* name() const override { return "shm"; }
  Availability availability() const override {
    std::string cma = ctx_.options.shm.enable_cross_memory_attach ? probe_cross_memory_attach()
                                                              : "disabled (enable_cross_memory_attach=False)";
    return {true, "same-host host memory: allocate()d memory mapped; other registered memory by cross-memory attach: " + cma};
  }
  std::string describe() override {
    ShmSection s{};
    s.pid = getpid();
    s.table_fd = regions_.fd();
    s.token_addr = reinterpret_cast<uint64_t>(ctx_.instance);
    std::memcpy(s.token, ctx_.instance, sizeof(s.token));
    std::strncpy(s.boot_id, local_boot_id().c_str(), sizeof(s.boot_id) - 1);
    return std::string(reinterpret_cast<const char*>(&s), sizeof(s));
  }
  std::shared_ptr<PeerLink> connect(const PeerAddress& peer, const std::string* section) override {
    if (!section || section->size() != sizeof(ShmSection)) return nullptr;
    ShmSection s;
    std::memcpy(&s, section->data(), sizeof(s));
    return ShmLink::open(ctx_, peer.name, s);
  }
  void close() override {}

 private:
  EngineContext& ctx_;
  const RegionTable& regions_;
};

}  // namespace

std::unique_ptr<Transport> make_shm_transport(TransportEnv env) { return std::make_unique<ShmTransport>(env); }

}  // namespace tidekv
