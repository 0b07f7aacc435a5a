// Wire format of the transfer protocol: the handshake every connection starts with, the
// versioned peer descriptor, and the data frames of the tcp transport. Little-endian structs;
// any change to them bumps kProtocolVersion so that mismatched peers refuse each other by name.
#pragma once

#include <cstdint>

namespace tidekv::wire {

constexpr uint32_t kMagic = 0x564b4454;  // "TDKV"
constexpr uint32_t kProtocolVersion = 7;

// kRegionProof: asks the engine to vouch for a range of its memory (RegionProof below), then closes.
enum class ConnType : uint32_t { kDescriptor = 1, kData = 2, kRegionProof = 3 };

enum class Status : uint32_t {
  kOk = 0,
  kVersionMismatch = 1,
  kAuthFailed = 2,
  kBadFrame = 3,
  kNotRegistered = 4,
  kClosing = 5,
  kRefused = 6,  // the server has no room for the connection (limits), or no such transport
  kNotHostMemory = 7,  // the range is registered, but in GPU memory, which tcp does not serve
};

enum class Op : uint8_t { kRead = 0, kWrite = 1 };

// Client -> server, first bytes of every connection. `transport` names the transport that
// serves a kData connection (its wire id); `instance` identifies the client engine, so that the
// server can bound the connections of one peer.
struct Hello {
  uint32_t magic;
  uint32_t version;
  uint32_t conn_type;
  uint16_t transport;
  uint16_t reserved;
  uint8_t nonce[32];
  uint8_t instance[16];
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

// Server -> client after a good Auth, followed by `descriptor_bytes` of the server's descriptor;
// a kDescriptor connection then closes. With a secret, `mac` proves the server holds it too:
// HMAC-SHA-256(secret, "tidekv-server" || client nonce || server nonce); zeros without one.
struct Welcome {
  uint32_t magic;
  uint32_t status;
  uint32_t descriptor_bytes;
  uint32_t reserved;
  uint8_t mac[32];
};

// The descriptor: what a peer needs to reach an engine. A header, then `sections` sections, one
// per transport of the engine, each a SectionHeader and `length` opaque bytes that only that
// transport reads. A peer skips the sections of transports it lacks.
struct DescriptorHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t sections;
  uint32_t reserved;
  uint8_t instance[16];  // random per engine: a new one means the peer restarted
};

struct SectionHeader {
  uint16_t transport;
  uint16_t reserved;
  uint32_t length;
};

constexpr uint32_t kMaxDescriptorBytes = 64 << 10;

// Client -> server on a kRegionProof connection, after the Welcome and its descriptor: does this
// engine vouch for [base, base + length)? It does when a live region of its own covers the range
// and `mac` is the engine's region proof for it (common/region_proof.h): an HMAC under a key that
// never leaves the engine's process, so only that process can have made it. `context` binds the
// proof to what it is for (a store master's digest of the mounting client and segment).
struct RegionProof {
  uint32_t magic;
  uint32_t reserved;
  uint64_t base;
  uint64_t length;
  uint8_t context[32];
  uint8_t mac[32];
};

// Server -> client, then the connection closes. status: kOk (it vouches), kNotRegistered (no
// live region of it covers the range), kAuthFailed (the proof is not this engine's).
struct RegionVerdict {
  uint32_t magic;
  uint32_t status;
};

// One slice of a request. span_*: the whole request the slice belongs to; the server serves
// the slice only when the whole span lies in one registered region, so a request that reaches
// past its region fails whole and no slice of it lands.
struct RequestHeader {
  uint32_t magic;
  uint8_t op;
  uint8_t reserved[3];
  uint64_t remote_addr;
  uint64_t length;
  uint64_t tag;
  uint64_t span_addr;
  uint64_t span_length;
};

struct ResponseHeader {
  uint32_t magic;
  uint32_t status;
  uint64_t length;  // payload bytes that follow (READ that succeeded), else 0
  uint64_t tag;
  uint64_t reserved;
};

static_assert(sizeof(Hello) == 64);
static_assert(sizeof(Challenge) == 48);
static_assert(sizeof(Welcome) == 48);
static_assert(sizeof(DescriptorHeader) == 32);
static_assert(sizeof(SectionHeader) == 8);
static_assert(sizeof(RegionProof) == 88);
static_assert(sizeof(RegionVerdict) == 8);
static_assert(sizeof(RequestHeader) == 48);
static_assert(sizeof(ResponseHeader) == 32);

}  // namespace tidekv::wire
