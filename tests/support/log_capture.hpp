// SPDX-License-Identifier: MIT
#pragma once

// Captures pulley's log lines for a test to look at.

#include <chrono>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/core/log.hpp"

namespace pulley::testing {

/// Collects every log line while it lives (and restores the sink before it).
class LogCapture {
 public:
  LogCapture()
      : previous_(set_log_sink([this](LogLevel level, std::string_view line) {
          std::scoped_lock lock(mutex_);
          lines_.push_back({level, std::string(line)});
        })) {}
  ~LogCapture() { set_log_sink(previous_); }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  /// The lines of `level` that contain `text`.
  std::vector<std::string> find(LogLevel level, const std::string& text) {
    std::scoped_lock lock(mutex_);
    std::vector<std::string> found;
    for (const auto& [l, line] : lines_) {
      if (l == level && line.find(text) != std::string::npos) found.push_back(line);
    }
    return found;
  }

  /// Every line so far, one per line as stderr shows them, for a failed check to print.
  std::string text() {
    static constexpr const char* kPrefix[] = {"", "warning: ", "error: "};
    std::scoped_lock lock(mutex_);
    std::string all;
    for (const auto& [l, line] : lines_) all += kPrefix[static_cast<int>(l)] + line + '\n';
    return all;
  }

  /// Waits up to `limit` for a line of `level` containing `text`; true once there is one.
  bool wait_for(LogLevel level, const std::string& text,
                std::chrono::milliseconds limit = std::chrono::seconds(10)) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (find(level, text).empty()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<LogLevel, std::string>> lines_;
  LogSink previous_;
};

}  // namespace pulley::testing
