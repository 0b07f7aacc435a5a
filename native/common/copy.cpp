#include "common/copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tidekv {
namespace {

#if defined(__x86_64__)

constexpr size_t kMinStreamBytes = 4096;  // below a page streaming buys little, and each call pays a fence

// SSE2 is part of x86-64: this one runs everywhere.
void stream_sse2(uint8_t* d, const uint8_t* s, size_t n) {
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m128i r[8];
    for (int k = 0; k < 8; ++k) r[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16 * k));
    for (int k = 0; k < 8; ++k) _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16 * k), r[k]);
  }
  _mm_sfence();
  std::memcpy(d + i, s + i, n - i);
}

__attribute__((target("avx2"))) void stream_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    __m256i r[8];
    for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32 * k));
    for (int k = 0; k < 8; ++k) _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32 * k), r[k]);
  }
  _mm_sfence();
  std::memcpy(d + i, s + i, n - i);
}

using StreamFn = void (*)(uint8_t*, const uint8_t*, size_t);

StreamFn pick() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") ? stream_avx2 : stream_sse2;
}

const StreamFn kStream = pick();

void stream_with(StreamFn fn, void* dst, const void* src, size_t n) {
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  // Streaming stores need aligned destinations: the head up to a 64-byte boundary is a memcpy.
  size_t head = std::min<size_t>(n, (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63);
  std::memcpy(d, s, head);
  fn(d + head, s + head, n - head);
}

#endif

}  // namespace

void copy_bytes(void* dst, const void* src, size_t n, bool stream) {
#if defined(__x86_64__)
  if (stream && n >= kMinStreamBytes) return stream_with(kStream, dst, src, n);
#endif
  (void)stream;
  std::memcpy(dst, src, n);
}

bool stream_copy_with(const char* kind, void* dst, const void* src, size_t n) {
  std::string name(kind);
  if (name == "memcpy") {
    std::memcpy(dst, src, n);
    return true;
  }
#if defined(__x86_64__)
  StreamFn fn = name == "sse2" ? stream_sse2 : name == "avx2" && __builtin_cpu_supports("avx2") ? stream_avx2 : nullptr;
  if (fn) {
    stream_with(fn, dst, src, n);
    return true;
  }
#endif
  return false;
}

const char* stream_copy_kind() {
#if defined(__x86_64__)
  return kStream == stream_avx2 ? "avx2" : "sse2";
#else
  return "none";
#endif
}

}  // namespace tidekv
