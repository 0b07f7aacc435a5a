// Region proofs: how an engine's process proves that a range of memory is its own, to a third
// party that asks the engine itself (a store master checking a mount). The engine holds a random
// key that never leaves its process; its proof for a range is HMAC-SHA-256(key, "tidekv-region"
// || context || base || length), made only for a range a live region of it covers. The third
// party connects to the engine's listener (ConnType::kRegionProof, after the usual handshake and
// its secret), sends the range, the context and the proof, and the engine answers whether it
// vouches for them. A process naming someone else's engine and memory cannot make a proof that
// engine accepts.
#pragma once

#include <cstdint>
#include <string>

#include "common/sha256.h"
#include "common/wire.h"

namespace tidekv {

// The proof for [base, base + length) under `key`, bound to `context`.
Digest region_proof_mac(const std::string& key, const uint8_t context[32], uint64_t base, uint64_t length);

// Asks the engine at host:port whether it vouches for `proof`. Returns normally when it does;
// throws kNotRegistered (no live region covers the range), kAuth (not that engine's proof, or
// the secret was refused), kPeerUnavailable / kTimeout / kProtocolVersion naming `host:port`.
void check_region_proof(const std::string& host, int port, const std::string& secret, const wire::RegionProof& proof,
                        int timeout_ms);

}  // namespace tidekv
