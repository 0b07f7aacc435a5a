#include "options.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>

#include "boundary.h"
#include "settings.gen.h"
#include "transport/registry.h"

namespace tidekv::capi {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// Reads one TIDEKV_* variable per declared setting (settings.gen.h, generated from
// tidekv.config.TransferConfig): the same names, ranges and units as Python's from_env().
struct Reader {
  template <typename T>
  void integer(const char* name, long long low, long long high, T& field) const {
    const char* v = env(name);
    if (!v) return;
    char* end = nullptr;
    errno = 0;
    long long n = std::strtoll(v, &end, 0);
    if (errno || *end || n < low || n > high)
      refuse(-1, std::string(name) + "='" + v + "' is invalid; allowed: an integer in " + std::to_string(low) +
                     ".." + std::to_string(high));
    field = static_cast<T>(n);
  }
  void seconds(const char* name, double low, double high, int& field_ms) const {
    const char* v = env(name);
    if (!v) return;
    char* end = nullptr;
    double s = std::strtod(v, &end);
    if (*end || !(s >= low && s <= high)) {
      std::ostringstream allowed;
      allowed << low << ".." << high;
      refuse(-1, std::string(name) + "='" + v + "' is invalid; allowed: seconds in " + allowed.str());
    }
    field_ms = int(s * 1000 + 0.5);
  }
  void flag(const char* name, bool& field) const {
    const char* v = env(name);
    if (!v) return;
    std::string s = v;
    for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
    if (s == "1" || s == "true" || s == "yes" || s == "on") {
      field = true;
    } else if (s == "0" || s == "false" || s == "no" || s == "off") {
      field = false;
    } else {
      refuse(-1, std::string(name) + "='" + v + "' is invalid; allowed: 1/true/yes/on or 0/false/no/off");
    }
  }
  void text(const char* name, std::string& field) const {
    if (const char* v = env(name)) field = v;
  }
};

// The same rules as tidekv.config.secret_from_env: one of the two variables, a file's trailing
// whitespace dropped, nothing empty.
std::string secret() {
  const char* raw = std::getenv("TIDEKV_SECRET");
  const char* path = env("TIDEKV_SECRET_FILE");
  if (raw && path) refuse(-1, "TIDEKV_SECRET and TIDEKV_SECRET_FILE are both set; set one");
  if (raw) {
    if (!*raw) refuse(-1, "TIDEKV_SECRET is set but empty; unset it for no secret");
    return raw;
  }
  if (!path) return {};
  std::ifstream in(path);
  if (!in) refuse(-1, std::string("TIDEKV_SECRET_FILE='") + path + "' cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  std::string s = text.str();
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  if (s.empty()) refuse(-1, std::string("TIDEKV_SECRET_FILE='") + path + "' is empty");
  return s;
}

bool is_wildcard(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

// The local address the kernel would send from on the default route (a UDP socket connected to a
// public address picks the interface without sending anything; vLLM's get_ip() asks the same).
std::string default_route_source() {
  for (const char* probe : {"8.8.8.8", "2001:4860:4860::8888"}) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_DGRAM;
    hints.ai_flags = AI_NUMERICHOST;
    addrinfo* found = nullptr;
    if (getaddrinfo(probe, "9", &hints, &found) != 0) continue;
    std::string out;
    int fd = socket(found->ai_family, SOCK_DGRAM, 0);
    if (fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
      sockaddr_storage local{};
      socklen_t len = sizeof(local);
      char text[INET6_ADDRSTRLEN] = {};
      if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
          getnameinfo(reinterpret_cast<sockaddr*>(&local), len, text, sizeof(text), nullptr, 0, NI_NUMERICHOST) == 0)
        out = text;
    }
    if (fd >= 0) close(fd);
    freeaddrinfo(found);
    if (!out.empty()) return out;
  }
  return {};
}

}  // namespace

std::string listen_host(const std::string& given) {
  // The rules of tidekv.hostaddr.advertised_host for a component with no master to route to.
  const std::pair<const char*, std::string> sources[] = {
      {"createTransferEngine's local_server_name / ip_or_host_name", given},
      {"$TIDEKV_HOST", env("TIDEKV_HOST") ? env("TIDEKV_HOST") : ""}};
  for (const auto& [name, value] : sources) {
    if (value.empty()) continue;
    if (is_wildcard(value))
      refuse(-1, std::string(name) + "='" + value + "' is a wildcard: tidekv advertises the address it listens on, "
                     "and a peer told to dial a wildcard dials itself; give this host's address (e.g. 10.0.0.5)");
    return value;
  }
  std::string found = default_route_source();
  if (found.empty()) {
    log(LogLevel::kWarning, "no host given, no $TIDEKV_HOST and no default route: the engine listens on 127.0.0.1, "
                            "where peers on other hosts cannot reach it; set TIDEKV_HOST to this host's address");
    return "127.0.0.1";
  }
  return found;
}

EngineOptions engine_options_from_env(const std::string& host) {
  EngineOptions o;
  o.host = host;
  o.port = 0;
  if (const char* t = env("TIDEKV_TRANSPORT")) {
    std::string s = t, allowed = "auto";
    bool known = s == "auto";
    for (const auto& entry : transport_registry()) {  // the transports of this build, in one list
      allowed += std::string(", ") + entry.name;
      known = known || s == entry.name;
    }
    if (!known) refuse(-1, "TIDEKV_TRANSPORT='" + s + "' is invalid; allowed: " + allowed);
    o.transport = s;
  }
  if (const char* f = env("MC_FORCE_TCP")) {
    std::string s = f;
    if (s == "1" || s == "true" || s == "True" || s == "TRUE") {
      o.transport = "tcp";
    } else if (s != "0" && s != "false" && s != "False" && s != "FALSE") {
      refuse(-1, "MC_FORCE_TCP='" + s + "' is invalid; allowed: 1/true or 0/false");
    }
  }
  read_declared_settings(Reader{}, o);
  if (const char* v = env("TIDEKV_LOG_LEVEL")) {
    std::string s = v;
    if (s != "DEBUG" && s != "INFO" && s != "WARNING" && s != "ERROR")
      refuse(-1, "TIDEKV_LOG_LEVEL='" + s + "' is invalid; allowed: DEBUG, INFO, WARNING, ERROR");
  }
  o.secret = secret();
  return o;
}

LogLevel log_threshold() {
  static const LogLevel level = [] {
    const char* v = env("TIDEKV_LOG_LEVEL");
    std::string s = v ? v : "WARNING";
    if (s == "DEBUG") return LogLevel::kDebug;
    if (s == "INFO") return LogLevel::kInfo;
    if (s == "ERROR") return LogLevel::kError;
    return LogLevel::kWarning;  // an unknown name fails createTransferEngine (engine_options_from_env)
  }();
  return level;
}

}  // namespace tidekv::capi
