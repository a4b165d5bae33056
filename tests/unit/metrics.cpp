// SPDX-License-Identifier: MIT
// What a running job reports: Metrics' figures (counters, rates, gauges, interval means) in
// JSON lines and in Prometheus' text format, the HTTP endpoint a monitoring system scrapes,
// the reporter's file, and the chief's progress line.
#include "pulley/core/metrics.hpp"
#include "pulley/runner/metrics.hpp"
#include "support/log_capture.hpp"
#include "support/wait.hpp"

#include <doctest/doctest.h>

#include <asio.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>
#include <string>
#include <vector>

using namespace pulley;

namespace {

std::vector<nlohmann::json> parse_lines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

/// Sends `request` to 127.0.0.1:`port` and returns everything the server answers before it
/// closes the connection.
std::string http(std::uint16_t port, const std::string& request) {
  asio::io_context io;
  asio::ip::tcp::socket socket(io);
  socket.connect({asio::ip::make_address("127.0.0.1"), port});
  asio::write(socket, asio::buffer(request));
  std::string answer;
  asio::error_code error;
  for (char buffer[4096];;) {
    const std::size_t n = socket.read_some(asio::buffer(buffer), error);
    answer.append(buffer, n);
    if (error) break;
  }
  return answer;
}

}  // namespace

/// A clock the test moves by hand.
struct FakeClock {
  Metrics::Clock::time_point now{};
  void advance(double seconds) {
    now += std::chrono::duration_cast<Metrics::Clock::duration>(std::chrono::duration<double>(seconds));
  }
};

TEST_CASE("a counter reports its total and, as a rate, its growth per second between samples") {
  FakeClock clock;
  Metrics m([&clock] { return clock.now; });
  m.add("worker:0", "steps", 10, MetricKind::kRate);
  clock.advance(2.0);
  m.add("worker:0", "steps", 10, MetricKind::kRate);
  m.close_interval();
  CHECK(m.value("worker:0", "steps_per_s") == doctest::Approx(20.0 / 2.0));  // since the figure appeared
  clock.advance(4.0);
  m.add("worker:0", "steps", 30, MetricKind::kRate);
  m.count("ps:0", "workers_lost", 3);
  m.close_interval();
  const auto lines = parse_lines(m.json_lines(1700000000.25));
  REQUIRE(lines.size() == 2);
  CHECK(lines[0]["task"] == "ps:0");
  CHECK(lines[0]["workers_lost"] == 3);
  CHECK_FALSE(lines[0].contains("workers_lost_per_s"));  // a plain counter has no rate
  CHECK(lines[1]["task"] == "worker:0");
  CHECK(lines[1]["steps"] == 50);
  CHECK(lines[1]["steps_per_s"].get<double>() == doctest::Approx(30.0 / 4.0));
  CHECK(lines[1]["time"].get<double>() == doctest::Approx(1700000000.25));
  clock.advance(1.0);
  m.close_interval();  // nothing added: nothing done
  CHECK(m.value("worker:0", "steps_per_s") == 0.0);
  CHECK(m.intervals() == 3);
}

TEST_CASE("a count kept elsewhere is rated between its samples, from its first, and keeps its rate between them") {
  FakeClock clock;
  Metrics m([&clock] { return clock.now; });
  m.count("ps:0", "pushes_taken", 1000, MetricKind::kRate);  // the ps ran before it was watched
  clock.advance(0.3);
  m.close_interval();
  CHECK(m.value("ps:0", "pushes_taken_per_s") == 0.0);  // one sample: no rate yet, not 1000/0.3
  clock.advance(0.7);
  m.count("ps:0", "pushes_taken", 1100, MetricKind::kRate);  // a heartbeat a second later
  clock.advance(0.1);
  m.close_interval();
  CHECK(m.value("ps:0", "pushes_taken_per_s") == doctest::Approx(100.0));
  clock.advance(0.3);
  m.close_interval();  // no heartbeat in this interval: the rate stands
  CHECK(m.value("ps:0", "pushes_taken_per_s") == doctest::Approx(100.0));
  CHECK(m.value("ps:0", "pushes_taken") == 1100);
}

TEST_CASE("a mean is the average of the interval's values, and keeps the last one through an empty interval") {
  Metrics m;
  CHECK(std::isnan(m.value("worker:0", "loss")));
  m.observe("worker:0", "loss", 1.0);
  m.observe("worker:0", "loss", 3.0);
  CHECK(std::isnan(m.value("worker:0", "loss")));  // nothing closed yet
  m.close_interval();
  CHECK(m.value("worker:0", "loss") == 2.0);
  m.close_interval();
  CHECK(m.value("worker:0", "loss") == 2.0);
  m.observe("worker:0", "loss", 0.5);
  m.close_interval();
  CHECK(m.value("worker:0", "loss") == 0.5);
  m.set("worker:0", "global_step", 7);
  CHECK(m.value("worker:0", "global_step") == 7);
}

TEST_CASE("a name keeps its kind in the whole process, must be a Prometheus name, and leaves rates their names") {
  Metrics m;
  m.set("chief", "global_step", 1);
  CHECK_THROWS_WITH_AS(m.add("chief", "global_step", 1), doctest::Contains("another kind"), Error);
  CHECK_THROWS_WITH_AS(m.add("worker:0", "global_step", 1), doctest::Contains("another kind"), Error);
  m.add("worker:0", "steps", 1, MetricKind::kRate);
  CHECK_THROWS_WITH_AS(m.set("chief", "steps_per_s", 1), doctest::Contains("is the rate of the counter 'steps'"),
                       Error);
  m.set("chief", "pulls_per_s", 1);
  CHECK_THROWS_WITH_AS(m.add("worker:0", "pulls", 1, MetricKind::kRate), doctest::Contains("would have a rate"),
                       Error);
  CHECK_THROWS_AS(m.set("chief", "time", 1), Error);
  CHECK_THROWS_AS(m.set("chief", "task", 1), Error);
  CHECK_THROWS_AS(m.set("chief", std::vector<std::pair<std::string, double>>{{"ok", 1}, {"not ok", 2}}), Error);
  CHECK(std::isnan(m.value("chief", "ok")));  // all or nothing
  CHECK_THROWS_WITH_AS(m.set("chief", "test accuracy", 1), doctest::Contains("is not [a-zA-Z_]"), Error);
  CHECK_THROWS_AS(m.set("chief", "9lives", 1), Error);
  CHECK_THROWS_AS(m.set("chief", "", 1), Error);
  CHECK_THROWS_AS(m.add("chief", "x", 1, MetricKind::kGauge), Error);
  CHECK(Metrics::valid_name("pushes_taken_2"));
  CHECK_FALSE(Metrics::valid_name("a-b"));
}

TEST_CASE("JSON lines: values that are not finite are null, and task names are escaped") {
  Metrics m;
  m.set("odd \"task\"\\\n", "x", std::numeric_limits<double>::infinity());
  m.observe("odd \"task\"\\\n", "loss", 1.0);  // not closed: never observed
  const auto lines = parse_lines(m.json_lines(0));
  REQUIRE(lines.size() == 1);
  CHECK(lines[0]["task"] == "odd \"task\"\\\n");
  CHECK(lines[0]["x"].is_null());
  CHECK(lines[0]["loss"].is_null());
}

TEST_CASE("Prometheus text: a TYPE line per figure, one sample per task, rates as gauges") {
  FakeClock clock;
  Metrics m2([&clock] { return clock.now; });
  Metrics& m = m2;
  m.add("worker:0", "steps", 0, MetricKind::kRate);
  m.add("worker:1", "steps", 0, MetricKind::kRate);
  clock.advance(1.0);
  m.add("worker:0", "steps", 5, MetricKind::kRate);
  m.add("worker:1", "steps", 7, MetricKind::kRate);
  m.set("chief", "test_accuracy", 0.875);
  m.set("ps:0", "queue_length", std::nan(""));
  m.set("a\\b\"c\nd\x01", "bytes_in", 12345678901234.0);  // a task name to escape; a large count exactly
  m.close_interval();
  const std::string text = m.prometheus();
  CHECK(text.find("# TYPE pulley_steps counter\npulley_steps{task=\"worker:0\"} 5\npulley_steps{task=\"worker:1\"} 7\n") !=
        std::string::npos);
  CHECK(text.find("# TYPE pulley_steps_per_s gauge\npulley_steps_per_s{task=\"worker:0\"} 5\n") != std::string::npos);
  CHECK(text.find("# TYPE pulley_test_accuracy gauge\npulley_test_accuracy{task=\"chief\"} 0.875\n") != std::string::npos);
  CHECK(text.find("pulley_queue_length{task=\"ps:0\"} NaN\n") != std::string::npos);
  // Only '\\', '"' and newline are escaped in a label value.
  CHECK(text.find("pulley_bytes_in{task=\"a\\\\b\\\"c\\nd\x01\"} 12345678901234\n") != std::string::npos);
  // Every line is a comment or a sample Prometheus' parser reads.
  const std::regex sample(R"(pulley_[a-zA-Z_][a-zA-Z0-9_]*\{task="([^"\\\n]|\\.)*"\} (NaN|[+-]Inf|-?[0-9.e+-]+))");
  std::istringstream in(text);
  std::size_t samples = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("# TYPE ")) continue;
    CAPTURE(line);
    CHECK(std::regex_match(line, sample));
    ++samples;
  }
  CHECK(samples == 7);
}

TEST_CASE("the endpoint answers GET /metrics with the figures, and refuses other paths and methods") {
  int calls = 0;
  const std::string body = "pulley_global_step{task=\"chief\"} 12\n";
  MetricsEndpoint endpoint("127.0.0.1", 0, [&] {
    ++calls;
    return body;
  });
  REQUIRE(endpoint.port() != 0);
  const std::string ok = http(endpoint.port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(ok.starts_with("HTTP/1.1 200 OK\r\n"));
  CHECK(ok.find("Content-Type: text/plain; version=0.0.4") != std::string::npos);
  CHECK(ok.find("Content-Length: " + std::to_string(body.size()) + "\r\n") != std::string::npos);
  CHECK(ok.ends_with("\r\n\r\n" + body));
  CHECK(http(endpoint.port(), "GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
  const std::string post = http(endpoint.port(), "POST /metrics HTTP/1.1\r\n\r\n");
  CHECK(post.starts_with("HTTP/1.1 405 "));
  CHECK(post.find("\r\nAllow: GET, HEAD\r\n") != std::string::npos);
  const std::string head = http(endpoint.port(), "HEAD /metrics HTTP/1.1\r\n\r\n");
  CHECK(head.ends_with("\r\n\r\n"));  // the headers, no body
  CHECK(calls == 2);
  // A request that never ends within 8 KiB is closed unanswered; the endpoint serves on.
  CHECK(http(endpoint.port(), "GET /metrics HTTP/1.1\r\nX: " + std::string(10000, 'a')).empty());
  // A client that connects and says nothing does not keep the next one waiting.
  asio::io_context io;
  asio::ip::tcp::socket idle(io);
  idle.connect({asio::ip::make_address("127.0.0.1"), endpoint.port()});
  CHECK(http(endpoint.port(), "GET /metrics HTTP/1.0\r\n\r\n").starts_with("HTTP/1.1 200 OK"));
}

TEST_CASE("an endpoint that cannot listen says where") {
  MetricsEndpoint first("127.0.0.1", 0, [] { return std::string(); });
  const std::string where = "metrics: cannot listen on 127.0.0.1:" + std::to_string(first.port());
  CHECK_THROWS_WITH_AS(MetricsEndpoint("127.0.0.1", first.port(), [] { return std::string(); }),
                       doctest::Contains(where.c_str()), Error);
}

TEST_CASE("the reporter appends each interval's lines to the task's file, and the last figures at its end") {
  const auto dir = std::filesystem::temp_directory_path() / "pulley-metrics-test";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  MetricsOptions options;
  options.file = (dir / "{task}.jsonl").string();
  options.interval = std::chrono::milliseconds(20);
  {
    MetricsReporter reporter(options, "worker-1");
    reporter.metrics().add("worker:1", "steps", 1, MetricKind::kRate);
    const std::uint64_t added_in = reporter.metrics().intervals();  // (some may have closed before)
    CHECK(testing::wait_until([&] { return reporter.metrics().intervals() >= added_in + 2; }));
    reporter.metrics().add("worker:1", "steps", 41, MetricKind::kRate);
  }
  std::ifstream in(dir / "worker-1.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  REQUIRE(lines.size() >= 3);
  CHECK(lines.front()["steps"] == 1);
  CHECK(lines.back()["steps"] == 42);  // written when the reporter ended
  for (const auto& line : lines) CHECK(line["task"] == "worker:1");
  options.file = (dir / "missing" / "x.jsonl").string();
  CHECK_THROWS_WITH_AS(MetricsReporter(options, "chief-0"), doctest::Contains("metrics: cannot open"), Error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("the reporter serves the figures on its port, each task of a cluster on its own") {
  CHECK(metrics_port_offset("ps", 1, 2, 1, 3) == 1);
  CHECK(metrics_port_offset("chief", 0, 2, 1, 3) == 2);
  CHECK(metrics_port_offset("worker", 2, 2, 1, 3) == 5);
  CHECK(metrics_port_offset("evaluator", 0, 2, 1, 3) == 6);
  CHECK(metrics_port_offset("worker", 0, 2, 0, 3) == 2);  // no chief task: worker 0 is the chief
  CHECK(metrics_port_offset("ps", 2, 2, 1, 3, true) == kAnyMetricsPort);  // joined: the system picks
  MetricsOptions options;
  options.port = 0;
  MetricsReporter reporter(options, "ps-0");
  Stats stats;
  stats.global_step = 9;
  stats.pushes_taken = 18;
  record_stats(reporter.metrics(), "ps:0", stats);
  reporter.metrics().close_interval();
  const std::string text = http(reporter.port(), "GET /metrics HTTP/1.1\r\n\r\n");
  CHECK(text.find("pulley_global_step{task=\"ps:0\"} 9\n") != std::string::npos);
  CHECK(text.find("pulley_pushes_taken{task=\"ps:0\"} 18\n") != std::string::npos);
  options.port = 65535;
  CHECK_THROWS_WITH_AS(MetricsReporter(options, "worker-3", 3), doctest::Contains("over 65535"), Error);
  // A task that joins takes a port the system picks, never PORT + its offset: with the
  // job's first port taken (here by the reporter above), it still serves.
  options.port = reporter.port();
  MetricsReporter joined(options, "ps-2", metrics_port_offset("ps", 2, 2, 1, 3, true));
  CHECK(joined.port() != 0);
  CHECK(joined.port() != reporter.port());
  joined.metrics().close_interval();
  CHECK(http(joined.port(), "GET /metrics HTTP/1.1\r\n\r\n").find("200") != std::string::npos);
}

TEST_CASE("the chief's progress line: step, epoch, examples/s and the time left") {
  CHECK(ChiefProgress::line(1234, 9370, 937, 118402.4, 10.0) ==
        "chief: global step 1234 of 9370 (epoch 2 of 10), 118402 examples/s, 13 min 34 s left");
  CHECK(ChiefProgress::line(50, 100, 0, 0.0, 0.0) == "chief: global step 50 of 100");
  CHECK(ChiefProgress::line(0, 100000, 0, 0.0, 10.0) == "chief: global step 0 of 100000, 2 h 46 min left");
  CHECK(ChiefProgress::line(100, 100, 10, 5.0, 3.0) == "chief: global step 100 of 100 (epoch 10 of 10), 5 examples/s");
}

TEST_CASE("the chief's figures come from its heartbeats: the slowest ps's step, and the rate between beats") {
  using Clock = ChiefProgress::Clock;
  const auto t0 = Clock::now();
  std::mutex mutex;
  ChiefProgress::Beat beat;  // ps 0 at step 10, ps 1 not heard yet
  beat.stats = {Stats{}, std::nullopt};
  beat.stats[0]->global_step = 10;
  beat.at = t0;
  Metrics metrics;
  MetricsOptions options;
  options.port = 0;  // enabled; nothing listens: the ChiefProgress only records
  options.interval = std::chrono::milliseconds(5);
  options.progress = std::chrono::milliseconds(0);
  const auto wait_for = [&](double step) {
    for (int i = 0; i < 2000 && metrics.value("chief", "global_step") != step; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return metrics.value("chief", "global_step");
  };
  ChiefProgress progress(
      [&] {
        std::scoped_lock lock(mutex);
        return beat;
      },
      &metrics, options, /*last_step=*/1000, /*samples_per_step=*/64, /*steps_per_epoch=*/100);
  CHECK(wait_for(10) == 10);
  {
    std::scoped_lock lock(mutex);  // two seconds later both ps tasks answer: ps 1 is behind
    beat.stats = {Stats{}, Stats{}};
    beat.stats[0]->global_step = 52;
    beat.stats[1]->global_step = 50;
    beat.at = t0 + std::chrono::seconds(2);
  }
  CHECK(wait_for(50) == 50);
  CHECK(metrics.value("chief", "examples_per_s") == doctest::Approx(20.0 * 64));  // 40 steps in 2 s
  CHECK(metrics.value("chief", "examples") == 40 * 64);
  progress.reached(1000);  // the chief saw the last step; the beats have not yet
  CHECK(wait_for(1000) == 1000);
}

TEST_CASE("an evaluation's scores are recorded with its step once evaluate returns, and a bad score never throws") {
  pulley::testing::LogCapture log;
  Metrics metrics;
  metrics.count("chief", "examples", 100);
  {
    EvaluationScores scores(&metrics, "chief", 468);
    const auto report = scores.reporter();
    report("test_accuracy", 0.85);
    CHECK(std::isnan(metrics.value("chief", "test_accuracy")));  // not before evaluate returned
    CHECK_NOTHROW(report("accuracy@5", 0.9));  // not a name: left out
    CHECK_NOTHROW(report("examples", 1.0));    // the chief's counter: left out at commit
    scores.commit();
  }
  CHECK(metrics.value("chief", "test_accuracy") == 0.85);
  CHECK(metrics.value("chief", "evaluation_step") == 468);
  CHECK(metrics.value("chief", "examples") == 100);
  CHECK(log.find(LogLevel::kWarning, "the score 'accuracy@5' is left out").size() == 1);
  CHECK(log.find(LogLevel::kWarning, "the score 'examples' is left out").size() == 1);
  // Without metrics the names are checked all the same (one warning per name and process).
  EvaluationScores nowhere(nullptr, "evaluator", 10);
  nowhere.reporter()("bad name", 1.0);
  nowhere.commit();
  CHECK(log.find(LogLevel::kWarning, "the score 'bad name' is left out").size() == 1);
}

TEST_CASE("the endpoint serves 16 clients at once, and the next once one of them leaves") {
  MetricsEndpoint endpoint("127.0.0.1", 0, [] { return std::string("x 1\n"); });
  asio::io_context io;
  std::vector<asio::ip::tcp::socket> idle;
  for (int i = 0; i < 16; ++i) {
    idle.emplace_back(io);
    idle.back().connect({asio::ip::make_address("127.0.0.1"), endpoint.port()});
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // all 16 taken in
  asio::ip::tcp::socket next(io);
  next.connect({asio::ip::make_address("127.0.0.1"), endpoint.port()});
  asio::write(next, asio::buffer(std::string("GET /metrics HTTP/1.1\r\n\r\n")));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK(next.available() == 0);  // not served while 16 wait
  idle.front().close();
  std::string answer;
  asio::error_code error;
  for (char buffer[1024]; !error;) answer.append(buffer, next.read_some(asio::buffer(buffer), error));
  CHECK(answer.starts_with("HTTP/1.1 200 OK"));
}
