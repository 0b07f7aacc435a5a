// Blocking socket helpers shared by the handshake and the tcp transport. Every failure throws a
// typed Error (kPeerUnavailable for a closed or broken connection, kTimeout past the deadline).
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <optional>
#include <cstdint>
#include <memory>
#include <string>

namespace tidekv {

struct SocketOptions {
  int buffer_bytes = 4 << 20;
  int io_timeout_ms = 30000;
};

// Opens a listening socket on host:port (0 = any free port) and returns it with the bound port.
int listen_tcp(const std::string& host, int port, int* bound_port);
// Connects with a timeout and applies the options (TCP_NODELAY, buffers, timeouts, keepalive).
int connect_tcp(const std::string& host, int port, const SocketOptions& options);
void tune_socket(int fd, const SocketOptions& options);

// Sends every byte of the iovecs (modified in place). `what` names the peer in errors.
void send_all(int fd, struct iovec* iov, int count, const std::string& what);
// Like send_all, but gives up at `deadline` (returns false; *next and the iovecs say how far it
// got, so a later call resumes). A peer that takes no byte for `io_timeout_ms` (0: no limit)
// fails it with kTimeout, deadline or not: the socket's own timeout, which bounds the sends
// without a deadline, does not bound the polling here.
bool send_until(int fd, struct iovec* iov, int count, int* next,
                const std::optional<std::chrono::steady_clock::time_point>& deadline, int io_timeout_ms,
                const std::string& what);
// Polls fd without sleeping for up to `spin_us`; true as soon as it is readable. A reply that
// comes within microseconds then costs no sleep and wake-up (expensive on a virtualised core).
bool spin_until_readable(int fd, int spin_us);
// Waits until fd is readable (true) or `deadline` passes (false). Nothing to read for
// `io_timeout_ms` (0: no limit) before that throws kTimeout naming `what`, as a blocking read
// under the socket's own timeout would: a peer that went silent fails in the I/O timeout
// however far off the caller's deadline is.
bool wait_readable(int fd, std::chrono::steady_clock::time_point deadline, int io_timeout_ms,
                   const std::string& what);
void send_all(int fd, const void* data, size_t size, const std::string& what);

// Reads with a small buffer in front so that headers and small payloads cost one syscall, while
// large payloads go straight from the socket into the destination (no staging copy).
class SocketReader {
 public:
  SocketReader(int fd, std::string what);
  // Fills dst with exactly size bytes. With at_frame_boundary, an idle socket waits forever
  // (a quiet connection is not an error); otherwise the socket's timeout applies.
  // read_ahead: at most this many bytes are read into the buffer beyond `size` (a header whose
  // large payload should go straight to its destination reads none ahead).
  void read_exact(void* dst, size_t size, bool at_frame_boundary = false, size_t read_ahead = SIZE_MAX);
  // Reads and throws away size bytes (a refused WRITE's payload).
  void discard(size_t size);
  // True when unread bytes are already buffered or waiting in the socket.
  bool has_pending() const;
  size_t buffered() const { return end_ - begin_; }

 private:
  size_t fill(bool wait_forever, size_t max_bytes);
  int fd_;
  std::string what_;
  std::unique_ptr<uint8_t[]> buf_;
  size_t begin_ = 0;
  size_t end_ = 0;
};

}  // namespace tidekv
