// SHA-256 and HMAC-SHA-256, only for the handshake's shared-secret challenge.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace tidekv {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const uint8_t* data, size_t size);
Digest hmac_sha256(const std::string& key, const uint8_t* data, size_t size);

}  // namespace tidekv
