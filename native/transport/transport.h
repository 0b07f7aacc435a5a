// The one interface every transport implements (tcp, shm, cuda; fabric next). It depends on
// the shared pieces (common/, batch/, regions/) and on nothing of the engine's.
//
// Two objects per transport:
// - Transport: one per engine. It reports whether it can run on this host, contributes its
//   section to the engine's descriptor, sees every region registered here, serves the data
//   connections whose greeting names it (if it uses connections), and opens links to peers.
// - PeerLink: one per (peer, transport). It rates each request it is offered and plans the
//   ones the engine gives it onto the batch.
//
// Call order and threads: the engine creates every Transport at start-up, then calls
// describe() once. on_register/on_unregister run on the registering thread, under the engine's
// region lock. connect() and adopt() may run on any thread, concurrently. A PeerLink's
// preference() and plan() run on the submitting thread while the engine holds that peer's
// lock; the tasks plan() adds run on the engine's workers or on a thread waiting on the batch.
// close() is called once, before destruction; afterwards every task must fail fast.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "batch/batch.h"
#include "common/context.h"
#include "common/descriptor.h"
#include "common/memory.h"
#include "regions/region_table.h"

namespace tidekv {

// Wire ids: in descriptor sections and in the greeting of a data connection. Never reuse one.
enum class TransportId : uint16_t { kTcp = 1, kShm = 2, kCuda = 3, kFabric = 4 };

// A piece of one request, as a transport moves it: [local, local + length) <-> [remote, ...).
struct Slice {
  uint32_t request;  // index into the batch's requests
  wire::Op op;
  uint64_t local;
  uint64_t remote;
  uint64_t length;
};

struct Availability {
  bool available = true;
  std::string reason;  // why not (or, when available, what it runs on)
};

// How a link reaches its peer. on_descriptor: called by a link that learns the peer's current
// descriptor on its own (tcp sees it in every data handshake), so the engine notices a restart.
struct PeerAddress {
  std::string name;  // "host:port", as requests name it
  std::string host;
  int port = 0;
  std::function<void(const Descriptor&)> on_descriptor;
};

// What the listener hands a transport with a data connection it accepted and authenticated.
struct Connection {
  int fd = -1;            // owned by the transport from adopt() on
  std::string what;       // the remote address, for logs and errors
  uint8_t instance[16];   // the client engine's instance id (see wire::Hello)
};

class PeerLink {
 public:
  virtual ~PeerLink() = default;
  // How well this link serves request r whose local memory is at `local`: 0 = it cannot; among
  // the links of a peer the highest wins. Must be cheap: it runs for every request.
  virtual int preference(const Request& r, MemoryLocation local) const = 0;
  // The preference() it gives a host-to-host request (0: none): how connect() ranks a peer's
  // transports, since that is what it reports.
  virtual int host_preference() const = 0;
  // Why preference() is 0 for r, for the error when a forced transport cannot serve it.
  virtual std::string refusal(const Request& r, MemoryLocation local) const = 0;
  // Plans requests (indices into batch->requests()) chosen for this link: expect_slices() for
  // each and add_task()s that report every slice exactly once.
  virtual void plan(const std::shared_ptr<Batch>& batch, const std::vector<uint32_t>& requests) = 0;
  // False once the link can no longer trust what it knows of the peer (a same-host process
  // that exited): the engine then fetches the peer's descriptor again and reconnects.
  virtual bool is_current() const { return true; }
  // True when its tasks are plain memory copies on the running thread that never wait on the
  // peer: a small batch of them is run before submit() returns.
  virtual bool is_local_copy() const { return false; }
  // Fails queued and future work; idempotent. Tasks already running finish or fail on their own.
  virtual void close() = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportId id() const = 0;
  virtual const char* name() const = 0;
  // Whether it can run here, and why not. An unavailable transport is still listed (doctor).
  virtual Availability availability() const = 0;
  // Whether it moves memory of this kind at all (registration of a kind no available
  // transport handles is refused).
  virtual bool handles(MemoryKind kind) const { return kind == MemoryKind::kCpu; }
  // This engine's section of its descriptor (empty: the transport needs nothing published).
  virtual std::string describe() { return {}; }
  // A region is registered on (or leaves) this engine. Throws kConfig to refuse a location
  // it cannot stand for; whatever peers need per region goes to the region table or the section.
  virtual void on_register(const RegionView& region) {}
  virtual void on_unregister(const RegionView& region) {}
  // A link to `peer` from its descriptor section (nullptr: the peer sent none), or nullptr when
  // this transport cannot reach that peer. May block (it may open connections); never under a
  // lock the data path takes.
  virtual std::shared_ptr<PeerLink> connect(const PeerAddress& peer, const std::string* section) = 0;
  // True when this transport serves data connections that the listener hands to adopt().
  virtual bool accepts_connections() const { return false; }
  // Whether a data connection from the peer engine `instance` would be taken now; asked before
  // the handshake completes, so that a refusal reaches the client as one.
  virtual bool admit(const uint8_t instance[16]) { return accepts_connections(); }
  // Takes an accepted, authenticated data connection; closes it when it will not serve it.
  virtual void adopt(Connection conn);
  // Stops serving and fails future work; idempotent.
  virtual void close() = 0;
};

// Everything a transport factory gets: the engine's shared context and its region table.
struct TransportEnv {
  EngineContext& ctx;
  const RegionTable& regions;
};

using TransportFactory = std::unique_ptr<Transport> (*)(TransportEnv env);

}  // namespace tidekv
