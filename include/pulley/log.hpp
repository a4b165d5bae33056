// SPDX-License-Identifier: MIT
#pragma once

#include <cstdio>
#include <functional>
#include <mutex>
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

}  // namespace pulley
