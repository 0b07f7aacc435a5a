// Log records from native threads, drained by a Python thread that hands them to `logging`.
// Native code never calls into Python from its own threads; it only queues (bounded) here.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace tidekv {

enum class LogLevel : int { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40 };

class LogSink {
 public:
  void emit(LogLevel level, std::string message) {
    std::lock_guard<std::mutex> lock(mu_);
    if (records_.size() >= kMaxRecords) {
      ++dropped_;
      return;
    }
    records_.emplace_back(level, std::move(message));
    cv_.notify_one();
  }
  // Emits only the first time `key` is seen (e.g. a fallback that would repeat per request).
  void emit_once(const std::string& key, LogLevel level, std::string message) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!once_.insert(key).second) return;
    }
    emit(level, std::move(message));
  }
  // Emits at most once per `interval` for `key`, with the number of records held back since.
  void emit_every(const std::string& key, std::chrono::steady_clock::duration interval, LogLevel level,
                  std::string message) {
    auto now = std::chrono::steady_clock::now();
    uint64_t held = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& t = every_[key];
      if (t.count > 0 && now - t.last < interval) {
        ++t.held;
        return;
      }
      held = t.held;
      t = {now, t.count + 1, 0};
    }
    if (held) message += " (" + std::to_string(held) + " more like this since the last report)";
    emit(level, std::move(message));
  }
  // Waits up to timeout_ms for records; returns them (and a note of any dropped ones).
  std::vector<std::pair<LogLevel, std::string>> drain(int timeout_ms) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return !records_.empty() || closed_; });
    std::vector<std::pair<LogLevel, std::string>> out(records_.begin(), records_.end());
    records_.clear();
    if (dropped_) {
      out.emplace_back(LogLevel::kWarning, std::to_string(dropped_) + " native log records dropped (queue full)");
      dropped_ = 0;
    }
    return out;
  }
  void close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }

 private:
  static constexpr size_t kMaxRecords = 1000;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<LogLevel, std::string>> records_;
  std::set<std::string> once_;
  struct Every {
    std::chrono::steady_clock::time_point last;
    uint64_t count;
    uint64_t held;
  };
  std::map<std::string, Every> every_;
  uint64_t dropped_ = 0;
  bool closed_ = false;
};

}  // namespace tidekv
