/* tidekv's implementation of Mooncake's C API (mooncake-transfer-engine/include/transfer_engine_c.h,
 * as of Mooncake 0.3.x and its main branch of 2026-08): the same function names, signatures, struct
 * layouts and constants, so that a caller built against Mooncake's header (TensorRT-LLM's
 * libtensorrt_llm_mooncake_wrapper.so) runs on libtransfer_engine.so built from this folder.
 *
 * Conventions every function follows:
 * - 0 (or a segment id >= 0, a batch id != INVALID_BATCH, a non-NULL handle) means success;
 *   failures return one of the TE_ERR_* codes below (Mooncake's own values) and set the calling
 *   thread's last error, which tidekv_last_error() returns and which is logged on stderr.
 * - No C++ exception and no abort ever leaves a function of this API.
 * - "char *" arguments are not used after the call returns (the caller may free them).
 * - Segment names are "ip:port" of a peer's endpoint, as getLocalIpAndPort() gives them.
 */
#ifndef TIDEKV_TRANSFER_ENGINE_C_H
#define TIDEKV_TRANSFER_ENGINE_C_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t segment_handle_t;
typedef int32_t segment_id_t;
typedef uint64_t batch_id_t;
#define LOCAL_SEGMENT (0)
#define INVALID_BATCH UINT64_MAX

#define OPCODE_READ (0)
#define OPCODE_WRITE (1)

/* target_offset: the remote virtual address (inside a region the peer registered). */
struct transfer_request {
  int opcode;
  void *source;
  segment_id_t target_id;
  uint64_t target_offset;
  uint64_t length;
};
typedef struct transfer_request transfer_request_t;

struct notify_msg {
  char *name;
  char *msg;
};
typedef struct notify_msg notify_msg_t;

#define STATUS_WAITING (0)
#define STATUS_PENDING (1)
#define STATUS_INVALID (2)
#define STATUS_CANCELED (3)
#define STATUS_COMPLETED (4)
#define STATUS_TIMEOUT (5)
#define STATUS_FAILED (6)

struct transfer_status {
  int status;
  uint64_t transferred_bytes;
};
typedef struct transfer_status transfer_status_t;

struct segment_desc {
  int type;
  union {
    struct {
      void *addr;
      uint64_t size;
      const char *location;
    } rdma;
    struct {
      const char *file_path;
      const char *subsystem_name;
      const char *proto;
      const char *ip;
      uint64_t port;
    } nvmeof;
  } desc_;
};
typedef struct segment_desc segment_desc_t;

struct buffer_entry {
  void *addr;
  size_t length;
};
typedef struct buffer_entry buffer_entry_t;

struct nic_load_stat {
  char device_name[64];
  uint64_t inflight_bytes;
  double ewma_bandwidth_bps;
};
typedef struct nic_load_stat nic_load_stat_t;

typedef void *transfer_engine_t;
typedef void *transport_t;

/* Return codes (Mooncake's error.h values). */
#define TE_OK (0)
#define TE_ERR_INVALID_ARGUMENT (-1)
#define TE_ERR_TOO_MANY_REQUESTS (-2)
#define TE_ERR_ADDRESS_NOT_REGISTERED (-3)
#define TE_ERR_BATCH_BUSY (-4)
#define TE_ERR_DEVICE_NOT_FOUND (-6)
#define TE_ERR_SOCKET (-102)
#define TE_ERR_REJECT_HANDSHAKE (-104)
#define TE_ERR_METADATA (-200)
#define TE_ERR_MEMORY (-302)
#define TE_ERR_NOT_IMPLEMENTED (-303)

transfer_engine_t createTransferEngine(const char *metadata_conn_string, const char *local_server_name,
                                       const char *ip_or_host_name, uint64_t rpc_port, int auto_discover);
int discoverTopology(transfer_engine_t engine);
int getLocalIpAndPort(transfer_engine_t engine, char *buf_out, size_t buf_len);
transport_t installTransport(transfer_engine_t engine, const char *proto, void **args);
int uninstallTransport(transfer_engine_t engine, const char *proto);
segment_id_t openSegment(transfer_engine_t engine, const char *segment_name);
segment_id_t openSegmentNoCache(transfer_engine_t engine, const char *segment_name);
int closeSegment(transfer_engine_t engine, segment_id_t segment_id);
int warmupEfaSegment(transfer_engine_t engine, const char *segment_name);
int removeLocalSegment(transfer_engine_t engine, const char *segment_name);
void destroyTransferEngine(transfer_engine_t engine);
int registerLocalMemory(transfer_engine_t engine, void *addr, size_t length, const char *location,
                        int remote_accessible);
int unregisterLocalMemory(transfer_engine_t engine, void *addr);
int registerLocalMemoryBatch(transfer_engine_t engine, buffer_entry_t *buffer_list, size_t buffer_len,
                             const char *location);
int unregisterLocalMemoryBatch(transfer_engine_t engine, void **addr_list, size_t addr_len);
batch_id_t allocateBatchID(transfer_engine_t engine, size_t batch_size);
int submitTransfer(transfer_engine_t engine, batch_id_t batch_id, struct transfer_request *entries, size_t count);
int submitTransferWithNotify(transfer_engine_t engine, batch_id_t batch_id, struct transfer_request *entries,
                             size_t count, notify_msg_t notify_msg);
notify_msg_t *getNotifsFromEngine(transfer_engine_t engine, int *size);
int freeNotifsMsgBuf(notify_msg_t *msg, int size);
int genNotifyInEngine(transfer_engine_t engine, uint64_t target_id, notify_msg_t notify_msg);
int getTransferStatus(transfer_engine_t engine, batch_id_t batch_id, size_t task_id, struct transfer_status *status);
int freeBatchID(transfer_engine_t engine, batch_id_t batch_id);
int syncSegmentCache(transfer_engine_t engine);
int getNicLoadStats(transfer_engine_t engine, nic_load_stat_t *stats, size_t *count);
void enableGracefulShutdown(transfer_engine_t engine);
int showLinks(transfer_engine_t engine, char *buf_out, size_t buf_len, int json);

/* tidekv's addition: the text of the last failure of a call made on this thread ("" if none
 * yet); valid until the thread's next failing call. */
const char *tidekv_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* TIDEKV_TRANSFER_ENGINE_C_H */
