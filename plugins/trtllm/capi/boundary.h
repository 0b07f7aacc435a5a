// The one error boundary of the C API (transfer_engine_c.cpp calls every body through it): a
// native tidekv::Error, an ApiError raised here, std::bad_alloc or anything else thrown below
// becomes a return code (Mooncake's values, see transfer_engine_c.h) and the calling thread's
// last error, logged on stderr. Nothing is thrown past it, so no C++ exception or abort reaches
// a C caller. Neighbours: c_engine (what the bodies call), options (the log level).
#pragma once

#include <new>
#include <stdexcept>
#include <string>

#include "common/errors.h"
#include "common/log_sink.h"

namespace tidekv::capi {

// A failure the C API itself detects (a bad argument, a call it cannot serve), with its code.
class ApiError : public std::runtime_error {
 public:
  ApiError(int code, const std::string& message) : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// The return code for a native error kind.
int code_of(ErrorKind kind);
// Writes one line to stderr when `level` is at or above the configured level (TIDEKV_LOG_LEVEL).
void log(LogLevel level, const std::string& message);
// Sets the calling thread's last error to "<function>: <message>" and logs it; returns code.
int record_failure(const char* function, int code, const std::string& message);
const char* last_error();

// Runs body(); a failure returns `on_failure(code)` after record_failure.
template <typename Body, typename OnFailure>
auto guarded(const char* function, Body&& body, OnFailure&& on_failure) noexcept -> decltype(body()) {
  try {
    try {
      return body();
    } catch (const ApiError& e) {
      return on_failure(record_failure(function, e.code(), e.what()));
    } catch (const Error& e) {
      return on_failure(record_failure(function, code_of(e.kind()), e.what()));
    } catch (const std::bad_alloc&) {
      return on_failure(record_failure(function, -302, "out of memory"));
    } catch (const std::exception& e) {
      return on_failure(record_failure(function, -1, std::string("internal error: ") + e.what()));
    } catch (...) {
      return on_failure(record_failure(function, -1, "internal error (unknown exception)"));
    }
  } catch (...) {
    return on_failure(-1);  // recording itself failed (out of memory): the code still gets through
  }
}

// For functions that return their code: 0 on success.
template <typename Body>
int guarded_code(const char* function, Body&& body) noexcept {
  return guarded(function, std::forward<Body>(body), [](int code) { return code; });
}

[[noreturn]] inline void refuse(int code, const std::string& message) { throw ApiError(code, message); }

}  // namespace tidekv::capi
