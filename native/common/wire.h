// Wire format of the transfer protocol: the handshake every connection starts with, the peer
// descriptor, and the data frames of the tcp transport. Fixed-size little-endian structs; any
// change bumps kProtocolVersion so that mismatched peers refuse each other by name.
#pragma once

#include <cstdint>

namespace tidekv::wire {

constexpr uint32_t kMagic = 0x564b4454;  // "TDKV"
constexpr uint32_t kProtocolVersion = 1;

enum class ConnType : uint32_t { kDescriptor = 1, kData = 2 };

enum class Status : uint32_t {
  kOk = 0,
  kVersionMismatch = 1,
  kAuthFailed = 2,
  kBadFrame = 3,
  kNotRegistered = 4,
  kClosing = 5,
};

enum class Op : uint8_t { kRead = 0, kWrite = 1 };

// Client -> server, first bytes of every connection.
struct Hello {
  uint32_t magic;
  uint32_t version;
  uint32_t conn_type;
  uint32_t reserved;
  uint8_t nonce[32];
};

// Server -> client. On kVersionMismatch the server closes after sending it.
struct Challenge {
  uint32_t magic;
  uint32_t version;
  uint32_t status;
  uint32_t secret_required;
  uint8_t nonce[32];
};

// Client -> server: HMAC-SHA-256(secret, server nonce || client nonce); zeros without a secret.
struct Auth {
  uint8_t mac[32];
};

// What a peer needs to reach an engine: enough for the tcp path and, when it turns out to be on
// the same host, for the shared-memory path (pid, region-table fd, a token to prove it).
struct Descriptor {
  uint32_t magic;
  uint32_t version;
  int32_t pid;
  int32_t table_fd;
  uint64_t token_addr;  // where `token` lives in the engine's own memory (cross-memory probe)
  uint8_t token[16];
  char boot_id[40];
};

// Server -> client after a good Auth; a kDescriptor connection then closes.
struct Welcome {
  uint32_t magic;
  uint32_t status;
  Descriptor descriptor;
};

struct RequestHeader {
  uint32_t magic;
  uint8_t op;
  uint8_t reserved[3];
  uint64_t remote_addr;
  uint64_t length;
  uint64_t tag;
};

struct ResponseHeader {
  uint32_t magic;
  uint32_t status;
  uint64_t length;  // payload bytes that follow (READ that succeeded), else 0
  uint64_t tag;
  uint64_t reserved;
};

static_assert(sizeof(RequestHeader) == 32);
static_assert(sizeof(ResponseHeader) == 32);

}  // namespace tidekv::wire
