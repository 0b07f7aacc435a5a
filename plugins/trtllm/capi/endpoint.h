// A C API engine's endpoint: what its segment name ("ip:port", from getLocalIpAndPort) points
// at, in the role of Mooncake's P2P handshake port. A peer that opens a segment first fetches
// the descriptor at that address (a kDescriptor handshake, which a plain tidekv engine's
// listener answers too): the one served here carries an extra section, kEndpointWireId, that
// tells the two apart without being refused by either. For an endpoint, the peer then opens an
// endpoint connection (tidekv's transfer handshake with Hello.transport = kEndpointWireId:
// version check, shared secret when one is set, this engine's descriptor) and asks for the
// port of the engine's listener, where its data then goes. That connection carries
// notifications (genNotifyInEngine and the one of submitTransferWithNotify), each
// acknowledged once it is queued here for getNotifsFromEngine.
//
// Frames after the handshake, little-endian: EndpointFrame then name and message bytes;
// answered by one EndpointReply. Threads: one accepting, one per open connection; stop()
// ends them all. Neighbours: c_engine (owns one Endpoint and one EndpointLink per segment).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <list>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

namespace tidekv::capi {

// Greeting id of an endpoint connection (Hello.transport), and the id of the descriptor section
// (its bytes: kEndpointVersion as a uint32) by which an endpoint's descriptor differs from a
// plain engine's; never a TransportId.
constexpr uint16_t kEndpointWireId = 0x7463;
constexpr uint16_t kEndpointVersion = 1;
constexpr uint32_t kEndpointMagic = 0x4e434b54;  // "TKCN"
constexpr uint32_t kMaxNameBytes = 4096;
constexpr uint32_t kMaxMessageBytes = 16u << 20;

enum class FrameKind : uint16_t { kLookup = 1, kNotify = 2 };

struct EndpointFrame {
  uint32_t magic;
  uint16_t kind;
  uint16_t version;
  uint32_t name_bytes;
  uint32_t message_bytes;
};

struct EndpointReply {
  uint32_t magic;
  uint32_t status;  // 0 ok, 1 refused (bad frame or version)
  uint64_t value;   // kLookup: the engine's listener port
};

static_assert(sizeof(EndpointFrame) == 16);
static_assert(sizeof(EndpointReply) == 16);

struct Notification {
  std::string name;
  std::string message;
};

class Endpoint {
 public:
  // Binds host:port (0: any free port) and starts serving (throws kConfig when it cannot).
  Endpoint(const std::string& host, int port, const std::string& secret, std::string descriptor, int engine_port,
           int handshake_timeout_ms);
  ~Endpoint();
  int port() const { return port_; }
  // Every notification received since the last call, in arrival order.
  std::vector<Notification> take();
  void stop();

 private:
  struct Server {
    std::thread thread;
    bool is_finished = false;  // guarded by mu_; set as the thread's last step, so it joins at once
  };
  void accept_loop();
  void serve(int fd, std::string what);

  std::string secret_;
  std::string descriptor_;
  int engine_port_;
  int handshake_timeout_ms_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::deque<Notification> received_;
  std::unordered_set<int> open_fds_;
  std::list<Server> servers_;  // one per connection; finished ones are joined as new ones come
  std::thread acceptor_;
};

// The client half: one connection to a peer's endpoint, opened by openSegment.
class EndpointLink {
 public:
  // Connects, runs the handshake and asks for the engine's port (throws a typed Error).
  EndpointLink(const std::string& host, int port, const uint8_t instance[16], const std::string& secret,
               int timeout_ms);
  ~EndpointLink();
  const std::string& descriptor() const { return descriptor_; }
  int engine_port() const { return engine_port_; }
  // Delivers one notification and waits for the peer's acknowledgement.
  void notify(const std::string& name, const std::string& message);

 private:
  void connect();
  EndpointReply exchange(FrameKind kind, const std::string& name, const std::string& message);

  std::string host_;
  int port_;
  uint8_t instance_[16];
  std::string secret_;
  int timeout_ms_;
  std::string what_;
  std::mutex mu_;
  int fd_ = -1;
  std::string descriptor_;
  int engine_port_ = 0;
};

}  // namespace tidekv::capi
