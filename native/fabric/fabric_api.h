// libfabric, loaded once per process at run time (dlopen of libfabric.so.1, or the library
// $TIDEKV_LIBFABRIC names): the build never needs it and one wheel imports everywhere; where it
// is missing the fabric transport reports why instead. Only the entry points below are looked
// up; everything else in libfabric's API is an inline call through the objects' ops tables
// (rdma/*.h), so no libfabric symbol is ever linked.
#pragma once

#include <cstdint>
#include <string>

#include "fabric/rdma/fabric.h"

namespace tidekv::fabric {

struct Api {
  int (*getinfo)(uint32_t version, const char* node, const char* service, uint64_t flags, const fi_info* hints,
                 fi_info** info);
  void (*freeinfo)(fi_info* info);
  fi_info* (*dupinfo)(const fi_info* info);
  int (*fabric)(fi_fabric_attr* attr, fid_fabric** fabric, void* context);
  const char* (*strerror)(int errnum);
  uint32_t (*version)();
};

// The API version tidekv asks for: old enough for Debian 12's libfabric 1.17, new enough for
// FI_HMEM and the strict memory-registration modes.
constexpr uint32_t kApiVersion = FI_VERSION(1, 9);

class Library {
 public:
  // The process's library; loaded on first use (never throws, never unloaded).
  static Library& get();
  bool available() const { return available_; }
  // Why not available, or the library and its version.
  const std::string& reason() const { return reason_; }
  const Api& api() const { return api_; }
  // "fi_write: Connection reset by peer (-104)": libfabric's words for a negative return code.
  std::string error_text(const char* call, ssize_t rc) const;

 private:
  Library();
  bool available_ = false;
  std::string reason_;
  Api api_{};
};

}  // namespace tidekv::fabric
