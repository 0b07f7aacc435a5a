// The fabric transport's engine-wide half: its rails (one domain per NIC, fabric_domain.h), every
// region of host memory registered with each, the section peers reach the endpoints by, and the
// serving side of the control connections: region lookups answered with the region's key on
// every rail, and revokes sent to every initiator before a region's registrations go, so no key
// outlives its memory.
#include "fabric/fabric_transport.h"

#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

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

using fabric::Domain;
using fabric::Msg;
using fabric::MsgKind;
using fabric::Registration;

std::vector<std::string> split_names(const std::string& text) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= text.size()) {
    size_t comma = std::min(text.find(',', at), text.size());
    std::string name = text.substr(at, comma - at);
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (!name.empty()) out.push_back(name);
    at = comma + 1;
  }
  return out;
}

// The NUMA node of the page holding `addr`, without touching it (move_pages only asks); -1 when
// the page is not placed yet or the kernel cannot say.
int memory_numa_node(uint64_t addr) {
  void* page = reinterpret_cast<void*>(addr & ~uint64_t(4095));
  int status = -1;
  if (syscall(SYS_move_pages, 0, 1, &page, nullptr, &status, 0) != 0 || status < 0) return -1;
  return status;
}

class FabricTransport final : public Transport {
 public:
  explicit FabricTransport(TransportEnv env) : ctx_(env.ctx), regions_(env.regions) {
    std::string why;
    if (!open_rails(&why)) {
      for (auto& rail : rails_) rail.domain->close();
      rails_.clear();
      reason_ = why;
      return;
    }
    const Domain& first = *rails_.front().domain;
    reason_ = "provider " + first.provider() + " on ";
    for (size_t k = 0; k < rails_.size(); ++k) {
      const Domain& d = *rails_[k].domain;
      reason_ += (k ? ", " : "") + d.domain_name() + (d.numa_node() >= 0 ? " (NUMA " + std::to_string(d.numa_node()) + ")" : "");
    }
    reason_ += " (" + first.modes() + ")";
  }
  ~FabricTransport() override { close(); }

  TransportId id() const override { return TransportId::kFabric; }
  const char* name() const override { return "fabric"; }
  Availability availability() const override { return {!rails_.empty(), reason_}; }

  std::string describe() override {
    if (rails_.empty()) return {};
    fabric::Section s{};
    s.magic = fabric::kSectionMagic;
    s.rails = uint32_t(rails_.size());
    s.mr_mode = rails_.front().domain->mr_mode();
    std::strncpy(s.provider, rails_.front().domain->provider().c_str(), sizeof(s.provider) - 1);
    std::string out(reinterpret_cast<const char*>(&s), sizeof(s));
    for (const auto& rail : rails_) {
      fabric::Rail r{};
      const std::string& name = rail.domain->endpoint_name();
      r.name_bytes = uint32_t(std::min(name.size(), sizeof(r.name)));
      std::memcpy(r.name, name.data(), r.name_bytes);
      r.numa_node = rail.domain->numa_node();
      out.append(reinterpret_cast<const char*>(&r), sizeof(r));
    }
    return out;
  }

  void on_register(const RegionView& region) override {
    if (rails_.empty() || region.location.kind != MemoryKind::kCpu) return;
    const int node = memory_numa_node(region.addr);
    std::vector<Registration> regs;
    try {
      for (auto& rail : rails_) regs.push_back(rail.domain->register_memory(region.addr, region.length, node));
    } catch (...) {
      for (size_t k = 0; k < regs.size(); ++k) rails_[k].domain->deregister(regs[k]);
      throw;
    }
    std::lock_guard<std::mutex> lock(mu_);
    served_[region.addr] = std::move(regs);
  }

  void on_unregister(const RegionView& region) override {
    if (rails_.empty()) return;
    std::vector<Registration> regs;
    std::vector<std::shared_ptr<Control>> peers;
    uint64_t tag;
    {
      // First no lookup finds it, then every initiator forgets it, then the keys die.
      std::lock_guard<std::mutex> lock(mu_);
      auto it = served_.find(region.addr);
      if (it == served_.end()) return;
      regs = std::move(it->second);
      served_.erase(it);
      tag = next_tag_++;
      for (auto& c : controls_)
        if (!c->lost) {
          c->awaiting.insert(tag);
          peers.push_back(c);
        }
    }
    const Registration& r = regs.front();
    Msg revoke{fabric::kMsgMagic, uint32_t(MsgKind::kRevoke), tag, r.base, r.length, 0, 1, {r.key}};
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
    for (size_t k = 0; k < regs.size(); ++k) rails_[k].domain->deregister(regs[k]);
  }

  std::shared_ptr<PeerLink> connect(const PeerAddress& peer, const std::string* section) override {
    if (rails_.empty() || !section || section->size() < sizeof(fabric::Section)) return nullptr;
    fabric::Section s;
    std::memcpy(&s, section->data(), sizeof(s));
    if (s.magic != fabric::kSectionMagic || s.rails == 0 || s.rails > fabric::kMaxRails ||
        section->size() != sizeof(s) + s.rails * sizeof(fabric::Rail))
      return nullptr;
    const Domain& ours = *rails_.front().domain;
    std::string provider(s.provider, strnlen(s.provider, sizeof(s.provider)));
    if (provider != ours.provider()) {
      ctx_.log.emit_once("fabric-provider:" + peer.name, LogLevel::kWarning,
                         "fabric: peer " + peer.name + " runs provider " + provider + ", this engine " +
                             ours.provider() + ": fabric cannot reach it (set the same fabric_provider on both)");
      return nullptr;
    }
    // Rail k reaches the peer's rail k (NICs named in the same order on every host).
    std::vector<fabric::FabricLink::Rail> rails;
    for (uint32_t k = 0; k < std::min<uint32_t>(s.rails, uint32_t(rails_.size())); ++k) {
      fabric::Rail r;
      std::memcpy(&r, section->data() + sizeof(s) + k * sizeof(r), sizeof(r));
      if (r.name_bytes > sizeof(r.name)) return nullptr;
      rails.push_back({rails_[k].domain.get(), rails_[k].scratch,
                       std::string(reinterpret_cast<const char*>(r.name), r.name_bytes)});
    }
    if (s.rails != rails_.size())
      ctx_.log.emit_once("fabric-rails:" + peer.name, LogLevel::kWarning,
                         "fabric: peer " + peer.name + " has " + std::to_string(s.rails) + " NIC(s), this engine " +
                             std::to_string(rails_.size()) + ": " + std::to_string(rails.size()) +
                             " are used (rail k to rail k; set fabric_nics alike on every host)");
    return std::make_shared<fabric::FabricLink>(ctx_, std::move(rails), peer);
  }

  bool accepts_connections() const override { return !rails_.empty(); }

  void adopt(Connection conn) override {
    auto c = std::make_shared<Control>();
    c->fd = conn.fd;
    c->what = conn.what;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_ || rails_.empty()) {
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
    for (auto& rail : rails_) rail.domain->close();
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
          Msg reply{fabric::kMsgMagic, uint32_t(MsgKind::kRegion), m.tag, 0, 0, uint32_t(wire::Status::kNotRegistered), 0, {}};
          {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = served_.upper_bound(m.addr);
            if (it != served_.begin()) {
              const std::vector<Registration>& regs = std::prev(it)->second;
              const Registration& r = regs.front();
              if (m.addr >= r.base && m.length <= r.length && m.addr - r.base <= r.length - m.length) {
                reply.addr = r.base;
                reply.length = r.length;
                reply.rails = uint32_t(regs.size());
                for (size_t k = 0; k < regs.size(); ++k) reply.keys[k] = regs[k].key;
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

  // Opens the NICs fabric_nics names (or finds them): false with *why when fabric cannot run.
  bool open_rails(std::string* why) {
    const FabricOptions& o = ctx_.options.fabric;
    std::vector<std::string> named = split_names(o.nics);
    const bool all = named.size() == 1 && named.front() == "all";
    // The first rail settles the provider (the default tries verbs, then efa).
    std::string first_nic = (named.empty() || all) ? std::string() : named.front();
    std::unique_ptr<Domain> first = Domain::open(ctx_, o.provider, first_nic, ctx_.options.host, why);
    if (!first) return false;
    const std::string provider = first->provider();
    std::vector<std::string> names;
    // NICs found rather than named: one that cannot be opened is left out (logged), not fatal.
    const bool found = all || (named.empty() && Domain::is_rdma(provider));
    if (found) {
      names = Domain::nics(provider);  // sorted, loopback and NICs whose ports are down left out
      if (names.empty()) names.push_back(first->domain_name());
    } else {
      names = named.empty() ? std::vector<std::string>{first->domain_name()} : named;
    }
    if (names.size() > fabric::kMaxRails) {
      ctx_.log.emit(LogLevel::kWarning, "fabric: " + std::to_string(names.size()) + " NICs found; the first " +
                                            std::to_string(fabric::kMaxRails) + " are used");
      names.resize(fabric::kMaxRails);
    }
    rails_.reserve(fabric::kMaxRails);  // never moved: each rail's scratch bytes are registered where they are
    auto add = [&](std::unique_ptr<Domain> d) {
      Rail& r = rails_.emplace_back();
      r.domain = std::move(d);
      try {
        r.scratch = r.domain->register_memory(reinterpret_cast<uint64_t>(r.scratch_bytes), sizeof(r.scratch_bytes));
      } catch (const Error& e) {
        *why = e.what();
        return false;
      }
      return true;
    };
    for (const std::string& name : names) {
      std::unique_ptr<Domain> d;
      if (first && (name == first->domain_name() || name == first_nic)) {
        d = std::move(first);
      } else {
        d = Domain::open(ctx_, provider, name, ctx_.options.host, why);
        if (!d) {
          if (!found) return false;
          ctx_.log.emit(LogLevel::kWarning, "fabric: NIC " + name + " left out: " + *why);
          continue;
        }
      }
      if (!rails_.empty() && (d->mr_mode() != rails_.front().domain->mr_mode() ||
                              d->has_delivery_complete() != rails_.front().domain->has_delivery_complete())) {
        *why = "NIC " + d->domain_name() + " registers memory or completes writes differently from " +
               rails_.front().domain->domain_name() + " (" + d->modes() + " vs " + rails_.front().domain->modes() +
               "): name NICs of one kind in fabric_nics";
        d->close();
        if (!found) return false;
        ctx_.log.emit(LogLevel::kWarning, "fabric: " + *why);
        continue;
      }
      if (!add(std::move(d))) return false;
    }
    if (first && rails_.empty()) return add(std::move(first));  // none found opened: the host address's NIC
    if (first) first->close();  // it was not among the NICs named
    return true;
  }

  // One NIC: its domain, and a few registered bytes a read confirming writes lands in.
  struct Rail {
    std::unique_ptr<Domain> domain;
    alignas(64) uint8_t scratch_bytes[64] = {};
    Registration scratch{};
  };

  EngineContext& ctx_;
  const RegionTable& regions_;
  std::vector<Rail> rails_;  // never resized once open_rails returned (links hold its domains)
  std::string reason_;
  std::mutex mu_;
  std::condition_variable acks_;
  std::map<uint64_t, std::vector<Registration>> served_;  // regions peers may look up, by base: one per rail
  std::list<std::shared_ptr<Control>> controls_;
  uint64_t next_tag_ = 1;
  bool closed_ = false;
};

}  // namespace

std::unique_ptr<Transport> make_fabric_transport(TransportEnv env) { return std::make_unique<FabricTransport>(env); }

}  // namespace tidekv
