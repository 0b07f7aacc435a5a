#include "fabric/fabric_api.h"

#include "common/system_library.h"

namespace tidekv::fabric {

Library& Library::get() {
  static Library* library = new Library();  // never destroyed: the progress thread may run at exit
  return *library;
}

Library::Library() {
  SystemLibrary lib("TIDEKV_LIBFABRIC", "libfabric.so.1");
  const std::string& path = lib.path();
  if (!lib.is_open()) {
    reason_ = lib.error() + ": install libfabric (Debian/Ubuntu: apt-get install libfabric1; AWS: the EFA installer)";
    return;
  }
  lib.resolve(api_.getinfo, "fi_getinfo");
  lib.resolve(api_.freeinfo, "fi_freeinfo");
  lib.resolve(api_.dupinfo, "fi_dupinfo");
  lib.resolve(api_.fabric, "fi_fabric");
  lib.resolve(api_.strerror, "fi_strerror");
  lib.resolve(api_.version, "fi_version");
  if (!lib.missing().empty()) {
    reason_ = path + " lacks " + lib.missing() + ": not a libfabric this build can use";
    return;
  }
  uint32_t v = api_.version();
  if (FI_VERSION_LT(v, kApiVersion)) {
    reason_ = path + " is libfabric " + std::to_string(FI_MAJOR(v)) + "." + std::to_string(FI_MINOR(v)) +
              "; tidekv needs 1.9 or newer";
    return;
  }
  available_ = true;
  reason_ = path + " (libfabric " + std::to_string(FI_MAJOR(v)) + "." + std::to_string(FI_MINOR(v)) + ")";
}

std::string Library::error_text(const char* call, ssize_t rc) const {
  int err = int(rc < 0 ? -rc : rc);
  std::string what = available_ ? api_.strerror(err) : "error";
  return std::string(call) + ": " + what + " (" + std::to_string(-err) + ")";
}

}  // namespace tidekv::fabric
