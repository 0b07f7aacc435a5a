#include "tcp/tcp_transport.h"

#include "cuda/driver.h"
#include "tcp/tcp_link.h"
#include "tcp/tcp_server.h"

namespace tidekv {
namespace {

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(TransportEnv env) : ctx_(env.ctx), server_(env.ctx, env.regions) {}
  TransportId id() const override { return TransportId::kTcp; }
  const char* name() const override { return "tcp"; }
  Availability availability() const override {
    return {true, cuda::Driver::get().available() ? "always available (any host; GPU memory staged through pinned host memory)"
                                                  : "always available (host memory, any host)"};
  }
  // GPU memory is staged through host memory, where a CUDA driver is there to copy it.
  bool handles(MemoryKind kind) const override {
    return kind == MemoryKind::kCpu || (kind == MemoryKind::kCuda && cuda::Driver::get().available());
  }
  std::shared_ptr<PeerLink> connect(const PeerAddress& peer, const std::string* section) override {
    return std::make_shared<TcpLink>(ctx_, peer);  // needs nothing from the peer but its address
  }
  bool accepts_connections() const override { return true; }
  bool admit(const uint8_t instance[16]) override { return server_.admit(instance); }
  void adopt(Connection conn) override { server_.adopt(std::move(conn)); }
  void close() override { server_.stop(); }

 private:
  EngineContext& ctx_;
  TcpServer server_;
};

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(TransportEnv env) { return std::make_unique<TcpTransport>(env); }

}  // namespace tidekv
