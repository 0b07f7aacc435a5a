// The exported functions of libtransfer_engine.so (declared in transfer_engine_c.h). Each one
// checks its arguments, calls the CEngine through the boundary (boundary.h) and translates the
// result into Mooncake's types; nothing else happens here.
#include "transfer_engine_c.h"

#include "transport/registry.h"

#include <cstdlib>
#include <cstring>

#include "boundary.h"
#include "c_engine.h"
#include "options.h"

using tidekv::capi::CEngine;
using tidekv::capi::guarded;
using tidekv::capi::guarded_code;
using tidekv::capi::refuse;

namespace {

CEngine& engine_of(transfer_engine_t engine) {
  auto* e = static_cast<CEngine*>(engine);
  if (e == nullptr) refuse(TE_ERR_INVALID_ARGUMENT, "engine is NULL (createTransferEngine failed?)");
  if (e->magic != tidekv::capi::kEngineMagic) refuse(TE_ERR_INVALID_ARGUMENT, "engine handle is not a live engine");
  return *e;
}

std::string text(const char* s, const char* what) {
  if (s == nullptr) refuse(TE_ERR_INVALID_ARGUMENT, std::string(what) + " is NULL");
  return s;
}

// The calls this library cannot serve: an error code, and the reason in the last error.
int unsupported(const char* function, const std::string& why) {
  return guarded_code(function, [&]() -> int { refuse(TE_ERR_NOT_IMPLEMENTED, why); });
}

std::vector<tidekv::capi::RequestSpec> specs_of(const transfer_request* entries, size_t count) {
  if (entries == nullptr && count > 0) refuse(TE_ERR_INVALID_ARGUMENT, "entries is NULL");
  std::vector<tidekv::capi::RequestSpec> out(count);
  for (size_t i = 0; i < count; ++i) {
    const transfer_request& r = entries[i];
    out[i] = {r.opcode, reinterpret_cast<uint64_t>(r.source), r.target_id, r.target_offset, r.length};
  }
  return out;
}

}  // namespace

#pragma GCC visibility push(default)
extern "C" {

transfer_engine_t createTransferEngine(const char* metadata_conn_string, const char* local_server_name,
                                       const char* ip_or_host_name, uint64_t rpc_port, int auto_discover) {
  return guarded(
      "createTransferEngine",
      [&]() -> transfer_engine_t {
        std::string metadata = text(metadata_conn_string, "metadata_conn_string");
        std::string server = local_server_name ? local_server_name : "";
        std::string host = ip_or_host_name && *ip_or_host_name ? ip_or_host_name : server;
        int port = int(rpc_port);
        if (rpc_port > 65535) refuse(TE_ERR_INVALID_ARGUMENT, "rpc_port " + std::to_string(rpc_port) + " > 65535");
        // local_server_name may be "host:port" (Mooncake accepts both); a port there counts
        // when rpc_port is 0.
        size_t colon = host.rfind(':');
        if (colon != std::string::npos && host.find(':') == colon) {
          if (port == 0) port = std::atoi(host.c_str() + colon + 1);
          host = host.substr(0, colon);
        }
        return new CEngine(metadata, tidekv::capi::listen_host(host), port);
      },
      [](int) -> transfer_engine_t { return nullptr; });
}

void destroyTransferEngine(transfer_engine_t engine) {
  guarded_code("destroyTransferEngine", [&] {
    delete &engine_of(engine);
    return 0;
  });
}

int discoverTopology(transfer_engine_t engine) {
  return guarded_code("discoverTopology", [&] {
    engine_of(engine);  // tidekv finds what each transport can reach when it starts: nothing to do
    return 0;
  });
}

int getLocalIpAndPort(transfer_engine_t engine, char* buf_out, size_t buf_len) {
  return guarded_code("getLocalIpAndPort", [&] {
    std::string name = engine_of(engine).local_name();
    if (buf_out == nullptr || buf_len < name.size() + 1)
      refuse(TE_ERR_INVALID_ARGUMENT, "buffer of " + std::to_string(buf_len) + " bytes cannot hold '" + name + "'");
    std::memcpy(buf_out, name.c_str(), name.size() + 1);
    return 0;
  });
}

transport_t installTransport(transfer_engine_t engine, const char* proto, void** args) {
  return guarded(
      "installTransport",
      [&]() -> transport_t {
        std::string name = text(proto, "proto");
        // Mooncake's RDMA protocols are tidekv's fabric transport (libfabric: verbs, efa).
        if (name == "rdma" || name == "efa") name = "fabric";
        // Mooncake reads its NIC priority matrix from args[0]; tidekv's engine opened its NICs
        // when it was created, from TIDEKV_FABRIC_NICS: say so rather than drop the matrix silently.
        if (args != nullptr && args[0] != nullptr)
          tidekv::capi::log(tidekv::LogLevel::kWarning,
                            "installTransport(" + std::string(proto) +
                                "): args (Mooncake's NIC priority matrix) are not read; fabric's NICs come from "
                                "TIDEKV_FABRIC_NICS, set before createTransferEngine (`tidekv doctor` lists them)");
        // tidekv's transports are all installed at start; the one asked for is "installed" when
        // it is available here. The handle is only a token (the registry's own name): no function takes it.
        std::string known;
        for (const auto& entry : tidekv::transport_registry()) {
          known += std::string(known.empty() ? "" : ", ") + entry.name;
          if (name != entry.name) continue;
          for (const auto& t : engine_of(engine).transports())
            if (t.name == name && !t.available)
              refuse(TE_ERR_DEVICE_NOT_FOUND, "transport '" + name + "' is not available here: " + t.reason);
          return const_cast<char*>(entry.name);
        }
        refuse(TE_ERR_NOT_IMPLEMENTED, "transport '" + std::string(proto) + "' does not exist in tidekv (it has " +
                                           known + ", chosen per request; rdma and efa are fabric)");
      },
      [](int) -> transport_t { return nullptr; });
}

int uninstallTransport(transfer_engine_t engine, const char* proto) {
  return unsupported("uninstallTransport", "tidekv's transports cannot be uninstalled (the engine picks one per request)");
}

segment_id_t openSegment(transfer_engine_t engine, const char* segment_name) {
  return guarded_code("openSegment", [&] { return engine_of(engine).open_segment(text(segment_name, "segment_name"), false); });
}

segment_id_t openSegmentNoCache(transfer_engine_t engine, const char* segment_name) {
  return guarded_code("openSegmentNoCache",
                      [&] { return engine_of(engine).open_segment(text(segment_name, "segment_name"), true); });
}

int closeSegment(transfer_engine_t engine, segment_id_t segment_id) {
  return guarded_code("closeSegment", [&] {
    engine_of(engine).close_segment(segment_id);
    return 0;
  });
}

int warmupEfaSegment(transfer_engine_t engine, const char* segment_name) {
  return guarded_code("warmupEfaSegment", [&] {
    engine_of(engine);  // no EFA transport: nothing to warm up (Mooncake returns 0 there too)
    return 0;
  });
}

int removeLocalSegment(transfer_engine_t engine, const char* segment_name) {
  return unsupported("removeLocalSegment", "there is no metadata service to remove a segment from (P2P handshake "
                                           "only); destroyTransferEngine() ends the segment");
}

int registerLocalMemory(transfer_engine_t engine, void* addr, size_t length, const char* location,
                        int remote_accessible) {
  return guarded_code("registerLocalMemory", [&] {
    engine_of(engine).register_memory(reinterpret_cast<uint64_t>(addr), length, location ? location : "*");
    return 0;
  });
}

int unregisterLocalMemory(transfer_engine_t engine, void* addr) {
  return guarded_code("unregisterLocalMemory", [&] {
    engine_of(engine).unregister_memory(reinterpret_cast<uint64_t>(addr));
    return 0;
  });
}

int registerLocalMemoryBatch(transfer_engine_t engine, buffer_entry_t* buffer_list, size_t buffer_len,
                             const char* location) {
  return guarded_code("registerLocalMemoryBatch", [&] {
    CEngine& e = engine_of(engine);
    if (buffer_list == nullptr && buffer_len > 0) refuse(TE_ERR_INVALID_ARGUMENT, "buffer_list is NULL");
    size_t done = 0;
    try {
      for (; done < buffer_len; ++done)
        e.register_memory(reinterpret_cast<uint64_t>(buffer_list[done].addr), buffer_list[done].length,
                          location ? location : "*");
    } catch (...) {
      for (size_t i = 0; i < done; ++i) e.unregister_memory(reinterpret_cast<uint64_t>(buffer_list[i].addr));
      throw;  // all or nothing
    }
    return 0;
  });
}

int unregisterLocalMemoryBatch(transfer_engine_t engine, void** addr_list, size_t addr_len) {
  return guarded_code("unregisterLocalMemoryBatch", [&] {
    CEngine& e = engine_of(engine);
    if (addr_list == nullptr && addr_len > 0) refuse(TE_ERR_INVALID_ARGUMENT, "addr_list is NULL");
    std::string failed;
    for (size_t i = 0; i < addr_len; ++i) {
      try {
        e.unregister_memory(reinterpret_cast<uint64_t>(addr_list[i]));
      } catch (const std::exception& ex) {
        failed += (failed.empty() ? "" : "; ") + std::string(ex.what());
      }
    }
    if (!failed.empty()) refuse(TE_ERR_ADDRESS_NOT_REGISTERED, failed);
    return 0;
  });
}

batch_id_t allocateBatchID(transfer_engine_t engine, size_t batch_size) {
  return guarded(
      "allocateBatchID", [&] { return engine_of(engine).allocate_batch(batch_size); },
      [](int) -> batch_id_t { return INVALID_BATCH; });
}

int submitTransfer(transfer_engine_t engine, batch_id_t batch_id, struct transfer_request* entries, size_t count) {
  return guarded_code("submitTransfer", [&] {
    engine_of(engine).submit(batch_id, specs_of(entries, count), nullptr);
    return 0;
  });
}

int submitTransferWithNotify(transfer_engine_t engine, batch_id_t batch_id, struct transfer_request* entries,
                             size_t count, notify_msg_t notify_msg) {
  return guarded_code("submitTransferWithNotify", [&] {
    tidekv::capi::Notification n{text(notify_msg.name, "notify_msg.name"), text(notify_msg.msg, "notify_msg.msg")};
    engine_of(engine).submit(batch_id, specs_of(entries, count), &n);
    return 0;
  });
}

int getTransferStatus(transfer_engine_t engine, batch_id_t batch_id, size_t task_id, struct transfer_status* status) {
  return guarded_code("getTransferStatus", [&] {
    if (status == nullptr) refuse(TE_ERR_INVALID_ARGUMENT, "status is NULL");
    auto s = engine_of(engine).status(batch_id, task_id);
    status->status = s.status;
    status->transferred_bytes = s.transferred_bytes;
    return 0;
  });
}

int freeBatchID(transfer_engine_t engine, batch_id_t batch_id) {
  return guarded_code("freeBatchID", [&] {
    engine_of(engine).free_batch(batch_id);
    return 0;
  });
}

notify_msg_t* getNotifsFromEngine(transfer_engine_t engine, int* size) {
  return guarded(
      "getNotifsFromEngine",
      [&]() -> notify_msg_t* {
        if (size == nullptr) refuse(TE_ERR_INVALID_ARGUMENT, "size is NULL");
        *size = 0;
        auto notes = engine_of(engine).take_notifications();
        if (notes.empty()) return nullptr;
        // One malloc'd block: the array, then every name and message. freeNotifsMsgBuf() and a
        // plain free() of the array (what the oldest TensorRT-LLM agent does) both release it all.
        size_t bytes = notes.size() * sizeof(notify_msg_t);
        for (const auto& n : notes) bytes += n.name.size() + n.message.size() + 2;
        auto* out = static_cast<notify_msg_t*>(std::malloc(bytes));
        if (out == nullptr) throw std::bad_alloc();
        char* p = reinterpret_cast<char*>(out + notes.size());
        for (size_t i = 0; i < notes.size(); ++i) {
          out[i].name = p;
          std::memcpy(p, notes[i].name.c_str(), notes[i].name.size() + 1);
          p += notes[i].name.size() + 1;
          out[i].msg = p;
          std::memcpy(p, notes[i].message.c_str(), notes[i].message.size() + 1);
          p += notes[i].message.size() + 1;
        }
        *size = int(notes.size());
        return out;
      },
      [](int) -> notify_msg_t* { return nullptr; });
}

int freeNotifsMsgBuf(notify_msg_t* msg, int size) {
  std::free(msg);  // the strings live in the same block (see getNotifsFromEngine)
  return 0;
}

int genNotifyInEngine(transfer_engine_t engine, uint64_t target_id, notify_msg_t notify_msg) {
  return guarded_code("genNotifyInEngine", [&] {
    if (target_id > uint64_t(INT32_MAX)) refuse(TE_ERR_INVALID_ARGUMENT, "target_id " + std::to_string(target_id) + " is not a segment id");
    engine_of(engine).send_notification(int32_t(target_id), text(notify_msg.name, "notify_msg.name"),
                                        text(notify_msg.msg, "notify_msg.msg"));
    return 0;
  });
}

int syncSegmentCache(transfer_engine_t engine) {
  return guarded_code("syncSegmentCache", [&] {
    // Nothing is cached to go stale: a peer checks every remote range itself, and the engine
    // notices a restarted peer at its next request (new descriptor) and reconnects.
    engine_of(engine);
    return 0;
  });
}

int getNicLoadStats(transfer_engine_t engine, nic_load_stat_t* stats, size_t* count) {
  return unsupported("getNicLoadStats", "tidekv has no RDMA NICs to report on (its fabric transport is not built yet)");
}

void enableGracefulShutdown(transfer_engine_t engine) {
  guarded_code("enableGracefulShutdown", [&]() -> int {
    engine_of(engine);
    refuse(TE_ERR_NOT_IMPLEMENTED, "not served: tidekv installs no signal handlers; call destroyTransferEngine() on "
                                   "shutdown (in-flight requests then fail at once)");
  });
}

int showLinks(transfer_engine_t engine, char* buf_out, size_t buf_len, int json) {
  return unsupported("showLinks", "tidekv has no NIC topology to show; `tidekv doctor` lists its transports");
}

const char* tidekv_last_error(void) { return tidekv::capi::last_error(); }

}  // extern "C"
#pragma GCC visibility pop
