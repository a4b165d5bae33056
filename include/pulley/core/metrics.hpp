// SPDX-License-Identifier: MIT
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

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
/// the outputs print: a counter's rate over the interval, a mean's average of the values
/// observed in it. Two outputs read the last closed interval:
///   - `json_lines`: one JSON object per task ({"time": ..., "task": "worker:0", "step":
///     ..., "loss": ...}), what `--metrics-file` appends;
///   - `prometheus`: Prometheus' text exposition format (version 0.0.4), each figure
///     `pulley_<name>{task="worker:0"}`, what `--metrics-port` serves.
/// A name is a Prometheus metric name without the prefix ([a-zA-Z_][a-zA-Z0-9_]*); a name
/// recorded with two kinds, or an invalid one, is refused (kInvalidArgument).
class Metrics {
 public:
  /// Sets gauge `name` of `task` to `value`.
  void set(std::string_view task, std::string_view name, double value) {
    record(task, name, MetricKind::kGauge, [&](Figure& f) { f.value = value; });
  }
  /// Adds `delta` (≥ 0) to counter `name` of `task` (`kind`: kCounter, or kRate to report
  /// its rate too).
  void add(std::string_view task, std::string_view name, double delta, MetricKind kind = MetricKind::kCounter) {
    record(task, name, counter(kind), [&](Figure& f) { f.value += delta; });
  }
  /// Sets counter `name` of `task` to `total`, a count kept elsewhere (a ps's Stats).
  void count(std::string_view task, std::string_view name, double total, MetricKind kind = MetricKind::kCounter) {
    record(task, name, counter(kind), [&](Figure& f) { f.value = total; });
  }
  /// Observes `value` for mean `name` of `task`: the interval's mean is reported.
  void observe(std::string_view task, std::string_view name, double value) {
    record(task, name, MetricKind::kMean, [&](Figure& f) {
      f.sum += value;
      ++f.observed;
    });
  }

  /// Ends the interval: each counter's rate is its growth since the last close over the
  /// `seconds` between them; each mean is the average of what was observed since (a mean
  /// with nothing observed keeps its last value).
  void close_interval(double seconds) {
    std::scoped_lock lock(mutex_);
    for (auto& [key, f] : figures_) {
      if (f.kind == MetricKind::kRate) {
        f.rate = seconds > 0 ? (f.value - f.at_close) / seconds : 0.0;
        f.at_close = f.value;
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
  /// mean's last closed interval); NaN when it was never recorded.
  [[nodiscard]] double value(std::string_view task, std::string_view name) const {
    std::scoped_lock lock(mutex_);
    const auto it = figures_.find(Key{std::string(task), std::string(name)});
    return it == figures_.end() ? std::nan("") : it->second.value;
  }

  /// One JSON object per task, a line each, as of the last closed interval: "time" (Unix
  /// seconds, `unix_seconds`), "task", then each figure by name (a kRate counter also as
  /// `<name>_per_s`); a mean never observed, or a value not finite, is null.
  [[nodiscard]] std::string json_lines(double unix_seconds) const {
    std::scoped_lock lock(mutex_);
    std::string out;
    std::string_view task;
    for (const auto& [key, f] : figures_) {
      if (out.empty() || key.first != task) {
        if (!out.empty()) out += "}\n";
        task = key.first;
        char time[32];
        std::snprintf(time, sizeof time, "%.3f", unix_seconds);
        out += "{\"time\":" + std::string(time) + ",\"task\":" + quoted(task);
      }
      out += ",\"" + key.second + "\":" + number(f.value);
      if (f.kind == MetricKind::kRate) out += ",\"" + key.second + "_per_s\":" + number(f.rate);
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
      const MetricKind kind = tasks.begin()->second->kind;
      const bool counter = kind == MetricKind::kCounter || kind == MetricKind::kRate;
      out += "# TYPE pulley_" + name + (counter ? " counter\n" : " gauge\n");
      for (const auto& [task, f] : tasks) out += "pulley_" + name + "{task=" + quoted(task) + "} " + sample(f->value) + "\n";
      if (kind != MetricKind::kRate) continue;
      out += "# TYPE pulley_" + name + "_per_s gauge\n";
      for (const auto& [task, f] : tasks) out += "pulley_" + name + "_per_s{task=" + quoted(task) + "} " + sample(f->rate) + "\n";
    }
    return out;
  }

  /// True if `name` may name a figure: [a-zA-Z_][a-zA-Z0-9_]*.
  [[nodiscard]] static bool valid_name(std::string_view name) noexcept {
    if (name.empty() || (name[0] >= '0' && name[0] <= '9')) return false;
    for (const char c : name) {
      if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
    }
    return true;
  }

 private:
  struct Figure {
    MetricKind kind = MetricKind::kGauge;
    double value = std::nan("");  ///< the gauge, the counter's total, the mean's last interval
    double rate = 0.0;       ///< kRate: per second over the last interval
    double at_close = 0.0;   ///< kRate: its total at the last close
    double sum = 0.0;        ///< a mean: observed since the last close
    std::uint64_t observed = 0;
  };
  using Key = std::pair<std::string, std::string>;  // task, name

  template <class Change>
  void record(std::string_view task, std::string_view name, MetricKind kind, Change&& change) {
    if (!valid_name(name)) {
      throw Error(ErrorCode::kInvalidArgument, "metric name '" + std::string(name) +
                                                   "' is not [a-zA-Z_][a-zA-Z0-9_]*");
    }
    std::scoped_lock lock(mutex_);
    auto [it, added] = figures_.try_emplace(Key{std::string(task), std::string(name)});
    Figure& f = it->second;
    if (added) {
      f.kind = kind;
      if (kind == MetricKind::kCounter || kind == MetricKind::kRate) f.value = 0.0;
    } else if (f.kind != kind) {
      throw Error(ErrorCode::kInvalidArgument, "metric '" + std::string(name) + "' of " + std::string(task) +
                                                   " was recorded as another kind before");
    }
    change(f);
  }

  /// `kind` if it is a counter's; throws otherwise.
  static MetricKind counter(MetricKind kind) {
    if (kind != MetricKind::kCounter && kind != MetricKind::kRate) {
      throw Error(ErrorCode::kInvalidArgument, "a counter's kind is kCounter or kRate");
    }
    return kind;
  }

  /// A JSON number; null when not finite.
  static std::string number(double v) {
    if (!std::isfinite(v)) return "null";
    char text[32];
    std::snprintf(text, sizeof text, "%.10g", v);
    return text;
  }
  /// A Prometheus sample value (NaN, +Inf and -Inf as Prometheus writes them).
  static std::string sample(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
    return number(v);
  }
  /// `text` in double quotes, with '\\', '"' and control characters escaped (valid both
  /// as a JSON string and as a Prometheus label value for the task names pulley makes).
  static std::string quoted(std::string_view text) {
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

  mutable std::mutex mutex_;
  std::map<Key, Figure> figures_;
  std::uint64_t intervals_ = 0;
};

}  // namespace pulley
