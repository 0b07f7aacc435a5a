// Typed errors of the native data path. common/bindings_errors.cpp maps each ErrorKind onto a
// class of tidekv.errors, in that one place, so nothing crosses the boundary as an int or a
// status string.
#pragma once

#include <stdexcept>
#include <string>

namespace tidekv {

enum class ErrorKind : int {
  kConfig = 0,          // bad argument or setting
  kNotRegistered = 1,   // address range not inside a registered region
  kTransfer = 2,        // a transfer failed on the wire or at the peer
  kPeerUnavailable = 3, // peer unreachable, closed the connection, or died
  kProtocolVersion = 4, // peer speaks another protocol version
  kAuth = 5,            // shared secret missing or wrong
  kTimeout = 6,         // an operation ran past its deadline
  kClosed = 7,          // this engine is closed
  kHangup = 8,          // the other side closed an idle connection (between frames; not an error there)
  kRefused = 9,         // the peer has no room for another connection of ours (its limits)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message, const char* file, int line)
      : std::runtime_error(message), kind_(kind), file_(file), line_(line) {}
  ErrorKind kind() const { return kind_; }
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  ErrorKind kind_;
  const char* file_;
  int line_;
};

}  // namespace tidekv

#define TIDEKV_THROW(kind, msg) throw ::tidekv::Error(::tidekv::ErrorKind::kind, (msg), __FILE__, __LINE__)
#define TIDEKV_CHECK(cond, kind, msg) \
  do {                                \
    if (!(cond)) TIDEKV_THROW(kind, msg); \
  } while (0)
