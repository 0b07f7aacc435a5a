#include "cuda/cuda_transport.h"

#include <unistd.h>

#include <cstring>

#include "common/host_identity.h"
#include "cuda/cuda_export.h"
#include "cuda/cuda_link.h"
#include "cuda/cuda_section.h"
#include "cuda/driver.h"

namespace tidekv {
namespace {

class CudaTransport final : public Transport {
 public:
  explicit CudaTransport(TransportEnv env)
      : ctx_(env.ctx), regions_(env.regions), driver_(cuda::Driver::get()) {
    if (driver_.available()) exports_ = std::make_unique<cuda::ExportTable>(ctx_.options.max_regions);
  }
  TransportId id() const override { return TransportId::kCuda; }
  const char* name() const override { return "cuda"; }
  Availability availability() const override {
    if (!driver_.available()) return {false, driver_.reason()};
    return {true, "same-host GPU memory (CUDA IPC and POSIX-fd VMM handles, cuMemcpyAsync); " + driver_.reason()};
  }
  bool handles(MemoryKind kind) const override { return kind == MemoryKind::kCuda; }
  std::string describe() override {
    cuda::CudaSection s{};
    s.pid = getpid();
    s.table_fd = regions_.fd();
    s.export_fd = exports_ ? exports_->fd() : -1;
    s.capacity = ctx_.options.max_regions;
    std::memcpy(s.token, ctx_.instance, sizeof(s.token));
    std::strncpy(s.boot_id, local_boot_id().c_str(), sizeof(s.boot_id) - 1);
    return std::string(reinterpret_cast<const char*>(&s), sizeof(s));
  }
  void on_register(const RegionView& region) override {
    if (region.location.kind == MemoryKind::kCuda && exports_) exports_->add(region);
  }
  void on_unregister(const RegionView& region) override {
    if (region.location.kind == MemoryKind::kCuda && exports_) exports_->remove(region);
  }
  std::shared_ptr<PeerLink> connect(const PeerAddress& peer, const std::string* section) override {
    if (!section || section->size() != sizeof(cuda::CudaSection)) return nullptr;
    cuda::CudaSection s;
    std::memcpy(&s, section->data(), sizeof(s));
    if (s.export_fd < 0) return nullptr;
    return cuda::CudaLink::open(ctx_, peer.name, s);
  }
  void close() override {}

 private:
  EngineContext& ctx_;
  const RegionTable& regions_;
  cuda::Driver& driver_;
  std::unique_ptr<cuda::ExportTable> exports_;
};

}  // namespace

std::unique_ptr<Transport> make_cuda_transport(TransportEnv env) { return std::make_unique<CudaTransport>(env); }

}  // namespace tidekv
