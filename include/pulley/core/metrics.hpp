// SPDX-License-Identifier: MIT
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pulley/core/error.hpp"

namespace pulley {

/// How a figure of Metrics reads.
enum class MetricKind {
  kCounter,  ///< only grows (workers lost)
  kRate,     ///< a counter also reported as its rate per second, `<name>_per_s` (steps)
  kGauge,    ///< a value now (the global step, the ps's queue)
  kMean,     ///< the mean of the values observed in the last interval (the loss)
};

/// The figures of the tasks of one process, thread-safe: each task records what it does
/// under its name ("worker:0"), and every interval `close_interval` turns them into what
/// the outputs print: a kRate counter's rate, a mean's average of the values observed in
/// the interval. Two outputs read the last closed interval:
///   - `json_lines`: one JSON object per task ({"time": ..., "task": "worker:0", "step":
///     ..., "loss": ...}), what `--metrics-file` appends;
///   - `prometheus`: Prometheus' text exposition format (version 0.0.4), each figure
///     `pulley_<name>{task="worker:0"}`, what `--metrics-port` serves.
/// A name is a Prometheus metric name without the prefix ([a-zA-Z_][a-zA-Z0-9_]*), has one
/// kind in the whole process (Prometheus types a name once), and is not "time", "task" or
/// the `<name>_per_s` of a kRate counter; anything else is refused (kInvalidArgument).
///
/// A rate is measured between samples, not between closes: a counter that `add` grows is
/// sampled at each call (no call in an interval: rate 0); one that `count` sets from a count
/// kept elsewhere (a ps's Stats, which arrive with its heartbeats) at each `count`, and keeps
/// its rate through an interval with no new sample.
class Metrics {
 public:
  using Clock = std::chrono::steady_clock;

  /// @param now the clock rates are measured by (tests give their own)
  explicit Metrics(std::function<Clock::time_point()> now = Clock::now) : now_(std::move(now)) {}

  /// Sets gauge `name` of `task` to `value`.
  void set(std::string_view task, std::string_view name, double value) {
    record(task, name, MetricKind::kGauge, false, [&](Figure& f) { f.value = value; });
  }
  /// Sets several gauges of `task` at once: no output shows some of them changed and not
  /// the others (an evaluation's scores and its step).
  void set(std::string_view task, const std::vector<std::pair<std::string, double>>& values) {
    std::scoped_lock lock(mutex_);
    for (const auto& [name, value] : values) check(name, MetricKind::kGauge);
    for (const auto& [name, value] : values) {
      figure(task, name, MetricKind::kGauge, false).value = value;
    }
  }
  /// Adds `delta` (≥ 0) to counter `name` of `task` (`kind`: kCounter, or kRate to report
  /// its rate too).
  void add(std::string_view task, std::string_view name, double delta, MetricKind kind = MetricKind::kCounter) {
    record(task, name, counter(kind), false, [&](Figure& f) {
      f.value += delta;
      f.sampled = now_();
    });
  }
  /// Sets counter `name` of `task` to `total`, a count kept elsewhere (a ps's Stats).
  void count(std::string_view task, std::string_view name, double total, MetricKind kind = MetricKind::kCounter) {
    record(task, name, counter(kind), true, [&](Figure& f) {
      f.value = total;
      f.sampled = now_();
      if (std::isnan(f.rated)) {  // the first sample: rates start from it, not from 0
        f.rated = total;
        f.rated_at = f.sampled;
      }
    });
  }
  /// Observes `value` for mean `name` of `task`: the interval's mean is reported.
  void observe(std::string_view task, std::string_view name, double value) {
    record(task, name, MetricKind::kMean, false, [&](Figure& f) {
      f.sum += value;
      ++f.observed;
    });
  }

  /// Ends the interval: each kRate counter's rate is its growth between its sample at the
  /// last close and its newest sample, over the time between them; each mean is the average
  /// of what was observed since (a mean with nothing observed keeps its last value).
  void close_interval() {
    std::scoped_lock lock(mutex_);
    for (auto& [key, f] : figures_) {
      if (f.kind == MetricKind::kRate) {
        if (f.sampled > f.rated_at) {
          f.rate = (f.value - f.rated) / std::chrono::duration<double>(f.sampled - f.rated_at).count();
          f.rated = f.value;
          f.rated_at = f.sampled;
        } else if (!f.by_total) {
          f.rate = 0.0;  // nothing was added
        }
      } else if (f.kind == MetricKind::kMean && f.observed > 0) {
        f.value = f.sum / static_cast<double>(f.observed);
        f.sum = 0;
        f.observed = 0;
      }
    }
    ++intervals_;
  }

  /// Intervals closed so far.
  [[nodiscard]] std::uint64_t intervals() const {
    std::scoped_lock lock(mutex_);
    return intervals_;
  }

  /// The value of figure `name` of `task` as the outputs print it (a counter's total, a
  /// mean's last closed interval; `<name>_per_s` a kRate counter's rate); NaN when it was
  /// never recorded.
  [[nodiscard]] double value(std::string_view task, std::string_view name) const {
    std::scoped_lock lock(mutex_);
    if (const auto it = figures_.find(Key{std::string(task), std::string(name)}); it != figures_.end()) {
      return it->second.value;
    }
    if (name.ends_with("_per_s")) {
      const auto it = figures_.find(Key{std::string(task), std::string(name.substr(0, name.size() - 6))});
      if (it != figures_.end() && it->second.kind == MetricKind::kRate) return it->second.rate;
    }
    return std::nan("");
  }

  /// One JSON object per task, a line each, as of the last closed interval: "time" (Unix
  /// seconds, `unix_seconds`), "task", then each figure by name (a kRate counter also as
  /// `<name>_per_s`); a mean never observed, or a value not finite, is null.
  [[nodiscard]] std::string json_lines(double unix_seconds) const {
    std::scoped_lock lock(mutex_);
    std::string out;
    std::string_view task;
    char time[32];
    std::snprintf(time, sizeof time, "%.3f", unix_seconds);
    for (const auto& [key, f] : figures_) {
      if (out.empty() || key.first != task) {
        if (!out.empty()) out += "}\n";
        task = key.first;
        out += "{\"time\":" + std::string(time) + ",\"task\":" + json_string(task);
      }
      out += ",\"" + key.second + "\":" + json_number(f.value);
      if (f.kind == MetricKind::kRate) out += ",\"" + key.second + "_per_s\":" + json_number(f.rate);
    }
    if (!out.empty()) out += "}\n";
    return out;
  }

  /// Prometheus' text format: per figure a `# TYPE` line (counter or gauge) and one sample
  /// per task, `pulley_<name>{task="..."} <value>`; a kRate counter's rate is the gauge
  /// `pulley_<name>_per_s`. Figures never recorded do not appear.
  [[nodiscard]] std::string prometheus() const {
    std::scoped_lock lock(mutex_);
    std::map<std::string, std::map<std::string, const Figure*>> by_name;  // name, task
    for (const auto& [key, f] : figures_) by_name[key.second][key.first] = &f;
    std::string out;
    for (const auto& [name, tasks] : by_name) {
      const MetricKind kind = kinds_.at(name);
      const bool counter = kind == MetricKind::kCounter || kind == MetricKind::kRate;
      out += "# TYPE pulley_" + name + (counter ? " counter\n" : " gauge\n");
      for (const auto& [task, f] : tasks) out += "pulley_" + name + "{task=" + label(task) + "} " + sample(f->value) + "\n";
      if (kind != MetricKind::kRate) continue;
      out += "# TYPE pulley_" + name + "_per_s gauge\n";
      for (const auto& [task, f] : tasks) out += "pulley_" + name + "_per_s{task=" + label(task) + "} " + sample(f->rate) + "\n";
    }
    return out;
  }

  /// True if `name` may name a figure: [a-zA-Z_][a-zA-Z0-9_]*, and not "time" or "task".
  [[nodiscard]] static bool valid_name(std::string_view name) noexcept {
    if (name.empty() || (name[0] >= '0' && name[0] <= '9') || name == "time" || name == "task") return false;
    for (const char c : name) {
      if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
    }
    return true;
  }

 private:
  struct Figure {
    MetricKind kind = MetricKind::kGauge;
    bool by_total = false;        ///< set by `count` (else by `add`)
    double value = std::nan("");  ///< the gauge, the counter's total, the mean's last interval
    double rate = 0.0;            ///< kRate: per second, between the last two rated samples
    double rated = 0.0;           ///< kRate: the total at the last rated sample ...
    Clock::time_point rated_at;   ///< ... taken then
    Clock::time_point sampled;    ///< kRate: when the total was last changed
    double sum = 0.0;             ///< a mean: observed since the last close
    std::uint64_t observed = 0;
  };
  using Key = std::pair<std::string, std::string>;  // task, name

  template <class Change>
  void record(std::string_view task, std::string_view name, MetricKind kind, bool by_total, Change&& change) {
    std::scoped_lock lock(mutex_);
    check(name, kind);
    change(figure(task, name, kind, by_total));
  }

  /// Throws unless `name` may be recorded as `kind` (mutex_ held).
  void check(std::string_view name, MetricKind kind) const {
    if (!valid_name(name)) {
      throw Error(ErrorCode::kInvalidArgument, "metric name '" + std::string(name) +
                                                   "' is not [a-zA-Z_][a-zA-Z0-9_]*, or is \"time\" or \"task\"");
    }
    const auto clash = [&](const std::string& other, const char* why) {
      throw Error(ErrorCode::kInvalidArgument, "metric '" + std::string(name) + "' " + why + " '" + other + "'");
    };
    if (const auto it = kinds_.find(name); it != kinds_.end() && it->second != kind) {
      clash(std::string(name), "was recorded as another kind before, as");
    }
    if (name.ends_with("_per_s")) {
      const std::string base(name.substr(0, name.size() - 6));
      if (const auto it = kinds_.find(base); it != kinds_.end() && it->second == MetricKind::kRate) {
        clash(base, "is the rate of the counter");
      }
    }
    if (kind == MetricKind::kRate && kinds_.contains(std::string(name) + "_per_s")) {
      clash(std::string(name) + "_per_s", "would have a rate named as the figure");
    }
  }

  /// The figure of `task` named `name`, made if new (mutex_ held, `check` passed).
  Figure& figure(std::string_view task, std::string_view name, MetricKind kind, bool by_total) {
    auto [it, added] = figures_.try_emplace(Key{std::string(task), std::string(name)});
    Figure& f = it->second;
    if (added) {
      kinds_.try_emplace(std::string(name), kind);
      f.kind = kind;
      f.by_total = by_total;
      if (kind == MetricKind::kCounter || kind == MetricKind::kRate) {
        f.value = 0.0;
        f.rated_at = f.sampled = now_();
      }
    }
    if (added && by_total) f.rated = std::nan("");  // see `count`
    return f;
  }

  /// `kind` if it is a counter's; throws otherwise.
  static MetricKind counter(MetricKind kind) {
    if (kind != MetricKind::kCounter && kind != MetricKind::kRate) {
      throw Error(ErrorCode::kInvalidArgument, "a counter's kind is kCounter or kRate");
    }
    return kind;
  }

  /// A number as JSON and Prometheus both read it: an integer exactly, else 10 digits.
  static std::string number(double v) {
    char text[32];
    if (v == std::floor(v) && std::fabs(v) < 9.0e15) {
      std::snprintf(text, sizeof text, "%.0f", v);
    } else {
      std::snprintf(text, sizeof text, "%.10g", v);
    }
    return text;
  }
  /// A JSON number; null when not finite.
  static std::string json_number(double v) { return std::isfinite(v) ? number(v) : "null"; }
  /// A Prometheus sample value (NaN, +Inf and -Inf as Prometheus writes them).
  static std::string sample(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
    return number(v);
  }
  /// `text` as a JSON string.
  static std::string json_string(std::string_view text) {
    std::string out = "\"";
    for (const char c : text) {
      if (c == '\\' || c == '"') {
        out += '\\';
        out += c;
      } else if (c == '\n') {
        out += "\\n";
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char escaped[8];
        std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(c));
        out += escaped;
      } else {
        out += c;
      }
    }
    return out + "\"";
  }
  /// `text` as a Prometheus label value: only '\\', '"' and newline are escaped.
  static std::string label(std::string_view text) {
    std::string out = "\"";
    for (const char c : text) {
      if (c == '\\' || c == '"') out += '\\';
      if (c == '\n') {
        out += "\\n";
        continue;
      }
      out += c;
    }
    return out + "\"";
  }

  std::function<Clock::time_point()> now_;
  mutable std::mutex mutex_;
  std::map<Key, Figure> figures_;
  std::map<std::string, MetricKind, std::less<>> kinds_;  ///< by name, for the whole process
  std::uint64_t intervals_ = 0;
};

}  // namespace pulley
