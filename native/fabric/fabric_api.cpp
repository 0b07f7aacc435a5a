#include "fabric/fabric_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <type_traits>

namespace tidekv::fabric {

Library& Library::get() {
  static Library* library = new Library();  // never destroyed: the progress thread may run at exit
  return *library;
}

Library::Library() {
  const char* env = std::getenv("TIDEKV_LIBFABRIC");
  std::string path = env && *env ? env : "libfabric.so.1";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* err = dlerror();
    reason_ = path + " does not load (" + (err ? err : "unknown error") +
              "): install libfabric (Debian/Ubuntu: apt-get install libfabric1; AWS: the EFA installer)";
    return;
  }
  std::string missing;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  sym(api_.getinfo, "fi_getinfo");
  sym(api_.freeinfo, "fi_freeinfo");
  sym(api_.dupinfo, "fi_dupinfo");
  sym(api_.fabric, "fi_fabric");
  sym(api_.strerror, "fi_strerror");
  sym(api_.version, "fi_version");
  if (!missing.empty()) {
    reason_ = path + " lacks " + missing + ": not a libfabric this build can use";
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
