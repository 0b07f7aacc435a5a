#include "common/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <climits>
#include <atomic>
#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/errors.h"

namespace tidekv {
namespace {

constexpr size_t kReaderBuffer = 64 << 10;
constexpr size_t kDirectThreshold = 16 << 10;  // payloads this large go straight to their destination

std::string errno_text(int err) { return std::string(std::strerror(err)); }

[[noreturn]] void throw_io(int err, const std::string& what, const char* action) {
  if (err == EAGAIN || err == EWOULDBLOCK)
    TIDEKV_THROW(kTimeout, std::string(action) + " " + what + " timed out");
  TIDEKV_THROW(kPeerUnavailable, std::string(action) + " " + what + " failed: " + errno_text(err));
}

}  // namespace

void tune_socket(int fd, const SocketOptions& options) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  if (options.buffer_bytes > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &options.buffer_bytes, sizeof(options.buffer_bytes));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &options.buffer_bytes, sizeof(options.buffer_bytes));
  }
  if (options.io_timeout_ms > 0) {
    timeval tv{options.io_timeout_ms / 1000, (options.io_timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  }
}

int listen_tcp(const std::string& host, int port, int* bound_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) TIDEKV_THROW(kConfig, "cannot resolve bind host '" + host + "': " + gai_strerror(rc));
  int fd = -1;
  int last_err = 0;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) { last_err = errno; continue; }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 512) == 0) break;
    last_err = errno;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0)
    TIDEKV_THROW(kConfig, "cannot listen on " + host + ":" + std::to_string(port) + ": " + errno_text(last_err));
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *bound_port = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                           : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

int connect_tcp(const std::string& host, int port, const SocketOptions& options) {
  std::string what = host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) TIDEKV_THROW(kPeerUnavailable, "cannot resolve peer " + what + ": " + gai_strerror(rc));
  int fd = -1;
  int last_err = 0;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) { last_err = errno; continue; }
    tune_socket(fd, options);  // buffer sizes must be set before connect to take effect
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) break;
    if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int timeout = options.io_timeout_ms > 0 ? std::min(options.io_timeout_ms, 10000) : 10000;
      if (poll(&p, 1, timeout) == 1) {
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err == 0) break;
        last_err = err;
      } else {
        last_err = ETIMEDOUT;
      }
    } else {
      last_err = errno;
    }
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) TIDEKV_THROW(kPeerUnavailable, "cannot connect to peer " + what + ": " + errno_text(last_err));
  int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

void send_all(int fd, struct iovec* iov, int count, const std::string& what) {
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = std::min(count, int(IOV_MAX));
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_io(errno, what, "sending to");
    }
    size_t left = size_t(n);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
}

namespace {

using Clock = std::chrono::steady_clock;

// Polls fd for `events` until `deadline` or, first, `io_timeout_ms` from now (0: no limit).
// True: ready (or an error the next call reports); false: the deadline passed; kTimeout: the
// I/O timeout did.
bool poll_until(int fd, short events, Clock::time_point deadline, int io_timeout_ms, const std::string& what,
                const char* action) {
  bool io_first = false;
  if (io_timeout_ms > 0) {
    auto io_limit = Clock::now() + std::chrono::milliseconds(io_timeout_ms);
    if (io_limit < deadline) {
      deadline = io_limit;
      io_first = true;
    }
  }
  for (;;) {
    auto left = deadline - Clock::now();
    if (left < Clock::duration::zero()) left = Clock::duration::zero();
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{time_t(ns / 1000000000), long(ns % 1000000000)};
    pollfd p{fd, events, 0};
    int rc = ppoll(&p, 1, &ts, nullptr);
    if (rc > 0) return true;
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) return true;  // the next call on fd reports it
    if (io_first) throw_io(EAGAIN, what, action);
    return false;
  }
}

}  // namespace

bool send_until(int fd, struct iovec* iov, int count, int* next,
                const std::optional<std::chrono::steady_clock::time_point>& deadline, int io_timeout_ms,
                const std::string& what) {
  if (!deadline) {
    send_all(fd, iov + *next, count - *next, what);
    *next = count;
    return true;
  }
  while (*next < count) {
    msghdr msg{};
    msg.msg_iov = iov + *next;
    msg.msg_iovlen = std::min(count - *next, int(IOV_MAX));
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) throw_io(errno, what, "sending to");
      if (Clock::now() >= *deadline) return false;
      if (!poll_until(fd, POLLOUT, *deadline, io_timeout_ms, what, "sending to")) return false;
      continue;
    }
    size_t sent = size_t(n);
    while (*next < count && sent >= iov[*next].iov_len) {
      sent -= iov[*next].iov_len;
      ++*next;
    }
    if (*next < count) {
      iov[*next].iov_base = static_cast<uint8_t*>(iov[*next].iov_base) + sent;
      iov[*next].iov_len -= sent;
    }
  }
  return true;
}

bool spin_until_readable(int fd, int spin_us) {
  // At most one spinning thread per process: with several connections busy on a 2-core
  // machine, spinners would steal the cores that the threads doing the copies need.
  static std::atomic<int> spinners{0};
  if (spin_us <= 0 || spinners.fetch_add(1, std::memory_order_acq_rel) != 0) {
    spinners.fetch_sub(1, std::memory_order_acq_rel);
    return false;
  }
  auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  pollfd p{fd, POLLIN, 0};
  bool ready = false;
  do {
    if (poll(&p, 1, 0) > 0) {
      ready = true;
      break;
    }
    sched_yield();  // keeps the core from idling, but hands it over to any thread that has work
  } while (std::chrono::steady_clock::now() < until);
  spinners.fetch_sub(1, std::memory_order_acq_rel);
  return ready;
}

bool wait_readable(int fd, std::chrono::steady_clock::time_point deadline, int io_timeout_ms,
                   const std::string& what) {
  return poll_until(fd, POLLIN, deadline, io_timeout_ms, what, "receiving from");
}

void send_all(int fd, const void* data, size_t size, const std::string& what) {
  iovec iov{const_cast<void*>(data), size};
  send_all(fd, &iov, 1, what);
}

SocketReader::SocketReader(int fd, std::string what)
    : fd_(fd), what_(std::move(what)), buf_(new uint8_t[kReaderBuffer]) {}

size_t SocketReader::fill(bool wait_forever, size_t max_bytes) {
  for (;;) {
    ssize_t n = recv(fd_, buf_.get() + end_, std::min(kReaderBuffer - end_, max_bytes), 0);
    if (n > 0) {
      end_ += size_t(n);
      return size_t(n);
    }
    if (n == 0 && wait_forever) TIDEKV_THROW(kHangup, "connection to " + what_ + " closed");
    if (n == 0) TIDEKV_THROW(kPeerUnavailable, "connection to " + what_ + " closed");
    if (errno == EINTR) continue;
    if ((errno == EAGAIN || errno == EWOULDBLOCK) && wait_forever) continue;
    throw_io(errno, what_, "receiving from");
  }
}

void SocketReader::read_exact(void* dst, size_t size, bool at_frame_boundary, size_t read_ahead) {
  auto* out = static_cast<uint8_t*>(dst);
  size_t buffered = end_ - begin_;
  size_t take = std::min(buffered, size);
  std::memcpy(out, buf_.get() + begin_, take);
  begin_ += take;
  out += take;
  size -= take;
  if (begin_ == end_) begin_ = end_ = 0;
  bool idle = at_frame_boundary && take == 0;
  while (size > 0) {
    if (size >= kDirectThreshold) {
      ssize_t n = recv(fd_, out, size, MSG_WAITALL);
      if (n > 0) {
        out += n;
        size -= size_t(n);
        continue;
      }
      if (n == 0) TIDEKV_THROW(kPeerUnavailable, "connection to " + what_ + " closed mid-frame");
      if (errno == EINTR) continue;
      throw_io(errno, what_, "receiving from");
    }
    fill(idle, read_ahead == SIZE_MAX ? SIZE_MAX : size + read_ahead);
    idle = false;
    take = std::min(end_ - begin_, size);
    std::memcpy(out, buf_.get() + begin_, take);
    begin_ += take;
    out += take;
    size -= take;
    if (begin_ == end_) begin_ = end_ = 0;
  }
}

void SocketReader::discard(size_t size) {
  uint8_t scratch[16 << 10];
  while (size > 0) {
    size_t n = std::min(size, sizeof(scratch));
    read_exact(scratch, n);
    size -= n;
  }
}

bool SocketReader::has_pending() const {
  if (end_ > begin_) return true;
  int available = 0;
  return ioctl(fd_, FIONREAD, &available) == 0 && available > 0;
}

}  // namespace tidekv
