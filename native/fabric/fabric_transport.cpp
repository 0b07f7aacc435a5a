// The fabric transport's engine-wide half: the domain (fabric_domain.h), every region of host
// memory registered with it, the section peers reach the endpoint by, and the serving side of
// the control connections: region lookups answered with the region's key, and revokes sent to
// every initiator before a region's registration goes, so no key outlives its memory.
#include "fabric/fabric_transport.h"

#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "common/errors.h"
#include "common/socket.h"
#include "common/wire.h"
#include "fabric/fabric_domain.h"
#include "fabric/fabric_link.h"
#include "fabric/fabric_wire.h"

namespace tidekv {
namespace {

using fabric::Msg;
using fabric::MsgKind;
using fabric::Registration;

class FabricTransport final : public Transport {
 public:
  explicit FabricTransport(TransportEnv env) : ctx_(env.ctx), regions_(env.regions) {
    std::string why;
    domain_ = fabric::Domain::open(ctx_, ctx_.options.fabric_provider, ctx_.options.host, &why);
    if (!domain_) {
      reason_ = why;
      return;
    }
    try {
      scratch_ = domain_->register_memory(reinterpret_cast<uint64_t>(scratch_bytes_), sizeof(scratch_bytes_));
    } catch (const Error& e) {
      reason_ = e.what();
      domain_.reset();
      return;
    }
    reason_ = domain_->describe();
  }
  ~FabricTransport() override { close(); }

  TransportId id() const override { return TransportId::kFabric; }
  const char* name() const override { return "fabric"; }
  Availability availability() const override { return {domain_ != nullptr, reason_}; }

  std::string describe() override {
    if (!domain_) return {};
    fabric::Section s{};
    s.magic = fabric::kSectionMagic;
    const std::string& name = domain_->endpoint_name();
    s.name_bytes = uint32_t(std::min(name.size(), sizeof(s.name)));
    std::memcpy(s.name, name.data(), s.name_bytes);
    s.mr_mode = domain_->mr_mode();
    std::strncpy(s.provider, domain_->provider().c_str(), sizeof(s.provider) - 1);
    return std::string(reinterpret_cast<const char*>(&s), sizeof(s));
  }

  void on_register(const RegionView& region) override {
    if (!domain_ || region.location.kind != MemoryKind::kCpu) return;
    Registration r = domain_->register_memory(region.addr, region.length);
    std::lock_guard<std::mutex> lock(mu_);
    served_[region.addr] = r;
  }

  void on_unregister(const RegionView& region) override {
    if (!domain_) return;
    Registration r{};
    std::vector<std::shared_ptr<Control>> peers;
    uint64_t tag;
    {
      // First no lookup finds it, then every initiator forgets it, then the key dies.
      std::lock_guard<std::mutex> lock(mu_);
      auto it = served_.find(region.addr);
      if (it == served_.end()) return;
      r = it->second;
      served_.erase(it);
      tag = next_tag_++;
      for (auto& c : controls_)
        if (!c->lost) {
          c->awaiting.insert(tag);
          peers.push_back(c);
        }
    }
    Msg revoke{fabric::kMsgMagic, uint32_t(MsgKind::kRevoke), tag, r.base, r.length, r.key, 0, 0};
    for (auto& c : peers) {
      if (!c->send(revoke)) {
        std::lock_guard<std::mutex> lock(mu_);
        c->awaiting.erase(tag);
      }
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      bool acked = acks_.wait_for(lock, std::chrono::milliseconds(ctx_.options.unregister_timeout_ms), [&] {
        for (auto& c : peers)
          if (!c->lost && c->awaiting.count(tag)) return false;
        return true;
      });
      for (auto& c : peers) c->awaiting.erase(tag);
      if (!acked)
        ctx_.log.emit(LogLevel::kWarning, "fabric: a peer did not confirm in unregister_timeout_ms that it stopped using " +
                                              region.location.str() + " region at " + std::to_string(r.base) +
                                              "; its key is revoked anyway (the peer's operations on it fail)");
    }
    domain_->deregister(r);
  }

  std::shared_ptr<PeerLink> connect(const PeerAddress& peer, const std::string* section) override {
    if (!domain_ || !section || section->size() != sizeof(fabric::Section)) return nullptr;
    fabric::Section s;
    std::memcpy(&s, section->data(), sizeof(s));
    if (s.magic != fabric::kSectionMagic || s.name_bytes > sizeof(s.name)) return nullptr;
    std::string provider(s.provider, strnlen(s.provider, sizeof(s.provider)));
    if (provider != domain_->provider()) {
      ctx_.log.emit_once("fabric-provider:" + peer.name, LogLevel::kWarning,
                         "fabric: peer " + peer.name + " runs provider " + provider + ", this engine " +
                             domain_->provider() + ": fabric cannot reach it (set the same fabric_provider on both)");
      return nullptr;
    }
    return std::make_shared<fabric::FabricLink>(ctx_, *domain_, scratch_, peer,
                                                 std::string(reinterpret_cast<const char*>(s.name), s.name_bytes));
  }

  bool accepts_connections() const override { return domain_ != nullptr; }

  void adopt(Connection conn) override {
    auto c = std::make_shared<Control>();
    c->fd = conn.fd;
    c->what = conn.what;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_ || !domain_) {
        ::close(conn.fd);
        return;
      }
      controls_.push_back(c);
    }
    try {
      c->thread = std::thread([this, c] { serve(c); });
    } catch (const std::system_error&) {
      std::lock_guard<std::mutex> lock(mu_);
      controls_.remove(c);
      ::close(c->fd);
    }
  }

  void close() override {
    std::list<std::shared_ptr<Control>> controls;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      closed_ = true;
      controls.swap(controls_);
      for (auto& c : controls) ::shutdown(c->fd, SHUT_RDWR);
      acks_.notify_all();
    }
    for (auto& c : controls) {
      if (c->thread.joinable()) c->thread.join();
      ::close(c->fd);
    }
    if (domain_) domain_->close();
  }

 private:
  // One initiator's control connection.
  struct Control {
    int fd = -1;
    std::string what;
    std::thread thread;
    std::mutex send_mu;
    bool lost = false;               // guarded by the transport's mu_
    std::set<uint64_t> awaiting;     // revokes it has not acknowledged, guarded by mu_
    bool send(const Msg& m) {
      std::lock_guard<std::mutex> lock(send_mu);
      try {
        send_all(fd, &m, sizeof(m), what);
        return true;
      } catch (const Error&) {
        return false;
      }
    }
  };

  void serve(const std::shared_ptr<Control>& c) {
    SocketReader reader(c->fd, c->what);
    try {
      for (;;) {
        Msg m{};
        reader.read_exact(&m, sizeof(m), true);
        if (m.magic != fabric::kMsgMagic) break;
        if (m.kind == uint32_t(MsgKind::kLookup)) {
          Msg reply{fabric::kMsgMagic, uint32_t(MsgKind::kRegion), m.tag, 0, 0, 0, uint32_t(wire::Status::kNotRegistered), 0};
          {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = served_.upper_bound(m.addr);
            if (it != served_.begin()) {
              const Registration& r = std::prev(it)->second;
              if (m.addr >= r.base && m.length <= r.length && m.addr - r.base <= r.length - m.length) {
                reply.addr = r.base;
                reply.length = r.length;
                reply.key = r.key;
                reply.status = uint32_t(wire::Status::kOk);
              }
            }
          }
          if (reply.status != uint32_t(wire::Status::kOk)) {
            auto guard = regions_.find(m.addr, m.length);
            if (guard && guard->location.kind != MemoryKind::kCpu) reply.status = uint32_t(wire::Status::kNotHostMemory);
            if (reply.status == uint32_t(wire::Status::kNotRegistered))
              ctx_.counters.frames_refused.fetch_add(1, std::memory_order_relaxed);
          }
          if (!c->send(reply)) break;
        } else if (m.kind == uint32_t(MsgKind::kRevokeAck)) {
          std::lock_guard<std::mutex> lock(mu_);
          c->awaiting.erase(m.tag);
          acks_.notify_all();
        } else {
          break;
        }
      }
    } catch (const std::exception&) {
    }
    std::lock_guard<std::mutex> lock(mu_);
    c->lost = true;
    acks_.notify_all();
  }

  EngineContext& ctx_;
  const RegionTable& regions_;
  std::unique_ptr<fabric::Domain> domain_;
  std::string reason_;
  alignas(64) uint8_t scratch_bytes_[64] = {};
  Registration scratch_{};
  std::mutex mu_;
  std::condition_variable acks_;
  std::map<uint64_t, Registration> served_;  // regions peers may look up, by base
  std::list<std::shared_ptr<Control>> controls_;
  uint64_t next_tag_ = 1;
  bool closed_ = false;
};

}  // namespace

std::unique_ptr<Transport> make_fabric_transport(TransportEnv env) { return std::make_unique<FabricTransport>(env); }

}  // namespace tidekv
