// A system library opened at run time, never linked (libcuda, libfabric): one wheel builds and
// imports on hosts without it, and the transport that needs it reports why it cannot run.
#pragma once

#include <dlfcn.h>

#include <cstdlib>
#include <string>
#include <type_traits>

namespace tidekv {

class SystemLibrary {
 public:
  // Opens the file $env_var names, else `soname`. Never closed (its users live until exit).
  SystemLibrary(const char* env_var, const char* soname) {
    const char* env = std::getenv(env_var);
    path_ = env && *env ? env : soname;
    handle_ = dlopen(path_.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle_) {
      const char* err = dlerror();
      error_ = path_ + " does not load (" + (err ? err : "unknown error") + ")";
    }
  }
  bool is_open() const { return handle_ != nullptr; }
  const std::string& path() const { return path_; }
  // Why it did not open: "<path> does not load (<loader's words>)".
  const std::string& error() const { return error_; }
  // Sets `fn` to the symbol `name`; a missing one is added to missing().
  template <typename Fn>
  void resolve(Fn& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<Fn>>(handle_ ? dlsym(handle_, name) : nullptr);
    if (!fn) missing_ += std::string(missing_.empty() ? "" : ", ") + name;
  }
  // The symbols resolve() did not find, comma-separated ("" when all were there).
  const std::string& missing() const { return missing_; }

 private:
  std::string path_;
  void* handle_ = nullptr;
  std::string error_;
  std::string missing_;
};

}  // namespace tidekv
