// SPDX-License-Identifier: MIT
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/core/error.hpp"
#include "pulley/core/log.hpp"
#include "pulley/client/heartbeat.hpp"
#include "pulley/core/metrics.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/transport/metrics_endpoint.hpp"

/// What a running job tells the people who watch it: its figures (Metrics) as JSON lines in
/// a file and in Prometheus' format on an HTTP port, and the chief's progress line.

namespace pulley {

/// Where the role runner reports a task's figures (the flags of add_metrics_flags).
struct MetricsOptions {
  /// A file each interval's figures are appended to, a JSON object per task and line
  /// ("": none). "{task}" in it is replaced by the task ("worker-0"; "in-process"), so the
  /// tasks of one host can share a flag; tasks that share a file append whole lines.
  std::string file;
  /// Serve the figures on this port (Prometheus' text format at /metrics); nullopt: none.
  /// In a cluster of processes, task i listens on port + i, counting the ps tasks first,
  /// then the chief, the workers and the evaluators (`metrics_port_offset`); a task that
  /// joins a running job takes a port the system picks (kAnyMetricsPort); 0: every task a
  /// port the system picks, logged.
  std::optional<std::uint16_t> port;
  /// The address the port is bound to. Loopback by default: the figures are not secret
  /// but not authenticated either; "0.0.0.0" lets a monitoring host scrape them.
  std::string bind = "127.0.0.1";
  /// How often the figures are taken (a counter's rate and a mean are over it).
  std::chrono::milliseconds interval{std::chrono::seconds(5)};
  /// How often the chief prints its progress line (0: never). On a terminal the line is
  /// rewritten in place; in a log it is one line per interval.
  std::chrono::milliseconds progress{std::chrono::seconds(10)};

  /// True when figures go anywhere.
  [[nodiscard]] bool enabled() const noexcept { return !file.empty() || port.has_value(); }
};

/// Records a ps's counters as figures of `task`: its global step, the pushes it took,
/// refused and dropped as stale, lost and returned workers, bytes in (gradients) and out
/// (parameters), the time spent applying updates and the requests waiting in its queue.
inline void record_stats(Metrics& metrics, std::string_view task, const Stats& s) {
  const auto d = [](std::int64_t v) { return static_cast<double>(v); };
  metrics.set(task, "global_step", d(s.global_step));
  constexpr MetricKind kRate = MetricKind::kRate;
  metrics.count(task, "pushes_taken", d(s.pushes_taken), kRate);
  metrics.count(task, "pushes_repeated", d(s.pushes_repeated));
  metrics.count(task, "updates_applied", d(s.updates_applied), kRate);
  metrics.count(task, "updates_refused", d(s.updates_refused));
  metrics.count(task, "stale_gradients_dropped", d(s.stale_gradients_dropped));
  metrics.count(task, "requests_rejected", d(s.requests_rejected));
  metrics.count(task, "workers_lost", d(s.workers_lost));
  metrics.count(task, "workers_returned", d(s.workers_returned));
  metrics.count(task, "bytes_in", d(s.bytes_pushed), kRate);
  metrics.count(task, "bytes_out", d(s.bytes_pulled), kRate);
  metrics.count(task, "apply_seconds", d(s.apply_microseconds) * 1e-6, kRate);  // per s: the share of time
  metrics.set(task, "queue_length", d(s.requests_waiting));
  metrics.set(task, "table_rows", d(s.table_rows));
}

/// Logs `text` at warning level the first time `key` is seen in this process.
inline void warn_once(const std::string& key, const std::string& text) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  {
    std::scoped_lock lock(mutex);
    if (!seen.insert(key).second) return;
  }
  log(LogLevel::kWarning, text);
}

/// The scores one evaluation reports (`Evaluation::report`, which `reporter()` makes):
/// `commit()`, called once `evaluate` returned, records them in `metrics` as gauges of
/// `task`, together with the evaluation's step (`evaluation_step`), so that no output shows
/// a step beside another evaluation's scores. A score that cannot be a figure (its name is
/// not [a-zA-Z_][a-zA-Z0-9_]*, or is a figure of another kind) is left out with a warning,
/// logged once: a score never fails the job, whether metrics are on or not.
class EvaluationScores {
 public:
  /// @param metrics where the scores go; null: nowhere (names are still checked)
  EvaluationScores(Metrics* metrics, std::string task, std::int64_t step)
      : metrics_(metrics), task_(std::move(task)), step_(step) {}

  /// What `Evaluation::report` is for this evaluation; valid while this object lives.
  std::function<void(std::string_view, double)> reporter() {
    return [this](std::string_view name, double value) {
      if (!Metrics::valid_name(name)) {
        warn_once("name " + std::string(name), "metrics: the score '" + std::string(name) +
                                                   "' is left out: a name is [a-zA-Z_][a-zA-Z0-9_]*, not time or task");
        return;
      }
      scores_.emplace_back(name, value);
    };
  }

  /// Records the scores reported and the step (nothing without metrics, or when none was).
  void commit() noexcept {
    if (metrics_ == nullptr || scores_.empty()) return;
    try {
      scores_.emplace_back("evaluation_step", static_cast<double>(step_));
      try {
        metrics_->set(task_, scores_);
      } catch (const Error&) {  // one of them clashes: the others still go
        for (const auto& [name, value] : scores_) {
          try {
            metrics_->set(task_, name, value);
          } catch (const Error& e) {
            warn_once("kind " + name, "metrics: the score '" + name + "' is left out: " + e.message());
          }
        }
      }
    } catch (const std::exception&) {  // no memory: the figures are not worth the job
    }
    scores_.clear();
  }

 private:
  Metrics* metrics_;
  std::string task_;
  std::int64_t step_;
  std::vector<std::pair<std::string, double>> scores_;
};

/// The port offset that asks for a port the system picks (logged): a task that joins a
/// running job takes one, since the offsets count the tasks the job started with and a
/// joiner's own spec counts it among them (a ps that joins would take the chief's port, a
/// worker an evaluator's).
inline constexpr std::uint32_t kAnyMetricsPort = std::numeric_limits<std::uint32_t>::max();

/// The port offset of a task of a cluster (MetricsOptions::port): its position counting the
/// ps tasks first, then the chief, the workers and the evaluators; kAnyMetricsPort for a task
/// that `joined` a running job.
inline std::uint32_t metrics_port_offset(std::string_view type, std::uint32_t index, std::uint32_t num_ps,
                                         std::uint32_t num_chiefs, std::uint32_t num_workers, bool joined = false) {
  if (joined) return kAnyMetricsPort;
  if (type == "ps") return index;
  if (type == "chief") return num_ps + index;
  if (type == "worker") return num_ps + num_chiefs + index;
  return num_ps + num_chiefs + num_workers + index;  // evaluator
}

/// The figures of one process (every task in it) and where they go: each
/// `MetricsOptions::interval` it closes the interval and appends the JSON lines to the
/// file; it serves the Prometheus format on the port. The last figures are written when it
/// is destroyed, so the file ends with the job's end. Without a file or a port it does
/// nothing, and `metrics()` is still there to record into.
class MetricsReporter {
 public:
  /// @param process  replaces "{task}" in the file name ("worker-0", "in-process")
  /// @param port_offset added to the port (metrics_port_offset); kAnyMetricsPort: a port
  ///                    the system picks
  MetricsReporter(MetricsOptions options, std::string_view process, std::uint32_t port_offset = 0)
      : options_(std::move(options)) {
    if (!options_.enabled()) return;
    if (options_.interval.count() <= 0) throw Error(ErrorCode::kInvalidArgument, "metrics: the interval must be positive");
    if (options_.port) {
      const bool joined = port_offset == kAnyMetricsPort;
      const std::uint32_t port = *options_.port == 0 || joined ? 0 : *options_.port + port_offset;
      if (port > 65535) {
        throw Error(ErrorCode::kInvalidArgument, "metrics: port " + std::to_string(*options_.port) + " + " +
                                                     std::to_string(port_offset) + " is over 65535");
      }
      endpoint_ = std::make_unique<MetricsEndpoint>(options_.bind, static_cast<std::uint16_t>(port),
                                                     [this] { return metrics_.prometheus(); });
      log(LogLevel::kInfo, "metrics: http://" + options_.bind + ":" + std::to_string(endpoint_->port()) + "/metrics" +
                               (joined && *options_.port != 0
                                    ? " (a task that joins a running job takes a port the system picks)"
                                    : ""));
    }
    if (!options_.file.empty()) {  // last: nothing after it throws, so it is never left open
      std::string path = options_.file;
      for (std::size_t at; (at = path.find("{task}")) != std::string::npos;) path.replace(at, 6, process);
      fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (fd_ < 0) {
        throw Error(ErrorCode::kInvalidArgument, "metrics: cannot open " + path + ": " + std::strerror(errno));
      }
      path_ = path;
    }
    thread_ = std::thread([this] { loop(); });
  }

  MetricsReporter(const MetricsReporter&) = delete;
  MetricsReporter& operator=(const MetricsReporter&) = delete;

  ~MetricsReporter() {
    if (thread_.joinable()) {
      {
        std::scoped_lock lock(mutex_);
        stopping_ = true;
      }
      wake_.notify_all();
      thread_.join();
    }
    endpoint_.reset();
    if (fd_ >= 0) ::close(fd_);
  }

  /// What the tasks of this process record into.
  [[nodiscard]] Metrics& metrics() noexcept { return metrics_; }
  /// True when the figures go anywhere (a task may skip work that only feeds them).
  [[nodiscard]] bool enabled() const noexcept { return options_.enabled(); }
  /// The port it serves on, once listening (0: none).
  [[nodiscard]] std::uint16_t port() const { return endpoint_ ? endpoint_->port() : 0; }
  /// The options it was made with.
  [[nodiscard]] const MetricsOptions& options() const noexcept { return options_; }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    for (bool last = false; !last;) {
      wake_.wait_for(lock, options_.interval, [this] { return stopping_; });
      last = stopping_;
      lock.unlock();
      tick();
      lock.lock();
    }
  }

  /// Closes the interval and appends its lines to the file (one write: lines of tasks
  /// that share the file stay whole).
  void tick() {
    metrics_.close_interval();
    if (fd_ < 0) return;
    const double unix_seconds =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    const std::string lines = metrics_.json_lines(unix_seconds);
    if (lines.empty()) return;
    if (::write(fd_, lines.data(), lines.size()) != static_cast<ssize_t>(lines.size()) && !warned_) {
      warned_ = true;
      log(LogLevel::kWarning, "metrics: writing " + path_ + " failed: " + std::strerror(errno));
    }
  }

  MetricsOptions options_;
  Metrics metrics_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
  int fd_ = -1;
  std::string path_;
  bool warned_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

/// The chief's view of training as it goes, read from what its heartbeats bring back (each
/// ps's counters, and when: a Beat): every tick it records the global step (the slowest
/// ps's), the examples trained since it started and the examples/s (see `sample`) into
/// `metrics` (task "chief"), and every
/// `MetricsOptions::progress` prints the progress line
///   chief: global step 1234 of 9370 (epoch 2 of 10), 118402 examples/s, 1 min 12 s left
/// rewritten in place when stderr is a terminal, else logged.
class ChiefProgress {
 public:
  using Clock = std::chrono::steady_clock;

  /// What the last heartbeats answered brought: each ps's counters, and when.
  using Beat = HeartbeatReplies;

  /// @param beat             the last heartbeat answered
  /// @param metrics          where the figures go (null: only the progress line)
  /// @param last_step        where training ends
  /// @param samples_per_step examples a global step trains (0: no examples/s)
  /// @param steps_per_epoch  global steps an epoch has (0: no epoch shown)
  ChiefProgress(std::function<Beat()> beat, Metrics* metrics, const MetricsOptions& options, std::int64_t last_step,
                std::int64_t samples_per_step, std::int64_t steps_per_epoch)
      : beat_(std::move(beat)), metrics_(metrics), progress_(options.progress), last_step_(last_step),
        samples_per_step_(samples_per_step), steps_per_epoch_(steps_per_epoch),
        terminal_(::isatty(STDERR_FILENO) == 1) {
    if (metrics_ != nullptr && options.enabled()) tick_ = std::min(tick_, options.interval);
    if (progress_.count() > 0) tick_ = std::min(tick_, progress_);
    if (metrics_ == nullptr && progress_.count() <= 0) return;
    thread_ = std::thread([this] { loop(); });
  }

  ChiefProgress(const ChiefProgress&) = delete;
  ChiefProgress& operator=(const ChiefProgress&) = delete;

  ~ChiefProgress() {
    if (!thread_.joinable()) return;
    {
      std::scoped_lock lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
    if (terminal_ && shown_) std::fputc('\n', stderr);
  }

  /// Training reached global step `step` (the chief saw it): no figure reads less from now
  /// on, though the last heartbeats may have come before it.
  void reached(std::int64_t step) { reached_ = step; }

  /// The progress line at global step `step` of `last_step`: the epoch (when
  /// `steps_per_epoch` > 0), `examples_per_s` (when > 0) and the time left at `steps_per_s`;
  /// `who` opens it (an all-reduce job's rank 0 prints it too).
  [[nodiscard]] static std::string line(std::int64_t step, std::int64_t last_step, std::int64_t steps_per_epoch,
                                        double examples_per_s, double steps_per_s, std::string_view who = "chief") {
    std::string text = std::string(who) + ": global step " + std::to_string(step) + " of " + std::to_string(last_step);
    if (steps_per_epoch > 0) {
      const std::int64_t epochs = (last_step + steps_per_epoch - 1) / steps_per_epoch;
      text += " (epoch " + std::to_string(std::min(step / steps_per_epoch + 1, epochs)) + " of " +
              std::to_string(epochs) + ")";
    }
    if (examples_per_s > 0) text += ", " + std::to_string(static_cast<long long>(examples_per_s + 0.5)) + " examples/s";
    if (steps_per_s > 0 && step < last_step) {
      const auto left = static_cast<long long>(static_cast<double>(last_step - step) / steps_per_s + 0.5);
      text += ", " + (left >= 3600 ? std::to_string(left / 3600) + " h " + std::to_string(left % 3600 / 60) + " min"
                      : left >= 60 ? std::to_string(left / 60) + " min " + std::to_string(left % 60) + " s"
                                   : std::to_string(left) + " s") +
              " left";
    }
    return text;
  }

 private:
  using Point = std::pair<std::int64_t, Clock::time_point>;  // a global step, when it was seen

  void loop() {
    std::unique_lock lock(mutex_);
    auto next_line = Clock::now() + progress_;
    for (bool last = false; !last;) {
      last = wake_.wait_for(lock, tick_, [this] { return stopping_; });
      lock.unlock();
      const auto now = Clock::now();
      const bool due = progress_.count() > 0 && now >= next_line && !last;
      if (due) next_line = now + progress_;
      sample(due);  // the last one too: the figures end where training did
      lock.lock();
    }
  }

  /// Takes the last beat's global step (the slowest ps's) and records it; prints the
  /// progress line if `line`. The rate is the step's between the last two beats that saw it
  /// move, falling while later beats see it stand still; a step that goes back (the job was
  /// rolled back to a checkpoint) starts the measure again.
  void sample(bool line) {
    const Beat beat = beat_();
    std::optional<std::int64_t> step;
    for (const std::optional<Stats>& s : beat.stats) {
      if (s) step = step ? std::min(*step, s->global_step) : s->global_step;
    }
    const std::int64_t floor = reached_;
    if (!step && floor < 0) return;
    const Point now{std::max(step.value_or(floor), floor), step ? beat.at : Clock::now()};
    if (first_ && now.first < moved_->first) {  // rolled back
      first_.reset();
      before_.reset();
      steps_per_s_ = 0.0;
    }
    if (!first_) first_ = moved_ = now;
    if (now.first != moved_->first) {  // the step moved: the rate between the two moves
      before_ = moved_;
      moved_ = now;
    }
    if (before_ && now.second > before_->second) {
      // While the step stands still, the span grows from the move before to this beat.
      const Clock::time_point until = now.first == moved_->first && now.second > moved_->second ? now.second
                                                                                               : moved_->second;
      steps_per_s_ = static_cast<double>(moved_->first - before_->first) /
                     std::chrono::duration<double>(until - before_->second).count();
    }
    if (now.first > counted_) {
      if (counted_ >= 0) examples_ += static_cast<double>((now.first - counted_) * samples_per_step_);
      counted_ = now.first;
    } else if (now.first < counted_) {
      counted_ = now.first;  // rolled back: the steps trained again are counted again
    }
    const double examples_per_s = steps_per_s_ * static_cast<double>(samples_per_step_);
    if (metrics_ != nullptr) {
      metrics_->count("chief", "examples", examples_);
      metrics_->set("chief", {{"global_step", static_cast<double>(now.first)}, {"examples_per_s", examples_per_s}});
    }
    if (line) show(now, examples_per_s);
  }

  void show(const Point& now, double examples_per_s) {
    // The time left at the rate of the whole run so far: steadier than the last beats'.
    const double since_first = std::chrono::duration<double>(now.second - first_->second).count();
    const double overall = since_first > 0 ? static_cast<double>(now.first - first_->first) / since_first : 0.0;
    const std::string text = line(now.first, last_step_, steps_per_epoch_, examples_per_s, overall);
    if (terminal_) {
      std::fprintf(stderr, "\r%s\x1b[K", text.c_str());
      std::fflush(stderr);
      shown_ = true;
    } else {
      log(LogLevel::kInfo, text);
    }
  }

  std::function<Beat()> beat_;
  Metrics* metrics_;
  std::chrono::milliseconds progress_;
  std::chrono::milliseconds tick_{1000};
  std::int64_t last_step_;
  std::int64_t samples_per_step_;
  std::int64_t steps_per_epoch_;
  bool terminal_;
  bool shown_ = false;
  std::atomic<std::int64_t> reached_{-1};  ///< reached()
  std::optional<Point> first_;   ///< the first step seen (since the last rollback)
  std::optional<Point> moved_;   ///< the last time the step was seen to move
  std::optional<Point> before_;  ///< the move before that
  double steps_per_s_ = 0.0;
  double examples_ = 0.0;        ///< examples trained since the chief started watching
  std::int64_t counted_ = -1;    ///< the step `examples_` counts to
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace pulley
