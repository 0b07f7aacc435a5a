#include "boundary.h"

#include <cstdio>
#include <mutex>

#include "options.h"

namespace tidekv::capi {
namespace {

thread_local std::string g_last_error;

const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarning: return "WARNING";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}

}  // namespace

int code_of(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kConfig: return -1;            // ERR_INVALID_ARGUMENT
    case ErrorKind::kNotRegistered: return -3;     // ERR_ADDRESS_NOT_REGISTERED
    case ErrorKind::kProtocolVersion: return -104; // ERR_REJECT_HANDSHAKE
    case ErrorKind::kAuth: return -104;
    case ErrorKind::kRefused: return -104;
    case ErrorKind::kTransfer: return -102;        // ERR_SOCKET
    case ErrorKind::kPeerUnavailable: return -102;
    case ErrorKind::kHangup: return -102;
    case ErrorKind::kTimeout: return -102;
    case ErrorKind::kClosed: return -1;
  }
  return -1;
}

void log(LogLevel level, const std::string& message) {
  if (int(level) < int(log_threshold())) return;
  static std::mutex mu;  // one line at a time from many threads
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "tidekv libtransfer_engine %s: %s\n", level_name(level), message.c_str());
}

int record_failure(const char* function, int code, const std::string& message) {
  g_last_error = std::string(function) + ": " + message;
  log(LogLevel::kError, g_last_error + " (returns " + std::to_string(code) + ")");
  return code;
}

const char* last_error() { return g_last_error.c_str(); }

}  // namespace tidekv::capi
