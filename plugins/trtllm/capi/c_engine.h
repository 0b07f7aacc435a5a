// What a transfer_engine_t points at: one tidekv native Engine (its listener, regions,
// transports, workers) plus what Mooncake's C API adds on top of it: numbered segments (the
// peers opened by "ip:port" of their endpoint), batch ids that several submits may fill, and
// notifications. Every method may throw (tidekv::Error or ApiError); transfer_engine_c.cpp
// calls them through the boundary. Thread-safe.
//
// Notification order: the message of submitTransferWithNotify is sent by the engine's notifier
// thread once every request of that submit finished (the bytes of a WRITE are in the peer's
// memory when its request completes: tcp acknowledges after the copy, shm copies in place), so
// the peer never reads the message before the data, whether or not the caller polls. A submit
// with a failed request sends no message (its data is not all there); the failure is logged.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "batch/batch.h"
#include "endpoint.h"
#include "engine/engine.h"

namespace tidekv::capi {

constexpr uint64_t kEngineMagic = 0x54494445'4b564341ull;  // "TIDEKVCA": a live CEngine

// One submit's share of a batch id: tasks [first_task, first_task + native->requests().size()).
struct Submission {
  std::shared_ptr<Batch> native;
  size_t first_task;
  std::vector<uint8_t> states;  // per task, Mooncake's STATUS_*: filled once the submission is done
};

struct CBatch {
  size_t capacity;
  size_t used = 0;
  std::mutex mu;
  std::vector<Submission> submissions;
};

struct TaskStatus {
  int status;
  uint64_t transferred_bytes;
};

struct RequestSpec {
  int opcode;
  uint64_t source;
  int32_t target_id;
  uint64_t target_offset;
  uint64_t length;
};

class CEngine {
 public:
  // metadata: "P2PHANDSHAKE" (the only mode: peers find each other through their endpoints).
  // host: the address to bind and advertise; rpc_port: the endpoint's port (0: any free one).
  CEngine(const std::string& metadata, const std::string& host, int rpc_port);
  ~CEngine();
  uint64_t magic = kEngineMagic;

  std::string local_name() const;
  void register_memory(uint64_t addr, uint64_t length, const std::string& location);
  void unregister_memory(uint64_t addr);

  // Segment ids: 0 is this engine (LOCAL_SEGMENT), peers count from 1.
  int32_t open_segment(const std::string& name, bool refresh);
  void close_segment(int32_t id);

  uint64_t allocate_batch(size_t capacity);
  void submit(uint64_t batch_id, const std::vector<RequestSpec>& requests, const Notification* notify);
  TaskStatus status(uint64_t batch_id, size_t task);
  void free_batch(uint64_t batch_id);

  void send_notification(int32_t segment, const std::string& name, const std::string& message);
  std::vector<Notification> take_notifications() { return endpoint_->take(); }
  std::vector<TransportStatus> transports() const { return engine_->transports(); }

 private:
  struct Segment {
    std::string name;       // the endpoint's "host:port" (what openSegment was given)
    std::string peer_name;  // the engine listener's "host:port" (what requests go to)
    uint32_t peer_id = 0;
    bool is_open = true;
    std::shared_ptr<EndpointLink> link;  // null for the local segment
  };
  struct PendingNotification {
    std::shared_ptr<Batch> batch;
    int32_t segment;
    Notification message;
  };
  std::shared_ptr<CBatch> find_batch(uint64_t id);
  Segment segment(int32_t id);
  void notifier_loop();
  void log_loop();

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Endpoint> endpoint_;
  std::string host_;
  int handshake_timeout_ms_;

  std::mutex segments_mu_;
  std::vector<Segment> segments_;
  std::unordered_map<std::string, int32_t> segment_ids_;

  std::mutex batches_mu_;
  uint64_t next_batch_ = 1;
  std::unordered_map<uint64_t, std::shared_ptr<CBatch>> batches_;

  std::mutex notify_mu_;
  std::condition_variable notify_cv_;
  std::deque<PendingNotification> pending_;
  bool stopping_ = false;
  std::thread notifier_;
  std::thread logger_;
};

}  // namespace tidekv::capi
