#include "fabric/fabric_domain.h"

#include <dirent.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/errors.h"
#include "common/text.h"
#include "fabric/fabric_wire.h"
#include "fabric/rdma/fi_cm.h"
#include "fabric/rdma/fi_rma.h"

namespace tidekv::fabric {
namespace {

constexpr uint64_t kCaps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
// Every mode a strict NIC may ask for: what comes back is the subset this provider needs.
constexpr uint64_t kStrictMrMode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
constexpr size_t kCompletionsPerRead = 64;
constexpr auto kSpin = std::chrono::microseconds(50);      // after activity, poll this long before sleeping
constexpr auto kExpireEvery = std::chrono::milliseconds(50);


std::string mr_mode_text(uint64_t mode) {
  std::string out;
  auto add = [&](uint64_t bit, const char* name) {
    if (mode & bit) out += std::string(out.empty() ? "" : "|") + name;
  };
  add(FI_MR_LOCAL, "LOCAL");
  add(FI_MR_VIRT_ADDR, "VIRT_ADDR");
  add(FI_MR_ALLOCATED, "ALLOCATED");
  add(FI_MR_PROV_KEY, "PROV_KEY");
  add(FI_MR_ENDPOINT, "ENDPOINT");
  add(FI_MR_RAW, "RAW");
  add(FI_MR_HMEM, "HMEM");
  return out.empty() ? "none" : out;
}

// The sysfs device of a libfabric domain name: efa's "rdmap0s6-rdm" and verbs' "mlx5_0-dgram"
// are devices rdmap0s6 and mlx5_0; tcp's domains are interfaces (eth1).
std::string sysfs_device(const std::string& domain) {
  size_t dash = domain.rfind('-');
  if (dash != std::string::npos) {
    std::string tail = domain.substr(dash + 1);
    if (tail == "rdm" || tail == "dgrm" || tail == "dgram" || tail == "xrc") return domain.substr(0, dash);
  }
  return domain;
}

std::string read_line(const std::string& path) {
  FILE* f = fopen(path.c_str(), "r");
  if (!f) return {};
  char buf[128] = {0};
  bool ok = fgets(buf, sizeof(buf), f) != nullptr;
  fclose(f);
  std::string line = ok ? buf : "";
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

// The NUMA node sysfs gives the NIC's PCI device (RDMA device, else network interface); -1 none.
int nic_numa_node(const std::string& domain) {
  const std::string device = sysfs_device(domain);
  for (const char* cls : {"/sys/class/infiniband/", "/sys/class/net/"}) {
    std::string text = read_line(cls + device + "/device/numa_node");
    if (!text.empty()) return std::atoi(text.c_str()) < 0 ? -1 : std::atoi(text.c_str());
  }
  return -1;
}

// A NIC's NUMA node as $TIDEKV_FABRIC_NIC_NUMA says ("mlx5_0=0,mlx5_1=1"), for machines whose
// sysfs does not know it (VMs report -1); -2 when it does not name the NIC.
int numa_override(const std::string& domain) {
  const char* text = std::getenv("TIDEKV_FABRIC_NIC_NUMA");
  if (!text) return -2;
  std::string all = std::string(",") + text + ",";
  std::string key = "," + domain + "=";
  size_t at = all.find(key);
  return at == std::string::npos ? -2 : std::atoi(all.c_str() + at + key.size());
}

// Whether an RDMA device has a port whose state is ACTIVE (a NIC with its link down carries nothing).
bool has_active_port(const std::string& domain) {
  const std::string ports = "/sys/class/infiniband/" + sysfs_device(domain) + "/ports";
  DIR* dir = opendir(ports.c_str());
  if (!dir) return false;
  bool active = false;
  while (dirent* e = readdir(dir))
    if (e->d_name[0] != '.' && read_line(ports + "/" + e->d_name + "/state").find("ACTIVE") != std::string::npos)
      active = true;
  closedir(dir);
  return active;
}

bool has_rdma_devices() {
  DIR* dir = opendir("/sys/class/infiniband");
  if (!dir) return false;
  bool found = false;
  while (dirent* e = readdir(dir))
    if (e->d_name[0] != '.') found = true;
  closedir(dir);
  return found;
}

}  // namespace

bool Domain::is_rdma(const std::string& provider) {
  return provider.rfind("verbs", 0) == 0 || provider.rfind("efa", 0) == 0;
}

std::vector<std::string> Domain::nics(const std::string& provider) {
  Library& lib = Library::get();
  if (!lib.available()) return {};
  fi_info* hints = lib.api().dupinfo(nullptr);
  if (!hints) return {};
  hints->caps = kCaps;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode = int(kStrictMrMode);
  hints->fabric_attr->prov_name = strdup(provider.c_str());
  fi_info* info = nullptr;
  int rc = lib.api().getinfo(kApiVersion, nullptr, nullptr, 0, hints, &info);
  lib.api().freeinfo(hints);
  std::vector<std::string> out;
  if (rc != 0) return out;
  for (fi_info* i = info; i; i = i->next) {
    std::string name = i->domain_attr && i->domain_attr->name ? i->domain_attr->name : "";
    if (name.empty() || name == "lo" || std::find(out.begin(), out.end(), name) != out.end()) continue;
    if (is_rdma(provider) && !has_active_port(name)) continue;
    out.push_back(name);
  }
  lib.api().freeinfo(info);
  std::sort(out.begin(), out.end());
  return out;
}

std::unique_ptr<Domain> Domain::open(EngineContext& ctx, const std::string& provider, const std::string& nic,
                                     const std::string& host, std::string* why) {
  if (provider.empty() && !has_rdma_devices()) {
    // Both RDMA providers need a device there; asking libfabric would only cost its start-up
    // (a few hundred milliseconds of provider probing) in every process.
    *why = "no RDMA devices (/sys/class/infiniband is empty or absent); set fabric_provider to use a software "
           "provider (e.g. \"tcp\"), slower than the tcp transport";
    return nullptr;
  }
  Library& lib = Library::get();
  if (!lib.available()) {
    *why = lib.reason();
    return nullptr;
  }
  const Api& api = lib.api();
  // Software providers (tcp, shm, udp) are slower than the tcp transport: only when named.
  std::vector<std::string> candidates = provider.empty() ? std::vector<std::string>{"verbs;ofi_rxm", "efa"}
                                                         : std::vector<std::string>{provider};
  std::string tried;
  for (const std::string& name : candidates) {
    // Writes are known to have landed by FI_DELIVERY_COMPLETE where the provider has it, else by
    // a read ordered after them (FI_ORDER_RAW).
    // $TIDEKV_FABRIC_CONFIRM_BY_READ: skip delivery-complete, so that tests run the fallback on a
    // provider that has it (tests/transfer/test_fabric.py).
    const bool skip_delivery_complete = std::getenv("TIDEKV_FABRIC_CONFIRM_BY_READ") != nullptr;
    for (bool delivery_complete : {true, false}) {
      if (delivery_complete && skip_delivery_complete) continue;
      fi_info* hints = api.dupinfo(nullptr);
      if (!hints) {
        *why = "fi_dupinfo failed (out of memory)";
        return nullptr;
      }
      hints->caps = kCaps;
      hints->mode = FI_CONTEXT | FI_CONTEXT2;
      hints->ep_attr->type = FI_EP_RDM;
      hints->domain_attr->mr_mode = int(kStrictMrMode);
      hints->domain_attr->threading = FI_THREAD_DOMAIN;
      if (delivery_complete) {
        hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
      } else {
        hints->tx_attr->msg_order = FI_ORDER_RAW;
      }
      hints->fabric_attr->prov_name = strdup(name.c_str());
      if (!nic.empty()) hints->domain_attr->name = strdup(nic.c_str());
      fi_info* info = nullptr;
      // A named NIC, else bound to the engine's own interface where the provider can be (its
      // address is what peers dial).
      int rc = (host.empty() || !nic.empty()) ? -FI_ENODATA
                                              : api.getinfo(kApiVersion, host.c_str(), nullptr, FI_SOURCE, hints, &info);
      if (rc == -FI_ENODATA) rc = api.getinfo(kApiVersion, nullptr, nullptr, 0, hints, &info);
      api.freeinfo(hints);
      if (rc == 0 && !nic.empty()) {
        // Layered providers (rxm) list every domain whatever the hint: take the NIC's own entry,
        // IPv4 where it has one (the address peers dial), as a copy of its own.
        fi_info* chosen = nullptr;
        for (fi_info* i = info; i; i = i->next)
          if (i->domain_attr && i->domain_attr->name && nic == i->domain_attr->name &&
              (!chosen || (chosen->addr_format != FI_SOCKADDR_IN && i->addr_format == FI_SOCKADDR_IN)))
            chosen = i;
        fi_info* copy = chosen ? api.dupinfo(chosen) : nullptr;
        api.freeinfo(info);
        info = copy;
        if (!info) rc = -FI_ENODATA;
      }
      if (rc != 0) {
        if (!delivery_complete) tried += std::string(tried.empty() ? "" : "; ") + name + ": " + lib.error_text("fi_getinfo", rc);
        continue;
      }
      std::unique_ptr<Domain> domain(new Domain(ctx));
      domain->delivery_complete_ = delivery_complete;
      std::string failure;
      if (domain->setup(info, &failure)) return domain;
      domain->close();
      tried += std::string(tried.empty() ? "" : "; ") + name + ": " + failure;
      break;
    }
  }
  if (!nic.empty()) {
    *why = "NIC '" + nic + "' cannot be opened with " + (provider.empty() ? std::string("verbs or efa") : provider) +
           " (" + tried + "); fi_info -p PROVIDER lists its NICs as 'domain:'";
    return nullptr;
  }
  *why = provider.empty() ? "no RDMA provider here (" + tried +
                                "); set fabric_provider to use a software one (e.g. \"tcp\"), slower than the tcp transport"
                          : "provider '" + provider + "' cannot run here: " + tried;
  return nullptr;
}

bool Domain::setup(fi_info* info, std::string* why) {
  const Library& lib = Library::get();
  info_ = info;
  provider_ = info->fabric_attr->prov_name ? info->fabric_attr->prov_name : "?";
  domain_name_ = info->domain_attr->name ? info->domain_attr->name : "?";
  numa_node_ = numa_override(domain_name_);
  if (numa_node_ == -2) numa_node_ = nic_numa_node(domain_name_);
  mr_mode_ = uint64_t(info->domain_attr->mr_mode);
  max_message_ = info->ep_attr->max_msg_size ? info->ep_attr->max_msg_size : (1ull << 30);
  if (mr_mode_ & FI_MR_RAW) {
    *why = "its keys are raw (FI_MR_RAW), which tidekv does not carry";
    return false;
  }
  int rc = lib.api().fabric(info->fabric_attr, &fabric_, nullptr);
  if (rc) return *why = lib.error_text("fi_fabric", rc), false;
  rc = fi_domain(fabric_, info, &domain_, nullptr);
  if (rc) return *why = lib.error_text("fi_domain", rc), false;
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  rc = fi_av_open(domain_, &av_attr, &av_, nullptr);
  if (rc) return *why = lib.error_text("fi_av_open", rc), false;
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_CONTEXT;
  cq_attr.wait_obj = FI_WAIT_FD;
  rc = fi_cq_open(domain_, &cq_attr, &cq_, nullptr);
  if (rc) {  // no wait object here: the progress thread polls
    cq_attr.wait_obj = FI_WAIT_NONE;
    rc = fi_cq_open(domain_, &cq_attr, &cq_, nullptr);
  } else if (fi_control(&cq_->fid, FI_GETWAIT, &wait_fd_) != 0) {
    wait_fd_ = -1;
  }
  if (rc) return *why = lib.error_text("fi_cq_open", rc), false;
  rc = fi_endpoint(domain_, info, &ep_, nullptr);
  if (rc) return *why = lib.error_text("fi_endpoint", rc), false;
  rc = fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV);
  if (rc) return *why = lib.error_text("fi_ep_bind(cq)", rc), false;
  rc = fi_ep_bind(ep_, &av_->fid, 0);
  if (rc) return *why = lib.error_text("fi_ep_bind(av)", rc), false;
  rc = fi_enable(ep_);
  if (rc) return *why = lib.error_text("fi_enable", rc), false;
  char name[kMaxNameBytes];
  size_t len = sizeof(name);
  rc = fi_getname(&ep_->fid, name, &len);
  if (rc) return *why = lib.error_text("fi_getname", rc), false;
  name_.assign(name, len);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return *why = std::string("eventfd: ") + strerror(errno), false;
  try {
    progress_thread_ = std::thread([this] { progress_loop(); });
  } catch (const std::system_error& e) {
    return *why = std::string("cannot start the progress thread: ") + e.what(), false;
  }
  return true;
}

Domain::~Domain() { close(); }

void Domain::close() {
  stop_.store(true);
  if (progress_thread_.joinable()) {
    wake();
    progress_thread_.join();
  }
  std::vector<Op*> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Keys first: no peer reaches this memory once close() returns (it may be freed next).
    for (auto& [base, r] : regions_) fi_close(&r.mr->fid);
    regions_.clear();
    if (!outstanding_.empty() || !expired_.empty()) {
      // libfabric 1.17's tcp provider crashes closing an endpoint with operations in flight to a
      // peer that stopped answering (tests/multihost: a host cut off). Such an endpoint and what
      // it hangs on are left open: nothing progresses them any more, and the keys are gone.
      ctx_.log.emit(LogLevel::kWarning,
                    "fabric: closed with " + std::to_string(outstanding_.size() + expired_.size()) +
                        " operation(s) still in flight to peers that stopped answering; their endpoint is left open");
      ep_ = nullptr;
      cq_ = nullptr;
      av_ = nullptr;
      domain_ = nullptr;
      fabric_ = nullptr;
      info_ = nullptr;
      expired_.clear();  // their contexts stay allocated with the endpoint
    }
    if (ep_) fi_close(&ep_->fid);
    ep_ = nullptr;
    if (cq_) fi_close(&cq_->fid);
    cq_ = nullptr;
    if (av_) fi_close(&av_->fid);
    av_ = nullptr;
    if (domain_) fi_close(&domain_->fid);
    domain_ = nullptr;
    if (fabric_) fi_close(&fabric_->fid);
    fabric_ = nullptr;
    if (info_) Library::get().api().freeinfo(info_);
    info_ = nullptr;
    left.assign(outstanding_.begin(), outstanding_.end());
    outstanding_.clear();
    if (wake_fd_ >= 0) ::close(wake_fd_);
    wake_fd_ = -1;
  }
  room_.notify_all();
  for (Op* op : left) {
    op->finish(FI_ECANCELED, "engine closed");
    delete op;
  }
}

std::string Domain::modes() const {
  return "mr_mode " + mr_mode_text(mr_mode_) + "; writes " +
         (delivery_complete_ ? "delivery-complete" : "confirmed by a read after them");
}

Registration Domain::register_memory(uint64_t base, uint64_t length, int numa_node) {
  std::lock_guard<std::mutex> lock(mu_);
  TIDEKV_CHECK(domain_, kClosed, "fabric: engine closed");
  uint64_t requested = (mr_mode_ & FI_MR_PROV_KEY) ? 0 : next_key_.fetch_add(1);
  fid_mr* mr = nullptr;
  int rc = fi_mr_reg(domain_, reinterpret_cast<void*>(base), length, FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE,
                     0, requested, 0, &mr, nullptr);
  if (rc)
    TIDEKV_THROW(kConfig, "fabric (" + provider_ + ") cannot register " + hex_range(base, length) + ": " +
                              Library::get().error_text("fi_mr_reg", rc) +
                              (rc == -FI_ENOMEM ? " (the locked-memory limit, ulimit -l?)" : ""));
  if (mr_mode_ & FI_MR_ENDPOINT) {
    rc = fi_mr_bind(mr, &ep_->fid, 0);
    if (!rc) rc = fi_mr_enable(mr);
    if (rc) {
      fi_close(&mr->fid);
      TIDEKV_THROW(kConfig, "fabric (" + provider_ + ") cannot enable the registration of " + hex_range(base, length) +
                                ": " + Library::get().error_text("fi_mr_bind/enable", rc));
    }
  }
  Registration r{base, length, fi_mr_key(mr), fi_mr_desc(mr), mr, numa_node};
  regions_[base] = r;
  return r;
}

void Domain::deregister(const Registration& r) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(r.base);
  if (it == regions_.end() || it->second.mr != r.mr) return;
  fi_close(&r.mr->fid);
  regions_.erase(it);
}

bool Domain::find(uint64_t addr, uint64_t length, Registration* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.upper_bound(addr);
  if (it == regions_.begin()) return false;
  --it;
  const Registration& r = it->second;
  if (addr < r.base || length > r.length || addr - r.base > r.length - length) return false;
  *out = r;
  return true;
}

fi_addr_t Domain::insert_peer(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  TIDEKV_CHECK(av_, kClosed, "fabric: engine closed");
  fi_addr_t addr = FI_ADDR_UNSPEC;
  int rc = fi_av_insert(av_, name.data(), 1, &addr, 0, nullptr);
  if (rc != 1) TIDEKV_THROW(kPeerUnavailable, "fabric: the peer's endpoint address is not usable here: " +
                                                   Library::get().error_text("fi_av_insert", rc < 0 ? rc : -FI_EINVAL));
  return addr;
}

void Domain::remove_peer(fi_addr_t addr) {
  std::lock_guard<std::mutex> lock(mu_);
  // Not while operations to it are in flight: the provider would free what they hang on.
  for (const auto* ops : {&outstanding_, &expired_})
    for (const Op* op : *ops)
      if (op->peer == addr) return;
  if (av_) fi_av_remove(av_, &addr, 1, 0);
}

void Domain::post(bool is_read, Op* op, uint64_t local, uint64_t length, void* desc, fi_addr_t peer, uint64_t remote,
                  uint64_t key, const std::function<void()>& check_peer) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(io_timeout_ms_);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    TIDEKV_CHECK(ep_, kClosed, "engine closed");
    op->posted = std::chrono::steady_clock::now();
    op->peer = peer;
    ssize_t rc;
    if (is_read) {
      rc = fi_read(ep_, reinterpret_cast<void*>(local), length, desc, peer, remote, key, &op->context);
    } else if (delivery_complete_) {
      iovec iov{reinterpret_cast<void*>(local), length};
      fi_rma_iov rma{remote, length, key};
      fi_msg_rma msg{};
      msg.msg_iov = &iov;
      msg.desc = &desc;
      msg.iov_count = 1;
      msg.addr = peer;
      msg.rma_iov = &rma;
      msg.rma_iov_count = 1;
      msg.context = &op->context;
      rc = fi_writemsg(ep_, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE);
    } else {
      rc = fi_write(ep_, reinterpret_cast<void*>(local), length, desc, peer, remote, key, &op->context);
    }
    if (rc == 0) {
      outstanding_.insert(op);
      break;
    }
    if (rc != -FI_EAGAIN)
      TIDEKV_THROW(kTransfer, "fabric: " + Library::get().error_text(is_read ? "fi_read" : "fi_write", rc) +
                                  " on " + provider_ + " domain " + domain_name_ +
                                  (rc == -FI_EINVAL ? " (does this domain reach the peer? the endpoint binds to the "
                                                      "engine's host: set TIDEKV_HOST to this host's address on the "
                                                      "network the peer is on)"
                                                    : ""));
    // The queue is full, or the provider is still connecting to the peer: progress it from here.
    // A peer that is gone leaves the provider connecting for ever (rxm 1.17 retries on each post
    // and reports no error): the caller's check ends the wait then (it throws).
    lock.unlock();
    if (check_peer) check_peer();
    if (progress() == 0) {
      if (std::chrono::steady_clock::now() > deadline)
        TIDEKV_THROW(kTimeout, "fabric: the provider took no new operation for io_timeout_ms");
      std::this_thread::yield();
    }
    lock.lock();
  }
  lock.unlock();
  if (sleeping_.load(std::memory_order_acquire)) wake();
}

void Domain::wake() {
  uint64_t one = 1;
  if (wake_fd_ >= 0 && ::write(wake_fd_, &one, sizeof(one)) < 0) {
    // full counter or closed: the thread is awake already or going away
  }
}

size_t Domain::progress() {
  struct Done {
    Op* op;
    int err;
    std::string message;
  };
  std::vector<Done> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!cq_) return 0;
    fi_cq_entry entries[kCompletionsPerRead];
    ssize_t n = fi_cq_read(cq_, entries, kCompletionsPerRead);
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        Op* op = static_cast<Op::Context*>(entries[i].op_context)->op;
        if (outstanding_.erase(op)) {
          done.push_back({op, 0, {}});
        } else if (expired_.erase(op)) {
          delete op;  // failed by its timeout already
        }
      }
    } else if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      if (fi_cq_readerr(cq_, &err, 0) > 0) {
        Op* op = err.op_context ? static_cast<Op::Context*>(err.op_context)->op : nullptr;
        char buf[256] = {0};
        const char* words = fi_cq_strerror(cq_, err.prov_errno, err.err_data, buf, sizeof(buf));
        std::string message = Library::get().api().strerror(err.err);
        if (words && *words && message != words) message += std::string(" (") + words + ")";
        if (outstanding_.erase(op)) {
          done.push_back({op, err.err ? err.err : FI_EIO, message});
        } else if (expired_.erase(op)) {
          delete op;
        }
        n = 1;
      }
    }
    if (n <= 0) return 0;
  }
  room_.notify_all();
  for (Done& d : done) {
    d.op->finish(d.err, d.message);
    delete d.op;
  }
  return done.empty() ? 1 : done.size();
}

void Domain::expire(std::chrono::steady_clock::time_point now) {
  std::vector<Op*> late;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto limit = std::chrono::milliseconds(io_timeout_ms_);
    for (auto it = outstanding_.begin(); it != outstanding_.end();) {
      if (now - (*it)->posted > limit) {
        late.push_back(*it);
        expired_.insert(*it);
        it = outstanding_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (Op* op : late)
    op->finish(FI_ETIMEDOUT, "no completion in io_timeout_ms (" + std::to_string(io_timeout_ms_) + " ms)");
}

void Domain::progress_loop() {
  auto last_activity = std::chrono::steady_clock::now();
  auto last_expire = last_activity;
  while (!stop_.load(std::memory_order_acquire)) {
    size_t n = progress();
    auto now = std::chrono::steady_clock::now();
    if (now - last_expire > kExpireEvery) {
      expire(now);
      last_expire = now;
    }
    if (n) {
      last_activity = now;
      continue;
    }
    if (now - last_activity < kSpin) continue;
    bool busy;
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy = !outstanding_.empty();
    }
    // Sleep until the provider has something (its wait fd), a post wakes us, or a bound passes:
    // with manual progress our own posted work also needs us, so the bound is short while busy.
    bool can_sleep = true;
    if (wait_fd_ >= 0) {
      std::lock_guard<std::mutex> lock(mu_);
      fid* fids[1] = {&cq_->fid};
      can_sleep = fi_trywait(fabric_, fids, 1) == FI_SUCCESS;
    }
    if (!can_sleep) continue;
    sleeping_.store(true, std::memory_order_release);
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {wait_fd_, POLLIN, 0}};
    timespec timeout{0, (busy ? (wait_fd_ >= 0 ? 1000000 : 20000) : (wait_fd_ >= 0 ? 100000000 : 1000000))};
    ppoll(fds, wait_fd_ >= 0 ? 2 : 1, &timeout, nullptr);
    sleeping_.store(false, std::memory_order_release);
    uint64_t drained;
    if (fds[0].revents & POLLIN) (void)!::read(wake_fd_, &drained, sizeof(drained));
    last_activity = std::chrono::steady_clock::now();
  }
}

}  // namespace tidekv::fabric
