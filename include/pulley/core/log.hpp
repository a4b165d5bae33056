// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <string>
#include <string_view>
#include <utility>

namespace pulley {

/// How much a log line matters.
enum class LogLevel : unsigned char {
  kInfo,     ///< progress: a task started, training reached a step
  kWarning,  ///< something went wrong and was dealt with (a connection dropped)
  kError,    ///< a task is about to fail
};

/// Where pulley's log lines go: called with one line at a time (no trailing newline), from
/// any thread, never concurrently (calls are serialized). It must not throw.
using LogSink = std::function<void(LogLevel, std::string_view)>;

namespace detail {

struct LogState {
  std::mutex mutex;
  LogSink sink;  ///< empty: stderr
};

inline LogState& log_state() {
  static LogState state;
  return state;
}

}  // namespace detail

/// Sends pulley's log lines to `sink` instead of stderr (an empty sink restores stderr);
/// returns the sink it replaces.
inline LogSink set_log_sink(LogSink sink) {
  detail::LogState& state = detail::log_state();
  std::scoped_lock lock(state.mutex);
  return std::exchange(state.sink, std::move(sink));
}

/// Writes one log line through the sink (by default to stderr, prefixed "pulley: ").
inline void log(LogLevel level, std::string_view line) noexcept {
  detail::LogState& state = detail::log_state();
  std::scoped_lock lock(state.mutex);
  if (state.sink) {
    try {
      state.sink(level, line);
    } catch (...) {  // a log line is never worth a failure
    }
    return;
  }
  static constexpr const char* kPrefix[] = {"", "warning: ", "error: "};
  std::fprintf(stderr, "pulley: %s%.*s\n", kPrefix[static_cast<int>(level)],
               static_cast<int>(line.size()), line.data());
  std::fflush(stderr);
}

/// Passes at most `per_second` lines a second on to `log`, and counts the rest, which the
/// next line that passes reports: a flood of bad requests must not flood the log. Not
/// thread-safe: one per thread that logs through it (a ps's, a server's).
class LimitedLog {
 public:
  explicit LimitedLog(int per_second = 20) noexcept : per_second_(per_second) {}

  /// Logs `line` at `level` unless this second's allowance is spent.
  void operator()(LogLevel level, const std::string& line) noexcept {
    const auto now = std::chrono::steady_clock::now();
    if (now - window_ > std::chrono::seconds(1)) {
      window_ = now;
      used_ = 0;
    }
    if (++used_ > per_second_) {
      ++suppressed_;
      return;
    }
    if (suppressed_ == 0) return log(level, line);
    try {
      log(level, line + " (" + std::to_string(std::exchange(suppressed_, 0)) +
                     " similar lines suppressed)");
    } catch (...) {  // no memory for the longer line: the line alone
      log(level, line);
    }
  }

 private:
  int per_second_;
  std::chrono::steady_clock::time_point window_{};
  int used_ = 0;
  std::uint64_t suppressed_ = 0;
};

}  // namespace pulley
