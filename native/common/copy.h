// Host-memory copies of the data path.
//
// A large same-host batch is copied with non-temporal (streaming) stores: they write whole cache
// lines around the caches instead of reading each destination line in first and evicting what
// other threads are using. On the 2-vCPU AMD EPYC VM this project is measured on, batches of 1 MiB
// requests whose bytes are not in the caches (a KV hand-off's rarely are) copy at 14-16 GB/s per
// thread with glibc's memcpy and 21-23 GB/s streaming (benchmarks/copy_probe.py); bytes still in
// the caches from the call before copy faster with memcpy (the probe's --hot), so only batches of
// at least ShmOptions::stream_copy_bytes (8 MiB) stream.
#pragma once

#include <cstddef>

namespace tidekv {

// memcpy, or with `stream` (and on x86-64) streaming stores for all but the unaligned edges.
// The stores are fenced before it returns, so whoever is told the copy finished sees the bytes.
void copy_bytes(void* dst, const void* src, size_t n, bool stream);

// Which streaming copy this CPU runs: "avx2", "sse2" or "none" (memcpy only).
const char* stream_copy_kind();

// Streaming copy with a named routine ("avx2", "sse2", "memcpy"), so tests reach the one this CPU
// does not pick; false when this build or CPU lacks it.
bool stream_copy_with(const char* kind, void* dst, const void* src, size_t n);

}  // namespace tidekv
